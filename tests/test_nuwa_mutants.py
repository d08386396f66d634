"""Known-answer tests for NuWa's rho grid, logit scale and per-layer dims (issue 17).

Written to kill the mutants that survived ``python tools/mutation_check.py nuwa`` (docs/mutation.md):
``budget.rho_candidates`` (levels at every multiple of ``round_to``, 1.0 excluded, float round-off
merged, exactly ``n`` evenly spaced levels), ``ofp_mha._attn_scale`` (module scale vs the
``qk_dim ** -0.5`` fallback), ``ofp_mha.layer_dims`` (``round_to`` passed on) and
``ofp_mha.model_factors`` (``key_bias`` passed on). Every expected value is computed by hand from
hand-made spectra (uniform ``s`` gives retained energy ``k / d`` at rank k), not by the function
under test.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn as nn

from edgeprune._compat import import_timm
from edgeprune.anatomy import find_anatomy
from edgeprune.nuwa.budget import rho_candidates
from edgeprune.nuwa.ofp_mha import _attn_scale, block_factors, layer_dims, model_factors


def _factors(qk_s, vo_s=None):
    """A stand-in for BlockFactors: rho_candidates / layer_dims read only qk_s and vo_s ((H, d))."""
    qk_s = torch.as_tensor(qk_s, dtype=torch.float64)
    vo_s = qk_s if vo_s is None else torch.as_tensor(vo_s, dtype=torch.float64)
    return types.SimpleNamespace(qk_s=qk_s, vo_s=vo_s)


def _uniform(d: int, heads: int = 1) -> torch.Tensor:
    """(heads, d) equal singular values: retained energy at rank k is exactly k / d."""
    return torch.ones(heads, d, dtype=torch.float64)


# ---- rho_candidates -------------------------------------------------------------------------------
def test_rho_grid_levels_at_every_multiple_of_round_to_default_8():
    # d = 32, default round_to 8: ranks 8, 16, 24 (rank 32 = 1.0 is the fixed first entry)
    assert rho_candidates([_factors(_uniform(32))]) == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_rho_grid_levels_with_explicit_round_to():
    # round_to 4 on d = 32: ranks 4, 8, ..., 28 -> 7 levels k / 32, descending
    grid = rho_candidates([_factors(_uniform(32))], round_to=4)
    assert grid == [1.0, *[k / 32 for k in range(28, 0, -4)], 0.0]
    # round_to 12 on d = 48: ranks 12, 24, 36
    assert rho_candidates([_factors(_uniform(48))], round_to=12) == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_rho_grid_merges_qk_vo_and_layers_and_excludes_one():
    # layer 0: qk uniform on 32 (0.75, 0.5, 0.25); vo: all energy in the first 8 dims, so its
    # levels at ranks 8, 16, 24 are all exactly 1.0 -> discarded (1.0 is already the first entry).
    vo = torch.cat([torch.ones(1, 8), torch.zeros(1, 24)], 1)
    # layer 1: energy 3:1 between the two halves of 16 dims -> rank 8: 0.75 (already a level)
    qk1 = torch.cat([torch.full((1, 8), math.sqrt(3.0), dtype=torch.float64),
                     torch.ones(1, 8, dtype=torch.float64)], 1)
    grid = rho_candidates([_factors(_uniform(32), vo), _factors(qk1, qk1)])
    assert grid == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert grid.count(1.0) == 1


def test_rho_grid_merges_levels_equal_to_12_digits():
    # a second layer whose levels differ from k/32 by ~1e-13 (float round-off size): merged
    eps = 2e-13 / 0.1875  # 8 a / (8 a + 24) = 0.25 + 0.1875 eps for a = 1 + eps
    s = torch.cat([torch.full((1, 8), math.sqrt(1 + eps), dtype=torch.float64),
                   torch.ones(1, 24, dtype=torch.float64)], 1)
    assert rho_candidates([_factors(_uniform(32)), _factors(s)]) == [1.0, 0.75, 0.5, 0.25, 0.0]
    # ... while a real difference (1e-6) gives separate levels
    eps = 1e-6 / 0.1875
    s = torch.cat([torch.full((1, 8), math.sqrt(1 + eps), dtype=torch.float64),
                   torch.ones(1, 24, dtype=torch.float64)], 1)
    assert len(rho_candidates([_factors(_uniform(32)), _factors(s)])) == 2 + 6


def test_rho_grid_down_samples_to_n_evenly_spaced_levels():
    f = [_factors(_uniform(64))]
    lv = [k / 64 for k in range(60, 0, -4)]  # 15 levels, descending
    assert rho_candidates(f, n=100, round_to=4) == [1.0, *lv, 0.0]
    assert rho_candidates(f, n=15, round_to=4) == [1.0, *lv, 0.0]
    # n = 3: indices round(i * 14 / 2) = 0, 7, 14
    assert rho_candidates(f, n=3, round_to=4) == [1.0, lv[0], lv[7], lv[14], 0.0]
    # n = 4: indices round(i * 14 / 3) = 0, 5, 9, 14 (both ends kept)
    assert rho_candidates(f, n=4, round_to=4) == [1.0, lv[0], lv[5], lv[9], lv[14], 0.0]
    # n = 2: the two ends
    assert rho_candidates(f, n=2, round_to=4) == [1.0, lv[0], lv[14], 0.0]
    # n = 1: the highest level only
    assert rho_candidates(f, n=1, round_to=4) == [1.0, lv[0], 0.0]
    for n in (1, 2, 3, 4, 7, 14):
        assert len(rho_candidates(f, n=n, round_to=4)) == n + 2


# ---- _attn_scale ----------------------------------------------------------------------------------
def test_attn_scale_reads_the_module_scale():
    blk = types.SimpleNamespace(attn=types.SimpleNamespace(scale=0.2), qk_dim=16)
    assert _attn_scale(blk) == pytest.approx(0.2, abs=0, rel=1e-15)
    assert isinstance(_attn_scale(blk), float)
    blk = types.SimpleNamespace(attn=types.SimpleNamespace(scale=torch.tensor(0.125)), qk_dim=4)
    assert _attn_scale(blk) == 0.125 and isinstance(_attn_scale(blk), float)


def test_attn_scale_falls_back_to_qk_dim_when_missing_or_none():
    assert _attn_scale(types.SimpleNamespace(attn=nn.Identity(), qk_dim=16)) == 0.25
    assert _attn_scale(types.SimpleNamespace(attn=types.SimpleNamespace(scale=None), qk_dim=4)) == 0.5
    assert _attn_scale(types.SimpleNamespace(attn=object(), qk_dim=64)) == 0.125


def _tiny(seed: int = 0) -> nn.Module:
    """2-block timm ViT, width 32, 2 heads x 16, qkv bias, random init."""
    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    m = VisionTransformer(img_size=16, patch_size=4, in_chans=1, num_classes=6, embed_dim=32, depth=2,
                          num_heads=2, mlp_ratio=2.0, qkv_bias=True)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.normal_(0, 0.3)
    return m.eval()


def test_block_factors_take_a_non_default_module_scale():
    an = find_anatomy(_tiny())
    b0 = an.blocks[0]
    assert block_factors(b0).scale == pytest.approx(16 ** -0.5)
    b0.attn.scale = 0.1  # e.g. a folded / temperature-adjusted scale, != qk_dim ** -0.5
    assert block_factors(b0).scale == pytest.approx(0.1, abs=0, rel=1e-12)


# ---- layer_dims / model_factors -------------------------------------------------------------------
def test_layer_dims_pass_round_to_and_keep_qk_vo_apart():
    # qk: uniform 32 (energy k/32); vo: uniform 64 (energy k/64)
    f = [_factors(_uniform(32), _uniform(64)), _factors(_uniform(64), _uniform(32))]
    # rho 0.4: qk r* = 13 (13/32 >= 0.4), vo r* = 26 (26/64 >= 0.4)
    assert layer_dims(f, 0.4) == ([8, 24], [24, 8])  # default round_to 8
    assert layer_dims(f, 0.4, round_to=4) == ([12, 24], [24, 12])
    assert layer_dims(f, 0.4, round_to=5) == ([10, 25], [25, 10])
    assert layer_dims(f, 0.4, round_to=16) == ([16, 16], [16, 16])  # floored, min round_to
    assert layer_dims(f, 1.0, round_to=5) == ([32, 64], [64, 32])  # full dims kept as is


def test_model_factors_pass_key_bias_on():
    an = find_anatomy(_tiny(1))
    D = 32
    drop = model_factors(an)
    aug = model_factors(an, "augment")
    assert all(not f.k_bias_augmented and f.qk_v.shape[1] == D for f in drop)
    assert all(f.k_bias_augmented and f.qk_v.shape[1] == D + 1 for f in aug)
    assert model_factors(an, key_bias="drop")[1].qk_v.shape == drop[1].qk_v.shape
    # the augmented product has the key-bias row: its spectrum differs from the dropped one
    assert not torch.allclose(aug[0].qk_s, drop[0].qk_s)
    with pytest.raises(ValueError, match="key_bias"):
        model_factors(an, key_bias="keep")
