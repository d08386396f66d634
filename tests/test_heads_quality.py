"""Whole heads compensated through the MLP that follows (edgeprune.solve.attn_heads,
edgeprune.head_compensation; docs/heads.md)."""

from __future__ import annotations

import copy

import pytest
import torch

import edgeprune.pruning.corp as pipeline
from edgeprune.anatomy import find_anatomy
from edgeprune.api import prune
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp import CorpConfig, apply_corp
from edgeprune.head_compensation import collect_fit_statistics, compensate_heads_through_mlp, prepare_refit
from edgeprune.plan import BlockPlan
from edgeprune.solve.attn_heads import OutputFitStatistics, refit_linear
from edgeprune.vo import rank_heads
from tests.conftest import needs_fmnist


def _images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


def _logits(model, x):
    with torch.no_grad():
        return model(x)


# ---- the solver ----------------------------------------------------------------------------------
def _rows(n: int, m: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, m, generator=g, dtype=torch.float64) @ torch.randn(m, m, generator=g, dtype=torch.float64) + 0.5


def test_refit_recovers_an_exactly_linear_target_and_keeps_an_exact_prior():
    h = _rows(4000, 12, 0)
    g = torch.Generator().manual_seed(1)
    w_true, b_true = torch.randn(5, 12, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    st = OutputFitStatistics(12, 5, torch.float64)
    for chunk in h.split(700):
        st.add_batch(chunk, chunk @ w_true.T + b_true)
    # far prior, tiny ridge: the exact map
    w, b, _ = refit_linear(st, torch.zeros(5, 12, dtype=torch.float64), 1e-12)
    assert torch.allclose(w, w_true, atol=1e-6) and torch.allclose(b, b_true, atol=1e-6)
    assert st.residual(w, b) <= 1e-9
    # the prior is the exact map: any ridge returns it (nothing removed -> nothing changes)
    w, b, lam = refit_linear(st, w_true, 0.5)
    assert lam > 0 and torch.allclose(w, w_true, atol=1e-9) and torch.allclose(b, b_true, atol=1e-9)


def test_residual_matches_the_direct_mean_square():
    h = _rows(3000, 7, 2)
    t = torch.sin(h[:, :4]) + 0.1 * h[:, 4:5]
    st = OutputFitStatistics(7, 4, torch.float64)
    for a, b in zip(h.split(512), t.split(512)):
        st.add_batch(a, b)
    w = torch.randn(4, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    bias = torch.randn(4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    direct = float((t - h @ w.T - bias).pow(2).sum(1).mean())
    assert st.residual(w, bias) == pytest.approx(direct, rel=1e-9)
    w2, b2, _ = refit_linear(st, w, 1e-3)
    assert st.residual(w2, b2) < st.residual(w, bias)   # the fit never loses to its prior


def test_statistics_refuse_mismatched_rows():
    st = OutputFitStatistics(3, 2)
    with pytest.raises(ValueError):
        st.add_batch(torch.zeros(4, 3), torch.zeros(5, 2))


# ---- on the model --------------------------------------------------------------------------------
def _head_plans(an, stats, keep: int, blocks) -> list[BlockPlan]:
    plans = [BlockPlan(b.index) for b in an.blocks]
    for i in blocks:
        b = an.blocks[i]
        plans[i].head_keep = rank_heads(stats.vo[i], b.proj.weight.detach(), b.num_heads, keep)
    return plans


def _block_output_errors(dense, model, indices, x) -> dict[int, float]:
    """Mean squared block-output error of the pruned blocks on the dense stream's inputs."""
    an_d, an_p = find_anatomy(dense), find_anatomy(model)
    io = {}
    hooks = [an_d.blocks[i].block.register_forward_hook(
        lambda _m, a, o, i=i: io.__setitem__(i, (a[0], o))) for i in indices]
    _logits(dense, x)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        return {i: float((an_p.blocks[i].block(io[i][0]) - io[i][1]).pow(2).mean()) for i in indices}


def _fold_only(dense, x, blocks, keep=1):
    """The head-pruned model after CORP's proj fold alone (no MLP refit), its plans and anatomy."""
    model = copy.deepcopy(dense)
    an = find_anatomy(model)
    stats = collect_statistics(an, [x], mlp=False, qk=False, vo=True, progress=False)
    plans = _head_plans(an, stats, keep, blocks)
    cfg = CorpConfig()
    refit = prepare_refit(an, plans, cfg)
    apply_corp(an, plans, cfg, [None] * len(plans), None, stats.vo)
    return model, an, refit, cfg


def test_refit_lowers_every_block_output_error_on_the_calibration_set(fmnist_model):
    x = _images(48, 5)
    blocks = [1, 3, 4]
    model, an, refit, cfg = _fold_only(fmnist_model, x, blocks)
    assert refit is not None and refit.indices == blocks
    before = _block_output_errors(fmnist_model, model, blocks, x)
    info = compensate_heads_through_mlp(refit, an, cfg, lambda: [x[:24], x[24:]])
    after = _block_output_errors(fmnist_model, model, blocks, x)
    for i in blocks:
        assert after[i] < 0.95 * before[i], (i, before, after)
        e0, e1 = info[i]["mlp_refit_error"]
        assert e1 < e0
    # blocks that kept their heads are untouched
    for i in (0, 2, 5):
        assert torch.equal(find_anatomy(model).blocks[i].fc2.weight, find_anatomy(fmnist_model).blocks[i].fc2.weight)


def test_refit_of_an_unpruned_block_changes_nothing(fmnist_model):
    """The statistics of a block whose attention is the dense one give back the same fc2."""
    x = _images(32, 6)
    model = copy.deepcopy(fmnist_model)
    an = find_anatomy(model)
    st = collect_fit_statistics(fmnist_model, an, [2], lambda: [x], torch.float64)[2]
    w, b, _ = refit_linear(st, an.blocks[2].fc2.weight.detach().double(), 1e-3)
    assert torch.allclose(w, an.blocks[2].fc2.weight.double(), atol=1e-4)
    assert torch.allclose(b, an.blocks[2].fc2.bias.double(), atol=1e-4)


def test_pruning_no_heads_takes_no_refit_pass(fmnist_model):
    x = _images(8, 0)
    an = find_anatomy(copy.deepcopy(fmnist_model))
    plans = [BlockPlan(b.index) for b in an.blocks]
    assert prepare_refit(an, plans, CorpConfig()) is None
    res = prune(fmnist_model, x, target="heads", sparsity=0.0)
    assert (_logits(res.model, x) - _logits(fmnist_model, x)).abs().max() <= 1e-5
    assert "mlp_refit_lambda" not in str(res.record)


def test_exactly_redundant_head_stays_exact_through_the_whole_prune(fmnist_model):
    """Head 1 of block 4 := head 0 with V_1 = M V_0 + c: the proj fold is exact, and the MLP refit
    that follows (now part of every head prune) must keep it exact."""
    x = _images(32, 3)
    dense = copy.deepcopy(fmnist_model)
    attn = dense.blocks[4].attn
    d = attn.head_dim
    mix = torch.eye(d) + 0.3 * torch.randn(d, d, generator=torch.Generator().manual_seed(0)) / d ** 0.5
    with torch.no_grad():
        w, b = attn.qkv.weight, attn.qkv.bias
        for part in (0, 1):
            w[part * 2 * d + d: part * 2 * d + 2 * d] = w[part * 2 * d: part * 2 * d + d]
            b[part * 2 * d + d: part * 2 * d + 2 * d] = b[part * 2 * d: part * 2 * d + d]
        w[5 * d:] = mix @ w[4 * d: 5 * d]
        b[5 * d:] = mix @ b[4 * d: 5 * d] + 0.1
    dims = [{"heads": 2}] * 6
    dims[4] = {"heads": 1}
    res = prune(dense, x, target="heads", sparsity=None, dims=dims, ridge_alpha=1e-9)
    assert find_anatomy(res.model).blocks[4].num_heads == 1
    assert "mlp_refit_lambda" in res.record["solve"][4]
    assert float((_logits(res.model, x) - _logits(dense, x)).abs().max()) <= 1e-4


@needs_fmnist
def test_refit_lowers_held_out_logit_error_of_head_pruning(fmnist_model, fmnist_calib, monkeypatch):
    """End to end on the trained model (calibration and evaluation images disjoint)."""
    calib, x_eval, _ = fmnist_calib
    x_eval = x_eval[:128]
    errs = {}
    for refit in (True, False):
        if not refit:
            monkeypatch.setattr(pipeline, "prepare_refit", lambda *a: None)
        model = prune(fmnist_model, calib[:128], target="heads", sparsity=0.5).model
        errs[refit] = float((_logits(model, x_eval) - _logits(fmnist_model, x_eval)).pow(2).mean())
    assert errs[True] < 0.85 * errs[False], errs


def test_sequential_head_prune_refits_and_lowers_block_error(fmnist_model):
    """Sequential calibration refits fc2 of the blocks that lost heads (pruned-stream input, dense
    output); a model with the refit switched off has a larger logit error on the calibration set."""
    x = _images(48, 7)
    dims = [{"heads": 1}] * 6
    res = prune(fmnist_model, x, target="heads", sparsity=None, dims=dims, sequential=True)
    solve = res.record["solve"]
    assert all("mlp_refit_lambda" in solve[i] for i in range(6))
    e_on = float((_logits(res.model, x) - _logits(fmnist_model, x)).pow(2).mean())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("edgeprune.sequential.block.refit_from_streams", lambda *a: {})
        off = prune(fmnist_model, x, target="heads", sparsity=None, dims=dims, sequential=True).model
    e_off = float((_logits(off, x) - _logits(fmnist_model, x)).pow(2).mean())
    assert e_on < 0.9 * e_off, (e_on, e_off)


def test_statistics_of_two_shards_add_up_to_one_pass():
    """What the all-reduce under torchrun does: two processes' statistics (each shifted by its
    own first batch) summed equal the statistics of one pass over all rows."""
    h = _rows(2000, 6, 8)
    h = h[torch.argsort(h[:, 0])]  # batches with different means: the shifts matter
    t = torch.tanh(h[:, :3]) + 2.0
    whole = OutputFitStatistics(6, 3, torch.float64)
    whole.add_batch(h, t)
    shards = [OutputFitStatistics(6, 3, torch.float64) for _ in range(2)]
    shards[0].add_batch(h[:200], t[:200])
    shards[0].add_batch(h[200:700], t[200:700])
    shards[1].add_batch(h[1500:], t[1500:])
    shards[1].add_batch(h[700:1500], t[700:1500])
    parts = shards
    parts[1].unshift()
    other = [parts[1]._sum_h, parts[1]._sum_t, parts[1]._hh, parts[1]._th,
             torch.tensor([parts[1]._tt, float(parts[1].count)], dtype=torch.float64)]

    def reduce_sum(x):  # rank 0's tensor + rank 1's matching one (all_reduce's call order)
        return x + other.pop(0)

    parts[0].all_reduce(reduce_sum)
    assert parts[0].count == 2000
    assert torch.allclose(parts[0].cov_in, whole.cov_in, atol=1e-9)
    assert torch.allclose(parts[0].cross, whole.cross, atol=1e-9)
    assert torch.allclose(parts[0].mean_out, whole.mean_out, atol=1e-12)
    w = torch.ones(3, 6, dtype=torch.float64)
    assert parts[0].residual(w, None) == pytest.approx(whole.residual(w, None), rel=1e-9)
