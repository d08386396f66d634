"""Issue 55: verifying a merged model's ONNX export with ONNX Runtime's merge choices replayed in PyTorch
(``edgeprune.tokens.replay``, ``exporters.merge_replay``): near-tied similarities can pair tokens differently in the
two runtimes; the replay checks the graph's function and how far each differing choice is from PyTorch's own."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch

import edgeprune
import edgeprune.jobs.verify as verify_job
from edgeprune.tokens.replay import MergeReplay, replaying
from exporters.merge_replay import NEAR_TIE, decision_outputs, format_replay, replay_compare
from exporters.onnx import export_onnx
from nets import dense_nets

X = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """A DPT-style network, half its widths pruned and 4 tokens merged per branch, and its export."""
    res = edgeprune.prune(dense_nets.dpt_net(), torch.randn(32, 3, 32, 32), target="both", sparsity=0.5,
                          tokens_merge=4)
    path = export_onnx(res.model, tmp_path_factory.mktemp("replay") / "m.onnx", (3, 32, 32))
    return res.model.eval(), path


def _own_decisions(model, x):
    """PyTorch's own (best_idx, order) of every matching on ``x``, in the order they run."""
    seen = []

    class Spy(MergeReplay):
        def take(self, scores, best, best_idx, order, r):
            seen.append((best_idx.clone(), order.clone()))
            return best_idx, order

    with replaying(Spy([])), torch.no_grad():
        out = _flat(model(x))
    return seen, out


def _flat(y):
    return torch.cat([v.flatten(1) for v in y.values()], 1)


def test_the_graph_names_one_decision_pair_per_matching_and_replays_to_pytorchs_output(merged):
    model, path = merged
    pairs = decision_outputs(onnx.load(str(path)))
    assert len(pairs) == 2 * 4  # 4 blocks, a matching before attention and one before the MLP
    rep = replay_compare(path, model, X.numpy(), atol=1e-5, batch_size=4)  # two chunks: 4 + 2 inputs
    assert rep["passed"] and rep["matchings"] == 8 and rep["inputs_within_tolerance"] == 6
    assert rep["max_abs_diff"] < 1e-5 and rep["max_similarity_gap"] <= NEAR_TIE
    assert "6 of 6 inputs within tolerance" in format_replay(rep)


def test_replaying_pytorchs_own_choices_changes_nothing_and_a_swapped_choice_is_measured(merged):
    model = merged[0]
    own, ref = _own_decisions(model, X)
    same = MergeReplay(own)
    with replaying(same), torch.no_grad():
        assert torch.equal(_flat(model(X)), ref)
    assert not same.differs.any() and float(same.gap.max()) == 0.0
    # the 4th most similar A token (merged, r = 4) swapped with the 5th (not merged) at the first matching
    best_idx, order = (t.clone() for t in own[0])
    order[:, [3, 4]] = order[:, [4, 3]]
    swapped = MergeReplay([(best_idx, order)] + own[1:])
    with replaying(swapped), torch.no_grad():
        out = _flat(model(X))
    assert swapped.differs.all() and not torch.allclose(out, ref, atol=1e-4)
    # the similarity given up: the 4th best minus the 5th best of PyTorch's own ranking at that step
    vit = model.pretrained
    x0 = vit.norm_pre(vit._pos_embed(vit.patch_embed(X)))
    m = vit.blocks[0].norm1(x0)[:, vit.num_prefix_tokens:]
    m = m / m.norm(dim=-1, keepdim=True)
    best = (m[:, 0::2] @ m[:, 1::2].transpose(-1, -2)).max(-1).values.double()
    want = best.gather(-1, own[0][1][:, 3:4]) - best.gather(-1, own[0][1][:, 4:5])
    assert torch.allclose(swapped.gap, want.squeeze(-1), atol=1e-6) and float(swapped.gap.min()) > 0


def test_a_graph_that_computes_another_function_fails_even_with_its_choices_replayed(merged, tmp_path):
    model, path = merged
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.pretrained.blocks[1].mlp.fc2.weight.mul_(1.5)
    rep = replay_compare(path, other, X.numpy(), atol=1e-4)
    assert not rep["passed"] and rep["inputs_within_tolerance"] == 0


def test_a_graph_that_merges_the_least_similar_tokens_fails_on_its_similarity_gap(merged, tmp_path):
    model, path = merged
    g = onnx.load(str(path))
    tops = {pair[1] for pair in decision_outputs(g)}
    for node in g.graph.node:  # TopK largest=0: the least similar A tokens merge (a wrong graph)
        if node.op_type == "TopK" and node.output[1] in tops:
            for a in node.attribute:
                if a.name == "largest":
                    a.i = 0
    bad = tmp_path / "least.onnx"
    onnx.save(g, str(bad))
    rep = replay_compare(bad, model, X.numpy(), atol=1e-4)
    assert rep["inputs_within_tolerance"] == 6  # PyTorch follows the graph's choices: the outputs agree
    assert rep["max_similarity_gap"] > 100 * NEAR_TIE and not rep["passed"]  # ... but they are no near-ties
    assert "NOT near-ties" in format_replay(rep)


def test_a_model_without_merges_has_nothing_to_replay(tmp_path):
    net = dense_nets.dpt_net().eval()
    path = export_onnx(net, tmp_path / "d.onnx", (3, 32, 32))
    assert decision_outputs(onnx.load(str(path))) == []
    assert replay_compare(path, net, X.numpy(), atol=1e-4) is None


def test_verify_of_a_merged_model_whose_plain_comparison_fails_is_judged_by_the_replay(merged):
    model, path = merged
    report = {"passed": False, "atol": 1e-4, "rtol": 0.0, "output_kind": "dense"}
    verify_job._replay(report, path, model, X, 4)
    assert report["passed"] and report["passed_without_replay"] is False
    assert report["merge_replay"]["inputs_within_tolerance"] == 6
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.head.weight.mul_(1.5)
    bad = {"passed": False, "atol": 1e-4, "rtol": 0.0, "output_kind": "dense"}
    verify_job._replay(bad, path, wrong, X, 4)
    assert not bad["passed"]
    assert np.isfinite(bad["merge_replay"]["max_abs_diff"])
