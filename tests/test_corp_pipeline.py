"""CORP end to end on real models: invariants of METHODS.md §4."""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.api import prune
from edgeprune.artifact import load_run, save_run
from edgeprune.corp import CorpConfig, apply_corp
from edgeprune.pruning.corp import corp_prune
from edgeprune.errors import UserError
from edgeprune.layers import PrunedAttention
from edgeprune.plan import BlockPlan, kept_dim
from tests.conftest import needs_fmnist


def test_sparsity_zero_reproduces_dense_logits(fmnist_model):
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    res = prune(fmnist_model, x, target="both", sparsity=0.0)
    with torch.no_grad():
        assert torch.equal(res.model(x), fmnist_model(x))
    assert res.record["params"] == res.record["dense_params"]


def test_keeping_every_dim_through_the_full_solve_and_surgery_is_exact(fmnist_model):
    """Force the whole path (stats, plan, fold, PrunedAttention, scale fold, module swap) with
    S = all dims: the logits must not move beyond float32 round-off. (The solves themselves are
    exercised on exactly solvable cases in test_solvers.py.)"""
    x = torch.randn(32, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(fmnist_model)
    an = find_anatomy(model)
    from edgeprune.calibration.collect import collect_statistics
    from edgeprune.solve import qk_logit

    stats = collect_statistics(an, [x[:16], x[16:]], progress=False)
    plans = [BlockPlan(b.index, torch.arange(b.mlp_hidden), torch.arange(b.qk_dim).repeat(b.num_heads, 1))
             for b in an.blocks]

    def solve(i, h):
        gq, gk = stats.qk[i].grams()
        k_sys, rhs = qk_logit.kronecker_system(gq[:, h], gk[:, h], plans[i].qk_keep[h], torch.arange(0))
        m, lam = qk_logit.solve_logit_compensation(k_sys, rhs)
        return m, lam, {"solver": "direct"}

    apply_corp(an, plans, CorpConfig(), stats.mlp, solve)
    assert all(isinstance(b.attn, PrunedAttention) for b in an.blocks)
    with torch.no_grad():
        torch.testing.assert_close(model(x), fmnist_model(x), atol=2e-5, rtol=1e-5)


def test_attention_scale_is_kept(fmnist_model):
    model = copy.deepcopy(fmnist_model)
    an = find_anatomy(model)
    # keep all Q/K dims but take the uncompensated path: only the scale fold applies
    plans = [BlockPlan(b.index, None, torch.arange(48).repeat(b.num_heads, 1)) for b in an.blocks]
    apply_corp(an, plans, CorpConfig(compensation=False), [None] * len(plans), None)
    blk = find_anatomy(model).blocks[0]
    dense_blk = find_anatomy(fmnist_model).blocks[0]
    assert blk.attn.scale == pytest.approx(48 ** -0.5)
    with torch.no_grad():
        h = dense_blk.block.norm1(torch.randn(4, 50, 128, generator=torch.Generator().manual_seed(2)))  # any 50 tokens
        qd, kd = [t.reshape(4, 50, 2, 64).transpose(1, 2)[..., :48] for t in dense_blk.qkv(h).split(128, -1)[:2]]
        dense_logits = qd @ kd.transpose(-1, -2) * 64 ** -0.5  # dense scale on the kept dims
        qp, kp = [t.reshape(4, 50, 2, 48).transpose(1, 2) for t in blk.qkv(h)[..., :192].split(96, -1)]
        pruned_logits = qp @ kp.transpose(-1, -2) * blk.attn.scale
    torch.testing.assert_close(pruned_logits, dense_logits, atol=1e-5, rtol=1e-5)


@needs_fmnist
@pytest.mark.parametrize("target", ["mlp", "attn", "both"])
def test_compensation_lowers_logit_error_on_real_data(fmnist_model, fmnist_calib, target):
    calib, x_eval, _ = fmnist_calib
    errs = {}
    for comp in (False, True):
        res = prune(fmnist_model, calib, target=target, sparsity=0.5, compensation=comp)
        with torch.no_grad():
            errs[comp] = (res.model(x_eval) - fmnist_model(x_eval)).pow(2).mean().item()
    assert errs[True] < errs[False], errs


@needs_fmnist
def test_compensation_lowers_layer_error_on_real_activations(fmnist_model, fmnist_calib):
    """Block 0's MLP output error (same input) is lower with the ridge fold than without."""
    calib, x_eval, _ = fmnist_calib
    outs = {}
    for comp in (False, True):
        res = prune(fmnist_model, calib, target="mlp", sparsity=0.5, compensation=comp)
        feats = {}
        dense_blk = find_anatomy(fmnist_model).blocks[1]
        h = dense_blk.block.register_forward_pre_hook(lambda m, a: feats.__setitem__("x", a[0]))
        with torch.no_grad():
            fmnist_model(x_eval)
        h.remove()
        xin = dense_blk.block.norm2(feats["x"])
        with torch.no_grad():
            outs[comp] = (find_anatomy(res.model).blocks[1].mlp(xin) - dense_blk.mlp(xin)).pow(2).mean().item()
    assert outs[True] < outs[False], outs


def test_two_pass_qk_matches_one_pass(fmnist_model):
    x = torch.randn(24, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    models = []
    for limit in (100.0, 0.0):
        m = copy.deepcopy(fmnist_model)
        info = corp_prune(find_anatomy(m), lambda: [x[:12], x[12:]],
                          CorpConfig(attn_sparsity=0.5, qk_memory_limit_gb=limit), num_images=24, progress=False)
        models.append(m)
        assert info["passes"] == (1 if limit else 2)
    with torch.no_grad():
        torch.testing.assert_close(models[0](x), models[1](x), atol=1e-5, rtol=1e-5)


def test_rounding_and_its_errors():
    assert kept_dim(1536, 0.5, 8) == 768
    assert kept_dim(64, 0.3, 8) == 48        # 44.8 -> 48
    assert kept_dim(64, 0.7, 8) == 16        # 19.2 -> 16
    assert kept_dim(100, 0.0, 8) == 100      # sparsity 0 keeps all even if 8 does not divide
    assert kept_dim(64, 0.3, 1) == 45
    assert kept_dim(64, 0.01, 8) == 64
    with pytest.raises(UserError, match="leaves no dims"):
        kept_dim(64, 0.95, 8)
    with pytest.raises(UserError, match=r"\[0, 1\)"):
        kept_dim(64, 1.0, 8)
    with pytest.raises(UserError):
        kept_dim(64, -0.1, 8)


def test_pruned_dims_are_multiples_of_round_to(fmnist_model):
    x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(4))
    res = prune(fmnist_model, x, target="both", sparsity=0.3, round_to=16)
    for b in res.record["blocks"]:
        assert b["mlp_hidden"] % 16 == 0 and b["qk_dim"] % 16 == 0
        assert b["mlp_hidden"] == 352 and b["qk_dim"] == 48  # 358.4 -> 352, 44.8 -> 48
        assert b["v_dim"] == 64
    assert res.record["flops"] < res.record["dense_flops"]


def test_save_load_round_trip_is_bit_exact(fmnist_model, tmp_path):
    from edgeprune.zoo.registry import get_model_spec

    x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(5))
    res = prune(fmnist_model, x, target="both", sparsity=0.5, spec=get_model_spec("fmnist-vit"))
    save_run(tmp_path / "run", res.model, res.record)
    loaded, rec = load_run(tmp_path / "run")
    assert rec["blocks"] == res.record["blocks"]
    for (k1, v1), (k2, v2) in zip(res.model.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    with torch.no_grad():
        assert torch.equal(loaded(x), res.model(x))
    with pytest.raises(UserError, match="already exists"):
        save_run(tmp_path / "run", res.model, res.record)


def test_interrupted_save_leaves_no_directory(fmnist_model, tmp_path, monkeypatch):
    import edgeprune.atomic

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(edgeprune.atomic, "write_safetensors", boom)
    with pytest.raises(KeyboardInterrupt):
        save_run(tmp_path / "run", fmnist_model, {"base_model": {}, "blocks": []})
    assert list(tmp_path.iterdir()) == []


def test_bad_calibration_input(fmnist_model):
    with pytest.raises(UserError, match="empty"):
        prune(fmnist_model, torch.empty(0, 1, 28, 28))
    with pytest.raises(UserError, match="shape"):
        prune(fmnist_model, torch.randn(4, 3, 28, 28))
    with pytest.raises(UserError, match="target"):
        prune(fmnist_model, torch.randn(4, 1, 28, 28), target="bogus")
