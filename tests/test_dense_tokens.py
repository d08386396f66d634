"""Issue 55, item 2: token merging inside the blocks of a network with a dense head, unmerged before each residual
add (``edgeprune.tokens.unmerge``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import onnx
import pytest
import torch

import edgeprune
from conftest import assert_one_line_error, run_cli
from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import load_run
from edgeprune.flops import block_flops, model_flops
from edgeprune.tokens.apply import apply_token_merge
from edgeprune.tokens.merge import bipartite_soft_matching, merge_wavg, split_sizes
from edgeprune.tokens.unmerge import TokenUnmergeBlock, unmerge
from exporters.onnx import export_onnx
from exporters.verify import verify_onnx
from nets import dense_nets

NETS = Path(dense_nets.__file__).resolve()
X = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5))


def _flat(y):
    vals = list(y.values()) if isinstance(y, dict) else ([y] if isinstance(y, torch.Tensor) else list(y))
    return torch.cat([v.flatten(1) for v in vals], 1)


@pytest.mark.parametrize("r", [0, 1, 5, 8])
def test_unmerge_puts_every_token_back_where_it_was(r):
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(r))
    plan = bipartite_soft_matching(x, r, 3, 19)
    merged, _ = merge_wavg(x, None, plan)
    back = unmerge(merged, plan, 19)
    assert back.shape == x.shape
    changed = (back - x).abs().amax(-1) > 1e-6
    assert torch.equal(back[:, :3], x[:, :3])  # prefix never merged
    # exactly the merged A tokens and the B tokens they went into differ from their input
    assert int(changed.sum()) <= 2 * r * x.shape[0] and (r == 0) == (not changed.any())
    # unmerging a token-wise function of the merged tokens = that function at each token's merged value
    assert torch.allclose(unmerge(merged * 2 + 1, plan, 19), back * 2 + 1, atol=1e-6)


def test_duplicated_tokens_merged_give_the_unmerged_output():
    vit = dense_nets.tiny_vit(reg=2)
    blk = vit.blocks[0]
    half = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    x = torch.cat([torch.randn(2, 3, 64), half.repeat_interleave(2, dim=1)], 1)  # A_i == B_i: 8 equal pairs
    ref = blk(x)
    got = TokenUnmergeBlock(copy.deepcopy(blk), 8, 3, 19)(x)
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("builder", ["saliency_net", "dpt_net", "hook_net"])
def test_r_zero_is_exact_and_a_merge_keeps_every_output_shape(builder):
    net = dense_nets.__dict__[builder]()
    ref = net(X)
    zero = copy.deepcopy(net)
    apply_token_merge(zero, [0] * 4)
    assert torch.equal(_flat(zero(X)), _flat(ref))
    res = edgeprune.prune(net, torch.randn(32, 3, 32, 32), target="mlp", sparsity=0.0, tokens_merge=3)
    got = res.model(X)
    assert res.record["tokens_merge"]["unmerge"] and res.record["tokens_merge"]["r"] == [3] * 4
    assert _flat(got).shape == _flat(ref).shape and not torch.equal(_flat(got), _flat(ref))
    reloaded = copy.deepcopy(net)
    apply_token_merge(reloaded, res.record["tokens_merge"]["r"])  # what load_run re-applies
    assert torch.equal(_flat(reloaded(X)), _flat(got))


def test_merged_network_exports_static_shapes_and_verifies(tmp_path):
    res = edgeprune.prune(dense_nets.dpt_net(), torch.randn(32, 3, 32, 32), target="both", sparsity=0.5,
                          tokens_merge=4)
    path = export_onnx(res.model, tmp_path / "m.onnx", (3, 32, 32), dynamic_batch=False, batch_size=2)
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True).graph
    ops = {n.op_type for n in graph.node}
    assert not ops & {"ScatterElements", "ScatterND", "NonZero", "Loop", "If"}
    for v in [*graph.value_info, *graph.output]:
        dims = v.type.tensor_type.shape.dim
        assert all(d.HasField("dim_value") for d in dims), (v.name, dims)
    assert verify_onnx(path, res.model, X[:2], atol=1e-4)["passed"]
    dyn = export_onnx(res.model, tmp_path / "d.onnx", (3, 32, 32))
    assert verify_onnx(dyn, res.model, X, atol=1e-4)["passed"]


def test_a_merged_network_run_saves_loads_and_exports_though_its_merges_add_up_past_its_tokens(tmp_path):
    """A block that unmerges passes all its tokens on: the record's per-block ``tokens`` stay at N (17 here) where
    the classifier merge would count down (17 - 3 x 8 < 0, which the run directory's own check refused: the
    DINOv2 DPT example at 224 px with r=32 could not be exported)."""
    calib = dense_nets.image_folder(tmp_path / "calib", 16, 0)
    out = tmp_path / "run"
    res = run_cli(["prune", "--model-file", f"{NETS}:dpt_net", "--calib", calib, "--sparsity", "0.5",
                   "--tokens-merge", "8", "--no-eval", "--quiet", "-o", out])
    assert res.exit_code == 0, res.output
    blocks = json.loads((out / "run.json").read_text())["blocks"]
    assert [(b["tokens"], b["merge"]) for b in blocks] == [(17, 8)] * 4
    model, _ = load_run(out)
    res = run_cli(["export", out, "-o", tmp_path / "m.onnx"])
    assert res.exit_code == 0, res.output
    assert verify_onnx(tmp_path / "m.onnx", model, X[:2], atol=1e-4)["passed"]
    ev = dense_nets.image_folder(tmp_path / "eval", 4, 1)
    res = run_cli(["verify", tmp_path / "m.onnx", "--against", out, "--data", ev])
    assert res.exit_code == 0 and "inputs within tolerance: 4 of 4" in res.output and "merge replay" not in res.output
    # a merged model that fails is compared again with ONNX Runtime's merge choices replayed (tests/test_merge_replay)
    res = run_cli(["verify", tmp_path / "m.onnx", "--against", out, "--data", ev, "--atol", "1e-12"])
    assert res.exit_code == 1 and "merge replay:  with ONNX Runtime's 8 token-merge choices" in res.output
    assert "inputs within tolerance: 0 of 4" in res.output and "FAIL (atol 1e-12, ONNX Runtime's merge" in res.output


def test_flops_count_the_merged_tokens_per_block():
    net = dense_nets.dpt_net()
    dense = find_anatomy(net)
    apply_token_merge(net, [4, 0, 2, 4])
    an = find_anatomy(net)
    n, D, p = 17, 64, 1
    for b, d, r in zip(an.blocks, dense.blocks, [4, 0, 2, 4]):
        got = block_flops(b, n, p)
        base = block_flops(d, n - r, p)
        na, nb = split_sizes(n, p)
        merge = 2 * (2 * na * nb * D + 2 * nb * r * (D + 1)) if r else 0
        assert got["total"] == base["total"] + merge
    assert model_flops(an)["total"] < model_flops(dense)["total"]


def test_too_large_a_merge_and_a_second_merge_are_refused(tmp_path):
    calib = dense_nets.image_folder(tmp_path / "calib", 4, 0)
    res = run_cli(["prune", "--model-file", f"{NETS}:dpt_net", "--calib", calib, "--tokens-merge", "9",
                   "--no-eval", "-o", tmp_path / "run"])
    assert_one_line_error(res, "block 0 would merge 9 tokens but can merge at most 8")
    net = dense_nets.dpt_net()
    apply_token_merge(net, [2] * 4)
    with pytest.raises(edgeprune.UserError, match="merged already"):
        apply_token_merge(net, [2] * 4)
