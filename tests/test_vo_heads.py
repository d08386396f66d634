"""V/O head dims, whole heads and the fused layout (METHODS.md §5, issue 15)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.api import prune
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp import CorpConfig, apply_corp
from edgeprune.pruning.corp import corp_prune
from edgeprune.errors import UserError
from edgeprune.layers import PrunedAttention
from edgeprune.plan import BlockPlan, achieved_sparsity, pruned_indices, resolve_sparsities
from edgeprune.ranking import top_k_indices, vo_scores
from edgeprune.solve import mlp_ridge
from edgeprune.surgery import apply_structure, block_dims
from edgeprune.vo import head_channels, rank_heads
from tests.conftest import needs_fmnist


def _images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


def _logits(model, x):
    with torch.no_grad():
        return model(x)


# ---- sparsity 0 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["v", "heads"])
def test_sparsity_zero_changes_nothing(fmnist_model, target):
    x = _images(8, 0)
    res = prune(fmnist_model, x, target=target, sparsity=0.0)
    assert (_logits(res.model, x) - _logits(fmnist_model, x)).abs().max() <= 1e-5


def test_keeping_every_v_dim_and_head_through_the_full_fold_is_exact(fmnist_model):
    """S = every channel of z, every head: stats, ridge (nothing to fold), PrunedAttention rebuild."""
    x = _images(32, 1)
    model = copy.deepcopy(fmnist_model)
    an = find_anatomy(model)
    stats = collect_statistics(an, [x[:16], x[16:]], mlp=False, qk=False, vo=True, progress=False)
    plans = [BlockPlan(b.index, head_keep=torch.arange(b.num_heads),
                       v_keep=torch.arange(b.v_dim).repeat(b.num_heads, 1)) for b in an.blocks]
    apply_corp(an, plans, CorpConfig(), [None] * len(plans), None, stats.vo)
    assert all(isinstance(b.attn, PrunedAttention) for b in an.blocks)
    assert (_logits(model, x) - _logits(fmnist_model, x)).abs().max() <= 1e-5


# ---- exact compensation of exactly dependent channels / heads ------------------------------------
def _make_v_channel_dependent(model, block: int, head: int, j: int, i1: int, i2: int) -> None:
    """V row j of ``head`` := 2 v_i1 - 0.5 v_i2 + 0.3 (weights and bias): z_j = 2 z_i1 - 0.5 z_i2 + 0.3
    exactly, since each row of the attention matrix sums to 1."""
    attn = model.blocks[block].attn
    H, d = attn.num_heads, attn.head_dim
    base = 2 * H * d + head * d
    with torch.no_grad():
        w, b = attn.qkv.weight, attn.qkv.bias
        w[base + j] = 2 * w[base + i1] - 0.5 * w[base + i2]
        b[base + j] = 2 * b[base + i1] - 0.5 * b[base + i2] + 0.3


def _prune_v_dims(model, x, drop: dict[int, list[int]], compensation: bool, block: int = 2):
    """Prune V dims ``drop[head]`` (same count per head) of one block with the proj fold."""
    an = find_anatomy(model)
    stats = collect_statistics(an, [x], mlp=False, qk=False, vo=True, progress=False)
    b = an.blocks[block]
    v_keep = torch.stack([pruned_indices(torch.tensor(drop[h]), b.v_dim) for h in range(b.num_heads)])
    plans = [BlockPlan(i) for i in range(len(an.blocks))]
    plans[block].v_keep = v_keep
    apply_corp(an, plans, CorpConfig(ridge_alpha=1e-12, compensation=compensation), [None] * len(plans),
               None, stats.vo)
    return an.blocks[block]


def test_exactly_dependent_value_channel_is_compensated_exactly(fmnist_model):
    x = _images(32, 2)
    dense = copy.deepcopy(fmnist_model)
    _make_v_channel_dependent(dense, 2, 0, 5, 3, 7)
    _make_v_channel_dependent(dense, 2, 1, 10, 11, 40)
    ref = _logits(dense, x)
    errs = {}
    for comp in (True, False):
        model = copy.deepcopy(dense)
        blk = _prune_v_dims(model, x, {0: [5], 1: [10]}, comp)
        assert (blk.num_heads, blk.qk_dim, blk.v_dim) == (2, 64, 63)
        errs[comp] = float((_logits(model, x) - ref).abs().max())
    assert errs[True] <= 1e-4, errs
    assert errs[False] > 100 * max(errs[True], 1e-6), errs  # the channel mattered


def test_exactly_redundant_head_is_compensated_exactly(fmnist_model):
    """Head 1 := same Q/K as head 0 and V_1 = M V_0 + c: z_1 = M z_0 + c, so removing either head
    and folding the ridge map into proj reproduces the dense model."""
    x = _images(32, 3)
    dense = copy.deepcopy(fmnist_model)
    attn = dense.blocks[4].attn
    d = attn.head_dim
    mix = torch.eye(d) + 0.3 * torch.randn(d, d, generator=torch.Generator().manual_seed(0)) / d ** 0.5
    with torch.no_grad():
        w, b = attn.qkv.weight, attn.qkv.bias
        for part in (0, 1):  # q, k
            w[part * 2 * d + d: part * 2 * d + 2 * d] = w[part * 2 * d: part * 2 * d + d]
            b[part * 2 * d + d: part * 2 * d + 2 * d] = b[part * 2 * d: part * 2 * d + d]
        w[5 * d:] = mix @ w[4 * d: 5 * d]
        b[5 * d:] = mix @ b[4 * d: 5 * d] + 0.1
    ref = _logits(dense, x)
    errs = {}
    for comp in (True, False):
        model = copy.deepcopy(dense)
        an = find_anatomy(model)
        stats = collect_statistics(an, [x], mlp=False, qk=False, vo=True, progress=False)
        plans = [BlockPlan(i) for i in range(6)]  # only block 4 is exactly redundant: prune it alone
        plans[4].head_keep = rank_heads(stats.vo[4], an.blocks[4].proj.weight.detach(), 2, 1, 1e-9)
        apply_corp(an, plans, CorpConfig(ridge_alpha=1e-9, compensation=comp), [None] * 6, None, stats.vo)
        assert an.blocks[4].num_heads == 1 and an.blocks[4].proj.in_features == d
        errs[comp] = float((_logits(model, x) - ref).abs().max())
    assert errs[True] <= 1e-4, errs
    assert errs[False] > 100 * max(errs[True], 1e-6), errs


# ---- the proj fold is the MLP solver -------------------------------------------------------------
def test_proj_fold_reuses_the_mlp_ridge_solver(fmnist_model, monkeypatch):
    calls = []
    real_solve, real_fold = mlp_ridge.ridge_affine_map, mlp_ridge.fold_into_linear

    def solve(mean, cov, keep, prune, alpha=mlp_ridge.DEFAULT_ALPHA):
        calls.append(("solve", cov.shape[0], len(keep)))
        return real_solve(mean, cov, keep, prune, alpha)

    def fold(weight, *args):
        calls.append(("fold", weight.shape[1]))
        return real_fold(weight, *args)

    monkeypatch.setattr(mlp_ridge, "ridge_affine_map", solve)
    monkeypatch.setattr(mlp_ridge, "fold_into_linear", fold)
    prune(fmnist_model, _images(16, 4), target="v", sparsity=0.5)
    # proj's input: H * d_v = 2 * 64 = 128 channels, 2 * 32 kept, in each of the 6 blocks
    assert calls.count(("solve", 128, 64)) == 6 and calls.count(("fold", 128)) == 6, calls


# ---- fused layout --------------------------------------------------------------------------------
def test_fused_layout_is_plain_mha_and_matches_its_onnx_export(fmnist_model, tmp_path):
    import onnxruntime as ort

    from exporters.onnx import build_metadata, export_onnx, read_metadata
    from exporters.verify import verify_onnx

    x = _images(16, 5)
    # Q/K given, V follows (d' = 16 keeps the exact Q/K solve small)
    res = prune(fmnist_model, x, target="both", sparsity=0.75, layout="fused")
    an = find_anatomy(res.model)
    assert all(b.qk_dim == b.v_dim == 16 and b.mlp_hidden == 128 for b in an.blocks)
    assert res.record["config"]["layout"] == "fused"
    with torch.profiler.profile() as prof, torch.no_grad():
        res.model(x[:2])
    kernels = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels  # the fused CPU kernel ran
    assert "aten::_scaled_dot_product_attention_math" not in kernels
    path = export_onnx(res.model, tmp_path / "fused.onnx", (1, 28, 28), build_metadata(record=res.record))
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x[:4].numpy()})[0]
    assert float(np.abs(out - _logits(res.model, x[:4]).numpy()).max()) <= 1e-4
    assert verify_onnx(path, res.model, x)["passed"]
    assert read_metadata(path)["blocks"] == res.record["blocks"]


def test_head_pruned_model_exports_and_verifies(fmnist_model, tmp_path):
    from exporters.onnx import build_metadata, export_onnx
    from exporters.verify import verify_onnx

    x = _images(16, 10)
    res = prune(fmnist_model, x, target="heads", sparsity=0.5, v_sparsity=0.25, round_to=16)
    assert all((b["num_heads"], b["v_dim"]) == (1, 48) for b in res.record["blocks"])  # 48 = 16 * 3
    path = export_onnx(res.model, tmp_path / "heads.onnx", (1, 28, 28), build_metadata(record=res.record))
    rep = verify_onnx(path, res.model, x)
    assert rep["passed"] and rep["max_abs_diff"] <= 1e-4


def test_qk_only_pruning_falls_back_to_the_math_kernel(fmnist_model):
    """The reason for the fused layout: with qk_dim != v_dim PyTorch cannot use the fused kernel."""
    res = prune(fmnist_model, _images(8, 6), target="attn", sparsity=0.5, compensation=False)
    with torch.profiler.profile() as prof, torch.no_grad():
        res.model(_images(2, 7))
    kernels = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_attention_math" in kernels
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in kernels


def test_config_targets_and_errors():
    cfg = CorpConfig.from_target("all", 0.5)
    assert (cfg.mlp_sparsity, cfg.attn_sparsity, cfg.v_sparsity, cfg.head_sparsity) == (0.5, 0.5, 0.5, 0.0)
    cfg = CorpConfig.from_target("heads", 0.25, v_sparsity=0.5)
    assert (cfg.mlp_sparsity, cfg.attn_sparsity, cfg.v_sparsity, cfg.head_sparsity) == (0, 0, 0.5, 0.25)
    assert resolve_sparsities("both", 0.5) == {"mlp": 0.5, "attn": 0.5, "v": 0.0, "heads": 0.0}
    with pytest.raises(UserError, match="same kept dim"):
        CorpConfig.from_target("attn", 0.5, v_sparsity=0.25, layout="fused")
    with pytest.raises(UserError, match="layout"):
        CorpConfig.from_target("attn", 0.5, layout="flash")
    with pytest.raises(UserError, match="V/O criterion"):
        CorpConfig.from_target("v", 0.5, vo_criterion="active")
    with pytest.raises(UserError, match=r"\[0, 1\)"):
        CorpConfig.from_target("heads", 1.0)


def test_fused_layout_refuses_a_model_with_unequal_dims_before_calibrating(fmnist_model):
    model = prune(fmnist_model, _images(8, 8), target="attn", sparsity=0.5, compensation=False).model

    def never():
        raise AssertionError("calibration must not start")

    with pytest.raises(UserError, match="qk_dim 32 != v_dim 64"):
        corp_prune(find_anatomy(model), never, CorpConfig(mlp_sparsity=0.5, layout="fused"), progress=False)


# ---- structure: FLOPs, records, reload -----------------------------------------------------------
@pytest.mark.parametrize("dims", [[(2, 16, 40, 384), (3, 64, 24, 768)], [(1, 32, 32, 384), (2, 24, 24, 768)]],
                         ids=["heads+unequal", "fused"])
def test_pruned_flops_match_torch_flop_counter(timm, dims):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from edgeprune.flops import model_flops

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=2).eval()
    rec = block_dims(find_anatomy(model))
    for r, (h, dq, dv, m) in zip(rec, dims):
        r.update(num_heads=h, qk_dim=dq, v_dim=dv, mlp_hidden=m)
    apply_structure(model, rec)
    an = find_anatomy(model)
    assert [(b.num_heads, b.qk_dim, b.v_dim, b.mlp_hidden) for b in an.blocks] == dims
    # the counter sees q k^T and A v only on SDPA's math path (not in the fused CPU kernel)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    per_module = fc.get_flop_counts()
    ours = model_flops(an)
    for i, b in enumerate(ours["blocks"]):
        assert b["total"] == sum(per_module[f"VisionTransformer.blocks.{i}"].values()), (i, b)
    assert ours["total"] == pytest.approx(fc.get_total_flops(), rel=0.002)
    n, D = 197, 192
    h, dq, dv, m = dims[0]
    assert ours["blocks"][0]["total"] == (2 * n * D * h * (2 * dq + dv) + 2 * n * n * h * (dq + dv)
                                          + 2 * n * h * dv * D + 4 * n * D * m)


def test_head_pruned_model_reloads_strictly_and_reports_achieved_sparsity(fmnist_model):
    x = _images(16, 9)
    res = prune(fmnist_model, x, target="heads", sparsity=0.5, v_sparsity=0.5)
    blocks = res.record["blocks"]
    assert all((b["num_heads"], b["qk_dim"], b["v_dim"], b["head_dim"]) == (1, 64, 32, 64) for b in blocks)
    fresh = copy.deepcopy(fmnist_model)
    apply_structure(fresh, blocks)
    fresh.load_state_dict(res.model.state_dict(), strict=True)
    assert torch.equal(_logits(fresh, x), _logits(res.model, x))
    dense = block_dims(find_anatomy(fmnist_model))
    a = achieved_sparsity(dense, blocks)
    assert a == {"mlp": 0.0, "attn": 0.5, "v": 0.75, "heads": 0.5}


# ---- on the trained model: compensation and ranking help -----------------------------------------
def _logit_mse(model, dense, x) -> float:
    return float((_logits(model, x) - _logits(dense, x)).pow(2).mean())


@needs_fmnist
@pytest.mark.parametrize("target", ["v", "heads"])
def test_compensation_lowers_logit_error(fmnist_model, fmnist_calib, target):
    calib, x_eval, _ = fmnist_calib
    x_eval = x_eval[:128]
    errs = {comp: _logit_mse(prune(fmnist_model, calib[:64], target=target, sparsity=0.5,
                                   compensation=comp).model, fmnist_model, x_eval)
            for comp in (False, True)}
    assert errs[True] < 0.7 * errs[False], errs


@needs_fmnist
def test_v_ranking_beats_the_inverted_ranking(fmnist_model, fmnist_calib):
    calib, x_eval, _ = fmnist_calib
    x_eval = x_eval[:128]
    errs = {}
    for sign in (1, -1):
        model = copy.deepcopy(fmnist_model)
        an = find_anatomy(model)
        stats = collect_statistics(an, [calib[:64]], mlp=False, qk=False, vo=True, progress=False)
        plans = [BlockPlan(b.index, v_keep=top_k_indices(
            sign * vo_scores(stats.vo[b.index], b.proj.weight.detach(), b.num_heads), 16)) for b in an.blocks]
        apply_corp(an, plans, CorpConfig(), [None] * 6, None, stats.vo)
        errs[sign] = _logit_mse(model, fmnist_model, x_eval)
    assert errs[1] < errs[-1], errs


@needs_fmnist
def test_head_ranking_beats_the_inverted_ranking(fmnist_model, fmnist_calib):
    calib, x_eval, _ = fmnist_calib
    x_eval = x_eval[:128]
    errs = {}
    for worst in (False, True):
        model = copy.deepcopy(fmnist_model)
        an = find_anatomy(model)
        stats = collect_statistics(an, [calib[:64]], mlp=False, qk=False, vo=True, progress=False)
        plans = [BlockPlan(b.index, head_keep=rank_heads(stats.vo[b.index], b.proj.weight.detach(),
                                                         b.num_heads, 1, worst=worst)) for b in an.blocks]
        apply_corp(an, plans, CorpConfig(), [None] * 6, None, stats.vo)
        errs[worst] = _logit_mse(model, fmnist_model, x_eval)
    assert errs[False] < errs[True], errs


def test_head_channels_and_removal_error_known_answer():
    assert head_channels(torch.tensor([0, 2]), torch.tensor([[0, 3], [1, 2], [1, 3]]), 4).tolist() == [0, 3, 9, 11]
    # h_1 = 2 h_0 exactly: removing 1 with the fold costs nothing, without it E||w_1 h_1||^2
    h0 = torch.randn(1000, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 1.0
    h = torch.cat([h0, 2 * h0], dim=1)
    mean, cov = h.mean(0), torch.cov(h.T, correction=0)
    w = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    keep, drop = torch.tensor([0]), torch.tensor([1])
    b, c, _ = mlp_ridge.ridge_affine_map(mean, cov, keep, drop, 0.0 + 1e-12)
    assert mlp_ridge.removal_error(mean, cov, w, keep, drop, b, c) == pytest.approx(0.0, abs=1e-8)
    assert mlp_ridge.removal_error(mean, cov, w, keep, drop) == pytest.approx(float((3 * h[:, 1]).pow(2).mean()))
    # any data, any (B, c): the formula is the empirical mean squared error of the fold
    g = torch.Generator().manual_seed(1)
    h = torch.randn(500, 5, dtype=torch.float64, generator=g) @ torch.randn(5, 5, dtype=torch.float64, generator=g) + 0.7
    mean, cov = h.mean(0), torch.cov(h.T, correction=0)
    w = torch.randn(3, 5, dtype=torch.float64, generator=g)
    keep, drop = torch.tensor([0, 2, 4]), torch.tensor([1, 3])
    b, c, _ = mlp_ridge.ridge_affine_map(mean, cov, keep, drop, 0.1)
    c = c + 0.05  # off the optimum: the mean term must count too
    empirical = ((h[:, drop] - h[:, keep] @ b.T - c) @ w[:, drop].T).pow(2).sum(1).mean()
    assert mlp_ridge.removal_error(mean, cov, w, keep, drop, b, c) == pytest.approx(float(empirical), rel=1e-10)


def _reference_rank_heads(stats, w_o, H, keep, alpha, compensation, worst=False):
    """The greedy elimination as first written (no memo): remove the argmin head until ``keep`` are left."""
    from edgeprune.solve import mlp_ridge

    d_v = w_o.shape[1] // H
    full = torch.arange(d_v).repeat(H, 1)
    kept, removed = list(range(H)), []
    while len(kept) > keep:
        errs = []
        for h in kept:
            s = head_channels(torch.tensor([g for g in kept if g != h]), full, d_v)
            p = head_channels(torch.tensor(sorted(removed + [h])), full, d_v)
            b = c = None
            if compensation:
                b, c, _ = mlp_ridge.ridge_affine_map(stats.mean, stats.cov, s, p, alpha)
            errs.append(mlp_ridge.removal_error(stats.mean, stats.cov, w_o, s, p, b, c))
        t = torch.tensor(errs, dtype=torch.float64)
        removed.append(kept.pop(int(torch.sort(-t if worst else t, stable=True).indices[0])))
    return torch.tensor(kept, dtype=torch.int64)


@pytest.mark.parametrize("order", ["down", "up"])
def test_rank_heads_remembers_one_elimination_order(fmnist_model, order):
    """issue 40 item 4: the budgeted allocation ranks the same block's heads for many H'; one greedy elimination
    order is kept on the statistics and extended as far as asked -- every H', asked in any order, keeps exactly the
    heads of the elimination run for that H' alone (with and without compensation, and inverted)."""
    from edgeprune.vo import elimination_order

    an = find_anatomy(copy.deepcopy(fmnist_model))
    stats = collect_statistics(an, [_images(16, 5)], mlp=False, qk=False, vo=True, progress=False)
    b = an.blocks[2]
    w_o, H = b.proj.weight.detach(), b.num_heads
    keeps = list(range(1, H + 1))
    for comp, worst in ((True, False), (False, False), (True, True)):
        for k in (keeps[::-1] if order == "down" else keeps):
            got = rank_heads(stats.vo[2], w_o, H, k, 1e-3, comp, worst)
            assert torch.equal(got, _reference_rank_heads(stats.vo[2], w_o, H, k, 1e-3, comp, worst)), (comp, k)
        assert len(elimination_order(stats.vo[2], w_o, H, 1e-3, comp, worst)) == H - 1
    # another W_O is another order (not the remembered one)
    w2 = w_o.flip(1)
    assert torch.equal(rank_heads(stats.vo[2], w2, H, 1, 1e-3), _reference_rank_heads(stats.vo[2], w2, H, 1, 1e-3, True))
