"""NuWa derivation (edgeprune.nuwa, edgeprune derive): SKP masks, SVD truncation of the attention,
uniform MLP budget with least-squares re-fit, head handling, budget search, SVD cache, CLI errors.

Small random models keep this file fast; the end-to-end CLI test uses fmnist-vit with a few steps.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest

from tests.conftest import needs_fmnist
import torch
import torch.nn as nn

from edgeprune._compat import import_timm
from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import load_run, save_run
from edgeprune.calibration.collect import collect_statistics
from edgeprune.errors import UserError
from edgeprune.flops import model_flops
from edgeprune.nuwa import budget as budget_mod
from edgeprune.nuwa import svd_cache
from edgeprune.nuwa.derive import (DeriveConfig, derive, materialize_anchor, prepare, derive_from,
                                   resolve_classes)
from edgeprune.nuwa.head import apply_head, apply_head_structure
from edgeprune.nuwa.ofp_mha import (block_factors, energy_ratios, layer_dims, model_factors,
                                    rank_for_energy, truncate_attention)
from edgeprune.nuwa.ofp_mlp import prune_mlp, refit_fc2, uniform_mlp_dims
from edgeprune.nuwa.skp import (MLPMasks, SKPConfig, _MaskSTE, install_fixed_masks, kept_count,
                                run_skp)
from edgeprune.surgery import apply_structure, qkv_parts



@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread is faster on a shared machine (and leaves cores to others)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) / math.sqrt(mod.in_features))
                if mod.bias is not None:
                    mod.bias.copy_(0.3 * torch.randn(mod.bias.shape, generator=g))
    return model.eval()


def _tiny(seed: int = 0, **kw) -> nn.Module:
    """A 2-block timm ViT: 16x16x1, patch 4 (17 tokens), width 32, 2 heads x 16, MLP 128, 6 classes."""
    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    cfg = dict(img_size=16, patch_size=4, in_chans=1, num_classes=6, embed_dim=32, depth=2, num_heads=2,
               mlp_ratio=4.0, qkv_bias=True)
    cfg.update(kw)
    return _randomize(VisionTransformer(**cfg), seed)


def _fmnist_arch(seed: int = 0) -> nn.Module:
    from edgeprune.zoo.fmnist_vit import create_fmnist_vit

    return _randomize(create_fmnist_vit(pretrained=False), seed)


def _data(n: int, shape=(1, 16, 16), classes=(0, 1, 2, 3, 4, 5), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = torch.as_tensor(classes)[torch.randint(len(classes), (n,), generator=g)]
    return x, y


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPRUNE_CACHE", str(tmp_path / "cache"))
    svd_cache.clear_memory()
    yield
    svd_cache.clear_memory()


# ---- SKP ------------------------------------------------------------------------------------------
def test_anchor_with_all_channels_kept_equals_base():
    model = _tiny()
    x = _data(8)[0]
    ref = model(x)
    an = find_anatomy(model)
    handles = install_fixed_masks(an, [torch.arange(b.mlp_hidden) for b in an.blocks])
    try:
        torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    finally:
        for h in handles:
            h.remove()
    # SKP masks that keep every channel (beta large) are the identity as well
    masks = MLPMasks([b.mlp_hidden for b in an.blocks], beta_init=30.0)
    handles = masks.install(an)
    try:
        torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    finally:
        for h in handles:
            h.remove()
    full = materialize_anchor(copy.deepcopy(model), [torch.arange(b.mlp_hidden) for b in an.blocks])
    torch.testing.assert_close(full(x), ref, rtol=0, atol=0)


def test_materialized_anchor_equals_masked_model():
    model = _tiny(1)
    x = _data(8, seed=1)[0]
    an = find_anatomy(model)
    g = torch.Generator().manual_seed(0)
    keep = [torch.randperm(b.mlp_hidden, generator=g)[:37].sort().values for b in an.blocks]
    handles = install_fixed_masks(an, keep)
    masked = model(x)
    for h in handles:
        h.remove()
    small = materialize_anchor(copy.deepcopy(model), keep)
    assert [b.mlp_hidden for b in find_anatomy(small).blocks] == [37, 37]
    torch.testing.assert_close(small(x), masked, rtol=1e-5, atol=1e-5)
    assert (small(x) - model(x)).abs().max() > 1e-3  # the anchor really removed something


def test_skp_straight_through_gradients():
    assert kept_count(5.0, 512) == 509  # ceil(sigmoid(5) * 512)
    m = torch.tensor([0.3, 0.9, 0.1, 0.7, 0.5], requires_grad=True)
    beta = torch.tensor([0.0], requires_grad=True)  # keep ceil(0.5 * 5) = 3
    mask = _MaskSTE.apply(m, beta)
    assert mask.tolist() == [0, 1, 0, 1, 1]
    w = torch.tensor([1.0, -2.0, 3.0, 4.0, -5.0])
    (mask * w).sum().backward()
    torch.testing.assert_close(m.grad, w)  # dL/dm = dL/dmask
    torch.testing.assert_close(beta.grad, (w * mask.detach()).sum().reshape(1))  # sum(dL/dmask * mask)


def test_run_skp_keeps_best_checkpoint_and_freezes_base():
    model = _tiny(2)
    x, y = _data(40, classes=(1, 4), seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    an = find_anatomy(model)
    calls = []

    def ev():
        acc = [0.5, 0.75, 0.75, 0.25][len(calls) % 4]
        calls.append(acc)
        return acc, 1.0 - acc

    anchor = run_skp(an, x, y, ev, SKPConfig(steps=6, eval_every=2, lr_beta=0.5))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.requires_grad for p in model.parameters())
    assert [h["step"] for h in anchor.history] == [0, 2, 4, 6]
    # best accuracy 0.75 at steps 2 and 4: the higher pruning rate wins
    cands = [h for h in anchor.history if h["val_accuracy"] == 0.75]
    best = max(cands, key=lambda h: (h["pruning_rate"], -h["step"]))
    assert anchor.step == best["step"] and anchor.val_accuracy == 0.75
    assert [len(k) for k in anchor.keep] == best["kept"]
    assert all(8 <= len(k) <= 128 for k in anchor.keep)
    assert not any(h for h in an.blocks[0].fc2._forward_pre_hooks.values())


# ---- OFP-MHA --------------------------------------------------------------------------------------
def _attention_io(model: nn.Module, x: torch.Tensor):
    """Per block: attention input, logits (scaled, per head), attention output."""
    an = find_anatomy(model)
    inputs = {}
    handles = [b.attn.register_forward_pre_hook(lambda _m, a, i=b.index: inputs.__setitem__(i, a[0]))
               for b in an.blocks]
    model(x)
    for h in handles:
        h.remove()
    out = []
    for b in an.blocks:
        xin = inputs[b.index]
        qkv = b.qkv(xin)
        H, dq = b.num_heads, b.qk_dim
        q = qkv[..., :H * dq].reshape(*xin.shape[:2], H, dq).transpose(1, 2)
        k = qkv[..., H * dq:2 * H * dq].reshape(*xin.shape[:2], H, dq).transpose(1, 2)
        scale = float(getattr(b.attn, "scale"))
        out.append((xin, (q @ k.transpose(-1, -2)) * scale, b.attn(xin)))
    return out


@pytest.mark.parametrize("key_bias", ["drop", "augment"])
def test_svd_full_rank_reproduces_attention(key_bias):
    dense = _tiny(3)
    x = _data(4, seed=3)[0]
    ref = _attention_io(dense, x)
    model = copy.deepcopy(dense)
    an = find_anatomy(model)
    for b in an.blocks:
        f = block_factors(b, key_bias)
        truncate_attention(b, f, f.qk_dim, f.v_dim)
    got = _attention_io(model, x)
    for (xin, lg_ref, out_ref), (_, lg, out) in zip(ref, got):
        if key_bias == "augment":
            torch.testing.assert_close(lg, lg_ref, rtol=1e-4, atol=1e-4)
        else:  # the key bias adds a per-query constant, which softmax ignores
            torch.testing.assert_close(lg - lg.mean(-1, keepdim=True), lg_ref - lg_ref.mean(-1, keepdim=True),
                                       rtol=1e-4, atol=1e-4)
            assert (lg - lg_ref).abs().max() > 1e-3  # ... and it was really dropped
        torch.testing.assert_close(lg.softmax(-1), lg_ref.softmax(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-4, atol=1e-5)


def test_svd_full_rank_without_proj_bias_keeps_v_bias():
    dense = _tiny(4, proj_bias=False)
    x = _data(4, seed=4)[0]
    model = copy.deepcopy(dense)
    for b in find_anatomy(model).blocks:
        f = block_factors(b)
        assert f.v_bias_augmented  # no proj bias to fold b_V into
        truncate_attention(b, f, f.qk_dim, f.v_dim)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-4, atol=1e-5)


def test_svd_truncation_is_eckart_young_with_scale_fold():
    """Truncated logits equal X~ M_r X~^T / sqrt(d_h), M_r the best rank-r approximation of
    A_Q^T A_K (augment mode), i.e. the factor split and the sqrt(r/d_h) fold are right."""
    dense = _tiny(5)
    x = _data(3, seed=5)[0]
    (xin, _, _), _ = _attention_io(dense, x)
    b0 = find_anatomy(dense).blocks[0]
    p = qkv_parts(b0)
    xa = torch.cat([xin, torch.ones(*xin.shape[:2], 1)], -1).double()
    model = copy.deepcopy(dense)
    bm = find_anatomy(model).blocks[0]
    r = 8
    truncate_attention(bm, block_factors(bm, "augment"), r, 16)
    (_, lg, _), _ = _attention_io(model, x)
    for h in range(2):
        aq = torch.cat([p["wq"][h], p["bq"][h][:, None]], 1).double()
        ak = torch.cat([p["wk"][h], p["bk"][h][:, None]], 1).double()
        u, s, vh = torch.linalg.svd(aq.T @ ak)
        m_r = u[:, :r] @ torch.diag(s[:r]) @ vh[:r]
        want = xa @ m_r @ xa.transpose(-1, -2) / math.sqrt(16)
        torch.testing.assert_close(lg[:, h].double(), want, rtol=1e-4, atol=1e-4)
    assert bm.attn.qk_dim == r and bm.attn.v_dim == 16


def test_rank_for_energy_floors_to_multiple_of_8():
    s = torch.tensor([[4.0, 2.0, 1.0, 1.0] + [0.5] * 28, [4.0, 2.0, 1.0, 1.0] + [0.5] * 28])
    ratios = energy_ratios(s)
    assert ratios[-1] == pytest.approx(1.0)
    assert rank_for_energy(s, 1.0) == 32
    r_star = int((ratios >= 0.9).nonzero()[0]) + 1
    assert rank_for_energy(s, 0.9) == max(8, r_star // 8 * 8)
    assert rank_for_energy(s, 0.1) == 8
    f = model_factors(find_anatomy(_tiny()))
    qk, vo = layer_dims(f, 1.0)
    assert qk == [16, 16] and vo == [16, 16]


def test_adaptive_rho_grid_hits_every_dim_change():
    factors = model_factors(find_anatomy(_fmnist_arch(15)))
    grid = budget_mod.rho_candidates(factors, n=1000)
    assert grid[0] == 1.0 and grid[-1] == 0.0 and grid == sorted(grid, reverse=True)
    dims = [layer_dims(factors, r) for r in grid]
    assert dims[0] == ([64] * 6, [64] * 6) and dims[-1] == ([8] * 6, [8] * 6)
    # every layer takes every multiple of 8 somewhere on the grid (rho = its energy at that rank)
    for i in range(6):
        assert {d[0][i] for d in dims} == set(range(8, 65, 8))
        assert {d[1][i] for d in dims} == set(range(8, 65, 8))
    assert len(budget_mod.rho_candidates(factors, n=5)) == 7


def test_svd_cache_memory_disk_and_key(tmp_path):
    model = _tiny(6)
    an = find_anatomy(model)
    f1, info1 = svd_cache.get_factors(an)
    assert info1["source"] == "computed"
    path = svd_cache.cache_dir() / f"{info1['key']}.safetensors"
    assert path.is_file() and str(path).startswith(str(tmp_path))
    assert svd_cache.get_factors(an)[1]["source"] == "memory"
    svd_cache.clear_memory()
    f2, info2 = svd_cache.get_factors(an)
    assert info2["source"] == "disk"
    for a, b in zip(f1, f2):
        torch.testing.assert_close(a.qk_u, b.qk_u, rtol=0, atol=0)
        torch.testing.assert_close(a.vo_s, b.vo_s, rtol=0, atol=0)
        torch.testing.assert_close(a.proj_bias, b.proj_bias, rtol=0, atol=0)
        assert (a.scale, a.qk_bias, a.k_bias_augmented) == (b.scale, b.qk_bias, b.k_bias_augmented)
    assert not list(path.parent.glob("*.tmp"))
    # other weights -> other key; a corrupt file is recomputed
    other = _tiny(7)
    assert svd_cache.attention_key(find_anatomy(other)) != info1["key"]
    svd_cache.clear_memory()
    path.write_bytes(b"garbage")
    assert svd_cache.get_factors(an)[1]["source"] == "computed"


# ---- OFP-MLP --------------------------------------------------------------------------------------
def test_uniform_mlp_dims():
    caps = [512, 512, 256, 64]
    d = uniform_mlp_dims(caps, 1000)
    assert all(v % 8 == 0 and 8 <= v <= c for v, c in zip(d, caps))
    assert 1000 - 8 < sum(d) <= 1000
    assert d[3] == 64 and abs(d[0] - d[1]) <= 8  # similar sizes, capped blocks stay at their cap
    assert uniform_mlp_dims(caps, 5000) == caps
    assert uniform_mlp_dims(caps, 31) is None  # cannot give every block 8


def test_least_squares_refit_beats_plain_removal():
    model = _fmnist_arch(8)
    calib = _data(48, shape=(1, 28, 28), seed=8)[0]
    fresh = _data(16, shape=(1, 28, 28), seed=9)[0]
    an = find_anatomy(model)
    st = collect_statistics(an, [calib[i:i + 16] for i in range(0, 48, 16)], mlp=True, qk=False, progress=False)
    b = an.blocks[2]
    hidden = []
    h = b.fc2.register_forward_pre_hook(lambda _m, a: hidden.append(a[0]))
    model(fresh)
    h.remove()
    H = hidden[0]
    ref = b.fc2(H)
    keep = torch.sort(-st.mlp[2].mean).indices[:200].sort().values
    errs = {}
    for refit in (False, True):
        w, bias = refit_fc2(b, st.mlp[2], keep, refit=refit)
        errs[refit] = ((H[..., keep] @ w.T + bias - ref) ** 2).mean().item()
    assert errs[True] < 0.8 * errs[False], errs
    # prune_mlp installs exactly that fc2
    m2 = copy.deepcopy(model)
    b2 = find_anatomy(m2).blocks[2]
    kept = prune_mlp(b2, st.mlp[2], 200)
    assert torch.equal(kept, keep) and b2.mlp_hidden == 200


# ---- head -----------------------------------------------------------------------------------------
def test_head_suppress_and_slice():
    model = _tiny(9)
    x = _data(6, seed=10)[0]
    ref = model(x)
    sup = copy.deepcopy(model)
    apply_head(sup, [4, 1], "suppress")
    out = sup(x)
    torch.testing.assert_close(out[:, [4, 1]], ref[:, [4, 1]])
    assert set(out.argmax(-1).tolist()) <= {1, 4}
    torch.testing.assert_close(out[:, 0], ref[:, 0] - 100.0)
    sl = copy.deepcopy(model)
    apply_head(sl, [4, 1], "slice")
    torch.testing.assert_close(sl(x), ref[:, [4, 1]])


# ---- budget / derive ------------------------------------------------------------------------------
@pytest.mark.parametrize("frac", [0.8, 0.45])
def test_flops_budget_met_within_one_rounding_step(frac):
    model = _fmnist_arch(10)
    x, y = _data(60, shape=(1, 28, 28), classes=(2, 5, 7), seed=11)
    cfg = DeriveConfig(skp=SKPConfig(steps=0), val_size=12, calib_size=32, rho_grid=(1.0, 0.97, 0.9, 0.7, 0.0))
    res = derive(model, [2, 5, 7], x, y, flops=frac, config=cfg)
    an = find_anatomy(res.model)
    measured = model_flops(an)["total"]
    dense = model_flops(find_anatomy(model))["total"]
    target = math.floor(frac * dense)
    step = 8 * 4 * an.num_tokens * an.embed_dim  # 8 MLP channels in one block
    assert target - step < measured <= target, (measured, target, step)
    rec = res.record
    assert rec["flops"] == measured and rec["derivation"]["budget"]["achieved"] == measured
    assert all(b["qk_dim"] % 8 == 0 and b["v_dim"] % 8 == 0 and b["mlp_hidden"] % 8 == 0 for b in rec["blocks"])
    assert len({b["mlp_hidden"] for b in rec["blocks"]}) <= 2  # uniform widths
    for key in ("base_model", "method", "blocks", "dense_blocks", "params", "dense_params", "flops",
                "dense_flops", "derivation", "head", "timing", "settings"):
        assert key in rec
    assert rec["method"] == "nuwa" and rec["head"]["mode"] == "suppress" and rec["head"]["classes"] == [2, 5, 7]
    # the config object, as the Python API got it, is the record's ``config`` (asdict; tuples as lists)
    assert rec["config"] == json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert rec["config"]["rho_grid"] == [1.0, 0.97, 0.9, 0.7, 0.0] and rec["device"] == "cpu"
    json.dumps(rec)


def test_params_budget_with_sliced_head_and_anchor_caps():
    model = _tiny(11)
    x, y = _data(80, classes=(0, 3), seed=12)
    cfg = DeriveConfig(skp=SKPConfig(steps=12, eval_every=4), val_size=16, calib_size=32, head="slice",
                       rho_grid=(1.0, 0.9, 0.0))
    res = derive(model, [3, 0], x, y, params=0.7, config=cfg)
    dense_p = sum(p.numel() for p in model.parameters())
    got = sum(p.numel() for p in res.model.parameters())
    assert got <= math.floor(0.7 * dense_p)
    assert res.record["params"] == got and res.record["head"]["num_classes"] == 2
    anchor_sizes = [len(k) for k in res.anchor.keep]
    assert all(b["mlp_hidden"] <= a for b, a in zip(res.record["blocks"], anchor_sizes))
    assert res.model(x[:3]).shape == (3, 2)


def test_prepare_once_derive_many_budgets():
    model = _tiny(12)
    x, y = _data(60, classes=(1, 2, 5), seed=13)
    prep = prepare(model, [1, 2, 5], x, y,
                   config=DeriveConfig(skp=SKPConfig(steps=0), val_size=12, calib_size=24, rho_grid=(1.0, 0.8)))
    flops = [derive_from(prep, flops=f).record["flops"] for f in (0.9, 0.6)]
    assert flops[1] < flops[0]
    torch.testing.assert_close(prep.base(x[:2]), model(x[:2]), rtol=0, atol=0)  # base untouched


def test_sliced_head_run_round_trip(tmp_path):
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("fmnist-vit")
    model = _fmnist_arch(13)
    x, y = _data(40, shape=(1, 28, 28), classes=(3, 8), seed=14)
    cfg = DeriveConfig(skp=SKPConfig(steps=0), val_size=8, calib_size=16, head="slice", rho=0.9)
    res = derive(model, [8, 3], x, y, flops=0.5, config=cfg, spec=spec)
    out = save_run(tmp_path / "run", res.model, res.record)
    rec = json.loads((out / "run.json").read_text())
    assert rec["head"] == {**rec["head"], "mode": "slice", "classes": [8, 3], "num_classes": 2}
    # what load_run has to do: base architecture + per-block dims + the head entry
    rebuilt = spec.create(pretrained=False)
    apply_structure(rebuilt, rec["blocks"])
    apply_head_structure(rebuilt, rec["head"])
    from safetensors.torch import load_file

    rebuilt.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    torch.testing.assert_close(rebuilt.eval()(x[:4]), res.model(x[:4]))
    loaded, _ = load_run(out)
    torch.testing.assert_close(loaded(x[:4]), res.model(x[:4]))


# ---- errors ---------------------------------------------------------------------------------------
def test_resolve_classes_errors():
    names = ["T-shirt/top", "Trouser", "Bag"]
    assert resolve_classes("2, t-shirt/top", 3, names) == [2, 0]
    for bad, msg in (("0,3", "out of range"), ("1,1", "twice"), ("Sock", "unknown class"), ("", "comma"),
                     ("-1", "out of range")):
        with pytest.raises(UserError, match=msg):
            resolve_classes(bad, 3, names)


def test_derive_errors():
    model = _tiny(14)
    x, y = _data(30, classes=(0, 1), seed=15)
    cfg = DeriveConfig(skp=SKPConfig(steps=0), val_size=5, calib_size=8)
    with pytest.raises(UserError, match="no labeled images for class 2"):
        derive(model, [0, 2], x, y, flops=0.8, config=cfg)
    with pytest.raises(UserError, match="multiples of 8"):
        derive(model, [0, 1], x, y, flops=0.05, config=cfg)
    with pytest.raises(UserError, match="not both"):  # the message of prune
        derive(model, [0, 1], x, y, flops=0.5, params=0.5, config=cfg)
    with pytest.raises(UserError, match="exactly one budget"):
        derive(model, [0, 1], x, y, config=cfg)
    with pytest.raises(UserError, match="must be > 0"):
        derive(model, [0, 1], x, y, flops=-0.5, config=cfg)
    with pytest.raises(UserError, match="multiples of 8"):  # 1.5 is a count of FLOPs, as for prune
        derive(model, [0, 1], x, y, flops=1.5, config=cfg)
    with pytest.raises(UserError, match="out of range"):
        derive(model, [0, 9], x, y, flops=0.5, config=cfg)
    with pytest.raises(UserError, match="no Linear classifier head"):
        derive(nn.Sequential(), [0], x, y, flops=0.5, config=cfg)


def _run_cli(args, capsys):
    from edgeprune.cli.entry import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr()


def test_cli_errors_are_one_line(tmp_path, capsys):
    existing = tmp_path / "exists"
    existing.mkdir()
    cases = [
        (["--classes", "0,11", "--flops", "0.5"], "out of range"),
        (["--classes", "0,0", "--flops", "0.5"], "twice"),
        (["--classes", "0,1", "--flops", "0.02"], "multiples of 8"),
        (["--classes", "0,1"], "exactly one budget"),
        (["--classes", "0,1", "--flops", "0.6", "-o", str(existing)], "already exists"),
    ]
    for args, msg in cases:
        code, cap = _run_cli(["derive", *args, "--quiet"], capsys)
        assert code == 2, cap
        lines = cap.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], cap.err


@needs_fmnist
def test_cli_derive_fmnist_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code = 0
    from edgeprune.cli.entry import main

    try:
        main(["derive", "--model", "fmnist-vit", "--classes", "0,Bag", "--flops", "0.6", "--skp-steps", "4",
              "--skp-eval-every", "2", "--train-per-class", "40", "--val-size", "16", "--calib-size", "16",
              "--eval-size", "64", "--rho", "0.95", "-o", str(out), "--quiet"])
    except SystemExit as exc:
        code = exc.code
    cap = capsys.readouterr()
    assert code in (0, None), cap.err
    assert "saved" in cap.out and "derived" in cap.out
    rec = json.loads((out / "run.json").read_text())
    assert rec["method"] == "nuwa" and rec["derivation"]["classes"] == [0, 8]
    assert rec["derivation"]["class_names"] == ["T-shirt/top", "Bag"]
    assert rec["flops"] <= 0.6 * rec["dense_flops"]
    assert rec["evaluation"]["data"].startswith("Fashion-MNIST test split")
    assert 0.0 <= rec["evaluation"]["derived"]["top1"] <= 1.0
    model, rec2 = load_run(out)
    assert rec2["blocks"] == rec["blocks"]
    xs = torch.randn(2, 1, 28, 28)
    assert set(model(xs).argmax(-1).tolist()) <= {0, 8}  # non-targets suppressed


@needs_fmnist
def test_cli_eval_of_a_nuwa_run_scores_its_target_classes(tmp_path, capsys):
    """``edgeprune eval`` of a derived run: top-1 over the target classes only
    (``edgeprune.evaluate.evaluate_target_classes``), equal to the library's metric."""
    from edgeprune.data.fashion_mnist import load_split
    from edgeprune.nuwa.inputs import evaluate_targets
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("fmnist-vit")
    x, y = load_split("train")
    cfg = DeriveConfig(skp=SKPConfig(steps=0), val_size=16, calib_size=16, rho=0.95)
    res = derive(spec.create(), [1, 7], x[:400], y[:400], flops=0.7, config=cfg, spec=spec)
    out = save_run(tmp_path / "run", res.model, res.record)
    from edgeprune.cli.entry import main

    try:
        main(["eval", str(out), "--eval-size", "200", "--quiet", "--json", str(tmp_path / "m.json")])
    except SystemExit as exc:
        assert exc.code in (0, None)
    assert "target classes [1, 7]" in capsys.readouterr().out
    m = json.loads((tmp_path / "m.json").read_text())
    xe, ye = load_split("test")
    xe, ye = xe[:200], ye[:200]
    keep = torch.isin(ye, torch.tensor([1, 7]))
    assert m["num_images"] == int(keep.sum())
    assert m["top1"] == pytest.approx(evaluate_targets(res.model, xe[keep], ye[keep], [1, 7])[0])
