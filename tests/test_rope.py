"""Rotary ViTs (issue 54; METHODS.md §6): the exact Eva conversion, whole-pair Q/K pruning, the pair-form
compensation through the rotation and its three invariants, save/reload, and the static-shape export."""

from __future__ import annotations

import pytest
import torch

import edgeprune  # noqa: F401  (the torchvision::nms shim before timm)
from edgeprune.layers.rotary_attention import RotaryAttention
from edgeprune.zoo.canonical import canonical_model

timm = pytest.importorskip("timm")


def _eva(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, **kw).eval()
    with torch.no_grad():  # LayerScale and biases away from their init, so that every term matters
        for n, p in m.named_parameters():
            if "gamma" in n or n.endswith("bias"):
                p.normal_(0.0, 0.3)
    return m


CONVERTED = [
    ("vit_small_patch16_dinov3", dict(img_size=32, depth=2)),           # rotate_half, 4 registers
    ("vit_small_patch16_dinov3_qkvb", dict(img_size=32, depth=2)),      # + q/v bias, zero k bias
    ("eva02_tiny_patch14_224", dict(img_size=56, depth=2)),             # interleaved pairs, abs pos
    ("vit_small_patch16_rope_mixed_224", dict(img_size=32, depth=2)),   # per-depth, per-head tables
    ("vit_medium_patch16_rope_reg1_gap_256", dict(img_size=32, depth=2)),
]


@pytest.mark.parametrize("name,kw", CONVERTED, ids=[c[0] for c in CONVERTED])
def test_eva_conversion_is_exact(name, kw):
    eva = _eva(name, **kw)
    vit = canonical_model(eva)
    assert type(vit).__name__ == "VisionTransformer"
    assert all(isinstance(b.attn, RotaryAttention) for b in vit.blocks)
    x = torch.randn(3, 3, *vit.patch_embed.img_size)
    with torch.no_grad():
        a, b = eva(x), vit(x)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())
    assert canonical_model(vit) is vit  # canonical already: nothing more to convert


def test_a_wrong_rotation_breaks_the_conversion():
    """The tables matter: swapping two pairs' tables changes the output (a mis-assigned rotation is seen)."""
    eva = _eva("vit_small_patch16_dinov3", img_size=32, depth=1)
    vit = canonical_model(eva)
    x = torch.randn(2, 3, 32, 32)
    attn = vit.blocks[0].attn
    with torch.no_grad():
        ref = vit(x)
        cos = attn.rope_cos.clone()
        attn.rope_cos[..., [0, 1]] = cos[..., [1, 0]]
        attn.rope_cos[..., [32, 33]] = cos[..., [33, 32]]
        assert (vit(x) - ref).abs().max() > 1e-4


def _sharpen(model, factor: float = 8.0):
    """Scale every query and key weight: random-init logits are ~0 (uniform softmax), where no Q/K change shows."""
    with torch.no_grad():
        for blk in model.blocks:
            a = blk.attn
            a.qkv.weight[:2 * a.num_heads * a.qk_dim] *= factor
    return model


def _model(**kw):
    return _sharpen(canonical_model(_eva("vit_small_patch16_dinov3", num_classes=10, init_values=1.0, **kw)))


def _pruned(model, x, **settings):
    res = edgeprune.prune(model, x, **settings)
    return res.model


def test_sparsity_zero_is_exact_on_dinov3():
    m = _model(img_size=32, depth=2)
    x = torch.randn(24, 3, 32, 32)
    p = _pruned(m, x, target="both", sparsity=0.0)
    with torch.no_grad():
        assert torch.equal(p(x[:4]), m(x[:4]))


#: the done-when's families: DINOv3 S / S+ (SwiGLU) / B, EVA-02 Ti / S (small images, 2 blocks)
FAMILIES = [("vit_small_patch16_dinov3", dict(img_size=32)), ("vit_small_plus_patch16_dinov3", dict(img_size=32)),
            ("vit_base_patch16_dinov3", dict(img_size=32)), ("eva02_tiny_patch14_224", dict(img_size=56)),
            ("eva02_small_patch14_224", dict(img_size=56))]


@pytest.mark.parametrize("name,kw", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_sparsity_zero_is_exact_on_every_family(name, kw):
    """Pruning nothing changes nothing, bit for bit, on each rotary family the issue names (the converted model
    against itself; its conversion from timm's Eva is exact to 1e-5)."""
    eva = _eva(name, num_classes=10, depth=2, **kw)
    m = canonical_model(eva)
    x = torch.randn(16, 3, *m.patch_embed.img_size, generator=torch.Generator().manual_seed(0))
    p = _pruned(m, x, target="both", sparsity=0.0)
    with torch.no_grad():
        assert torch.equal(p(x[:4]), m(x[:4]))
        assert torch.allclose(eva(x[:4]), m(x[:4]), atol=1e-5, rtol=1e-5)


def test_attn_pruning_keeps_whole_pairs():
    m = _model(img_size=32, depth=2)
    x = torch.randn(48, 3, 32, 32)
    p = _pruned(m, x, target="attn", sparsity=0.5)
    for dense, pruned in zip(m.blocks, p.blocks):
        a, d = pruned.attn, dense.attn
        assert isinstance(a, RotaryAttention) and a.qk_dim == 32
        half = a.qk_dim // 2
        for h in range(a.num_heads):  # every kept column is one dense column, and partners stay together
            cols = []
            for j in range(a.qk_dim):
                hits = [c for c in range(d.qk_dim)
                        if torch.equal(a.rope_cos[h, :, j], d.rope_cos[h, :, c])
                        and torch.equal(a.rope_sin[h, :, j], d.rope_sin[h, :, c])]
                assert hits, f"head {h} dim {j}: a table column the dense head does not have"
                cols.append(hits)
            for j in range(half):  # dim j and j + d'/2 rotate together (sin of the partner equal)
                assert torch.equal(a.rope_sin[h, :, j], a.rope_sin[h, :, j + half])


def _tied_pairs(model, zero_keys: bool = False, qk_scale=(0.3, 0.2), k_scale=(0.25, -0.15)):
    """Pairs 4..7 of every head a complex multiple of pairs 0..3, with the same angle function
    (a test RoPE with repeated frequencies); ``zero_keys``: their keys zero instead."""
    for blk in model.blocks:
        attn = blk.attn
        H, d = attn.num_heads, attn.qk_dim
        p = d // 2
        w = attn.qkv.weight.data
        for part, (a, b) in ((0, qk_scale), (1, k_scale)):
            for h in range(H):
                base = (part * H + h) * d
                for t in range(4, 8):
                    s = t - 4
                    x, y = w[base + s].clone(), w[base + s + p].clone()
                    if part == 1 and zero_keys:
                        w[base + t].zero_()
                        w[base + t + p].zero_()
                    else:  # z_t = (a + ib) z_s
                        w[base + t] = a * x - b * y
                        w[base + t + p] = b * x + a * y
        for tab in (attn.rope_cos, attn.rope_sin):
            for t in range(4, 8):
                tab[..., t] = tab[..., t - 4]
                tab[..., t + p] = tab[..., t - 4 + p]
    return model


def _tiny(zero_keys: bool = False):
    m = canonical_model(_eva("vit_small_patch16_dinov3", num_classes=10, init_values=1.0, img_size=64,
                             depth=1, embed_dim=32, num_heads=2))
    return _tied_pairs(_sharpen(m, 6.0), zero_keys=zero_keys)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _attn_out(model, x):
    """Block 0's attention output (B, n, D): where a Q/K change shows before pooling averages it out."""
    out = {}
    h = model.blocks[0].attn.register_forward_hook(lambda _m, _a, o: out.__setitem__("y", o))
    with torch.no_grad():
        model(x)
    h.remove()
    return out["y"]


@pytest.mark.parametrize("compensation", [True, False])
def test_repeated_frequency_pairs_are_compensated_exactly(compensation):
    """METHODS §6: a removed pair whose logit term is a kept pair's times a complex constant (same angle
    function) is compensated exactly -- and only with the compensation."""
    m = _tiny()
    x = torch.randn(64, 3, 64, 64)
    p = _pruned(m, x, target="attn", sparsity=0.5, compensation=compensation, qk_ridge_alpha=1e-12)
    assert p.blocks[0].attn.qk_dim == 8
    err = _rel(_attn_out(p, x[:16]), _attn_out(m, x[:16]))
    if compensation:
        assert err < 1e-5, err
    else:
        assert err > 1e-4, err


def test_zero_key_pairs_are_removed_exactly():
    m = _tiny(zero_keys=True)
    x = torch.randn(48, 3, 64, 64)
    for comp in (True, False):
        p = _pruned(m, x, target="attn", sparsity=0.5, compensation=comp)
        assert _rel(_attn_out(p, x[:8]), _attn_out(m, x[:8])) < 1e-5


def _rotated_qk(model, imgs):
    """Block 0's rotated queries and keys (B, H, n, d) and its logit scale."""
    attn = model.blocks[0].attn
    out = {}
    h = attn.qkv.register_forward_hook(lambda _m, _a, o: out.__setitem__("qkv", o))
    with torch.no_grad():
        model(imgs)
    h.remove()
    B, n, _ = out["qkv"].shape
    H, dq = attn.num_heads, attn.qk_dim
    q, k = out["qkv"][..., :H * dq], out["qkv"][..., H * dq:2 * H * dq]
    q = attn.rotate(q.reshape(B, n, H, dq).transpose(1, 2)).double()
    k = attn.rotate(k.reshape(B, n, H, dq).transpose(1, 2)).double()
    return q, k, attn.scale


def test_pair_compensation_is_the_least_squares_optimum():
    """On its calibration images the pruned head's logit error equals the smallest the pair form allows,
    found here independently (lstsq over every logit, features Re/Im of each kept pair's term on the rotated
    q, k), and is below the uncompensated error. Fails if the statistics are not rotated or the fold is wrong."""
    m = _model(img_size=48, depth=1)
    x = torch.randn(64, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    q, k, scale = _rotated_qk(m, x)
    ref = (q @ k.transpose(-1, -2)) * scale
    errs = {}
    for comp in (True, False):
        p = _pruned(m, x, target="attn", sparsity=0.5, compensation=comp, qk_ridge_alpha=1e-10)
        qp, kp, sp = _rotated_qk(p, x)
        errs[comp] = float(((qp @ kp.transpose(-1, -2)) * sp - ref)[:, 0].norm())
    # the kept pairs of head 0: the dense table columns its pruned tables hold
    pa, da = p.blocks[0].attn, m.blocks[0].attn
    half, dhalf = pa.qk_dim // 2, da.qk_dim // 2
    kept = [next(c for c in range(dhalf) if torch.equal(pa.rope_sin[0, :, j], da.rope_sin[0, :, c])
                 and torch.equal(pa.rope_cos[0, :, j], da.rope_cos[0, :, c])) for j in range(half)]
    q0, k0 = q[:, 0], k[:, 0]  # (B, n, d)
    feats = []
    for t in kept:
        u = t + dhalf
        qt, qu, kt, ku = q0[..., t, None], q0[..., u, None], k0[..., t], k0[..., u]
        feats.append(qt * kt[:, None, :] + qu * ku[:, None, :])   # Re: a
        feats.append(qt * ku[:, None, :] - qu * kt[:, None, :])   # Im: b
    kept_dims = kept + [t + dhalf for t in kept]
    removed = [c for c in range(da.qk_dim) if c not in kept_dims]
    target = (q0[..., removed] @ k0[..., removed].transpose(-1, -2)) * scale
    a = torch.stack([f.reshape(-1) for f in feats], 1) * scale
    sol = torch.linalg.lstsq(a, target.reshape(-1, 1), driver="gelsd").solution
    best = float((target.reshape(-1, 1) - a @ sol).norm())
    assert best < errs[False]
    assert abs(errs[True] - best) <= 1e-3 * best, (errs, best)


def test_pruned_rotary_run_saves_and_reloads(tmp_path):
    from edgeprune.artifact import load_run, save_run
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("vit_small_patch16_dinov3", random_init=True, img_size=32, num_classes=10,
                          model_kwargs={"depth": 2})
    m = spec.create(pretrained=False)
    x = torch.randn(32, 3, 32, 32)
    res = edgeprune.prune(m, x, spec=spec, target="both", sparsity=0.5)
    save_run(tmp_path / "run", res.model, res.record)
    back, _ = load_run(tmp_path / "run")
    assert isinstance(back.blocks[0].attn, RotaryAttention) and back.blocks[0].attn.qk_dim == 32
    with torch.no_grad():
        assert torch.equal(back(x[:4]), res.model(x[:4]))


def test_token_merging_is_refused_for_rotary_models():
    from edgeprune.errors import UserError
    from edgeprune.tokens.apply import check_mergeable

    with pytest.raises(UserError, match="RoPE"):
        check_mergeable(_model(img_size=32, depth=1))


def test_odd_kept_dims_are_refused():
    from edgeprune.errors import UserError

    m = _model(img_size=32, depth=1)
    with pytest.raises(UserError, match="whole RoPE pairs"):
        edgeprune.prune(m, torch.randn(8, 3, 32, 32), target="attn", sparsity=0.5, round_to=3)


@pytest.mark.parametrize("pruned", [False, True], ids=["dense", "pruned"])
def test_rotary_export_is_static_and_verifies(tmp_path, pruned):
    """The RoPE tables are constants of the graph: no If / Tile / Loop, every non-batch dim static, and ONNX
    Runtime equals PyTorch (fp32, and the fp16 conversion within fp16 round-off)."""
    pytest.importorskip("onnxruntime")
    import onnx

    from exporters.onnx import export_onnx
    from exporters.quantization.recipe_fp16 import convert_fp16
    from exporters.verify import verify_onnx

    m = _model(img_size=32, depth=2)
    x = torch.randn(16, 3, 32, 32)
    if pruned:
        m = _pruned(m, x, target="both", sparsity=0.5)
        assert m.blocks[0].attn.qk_dim == 32
    fixed = export_onnx(m, tmp_path / "fixed.onnx", (3, 32, 32), dynamic_batch=False, batch_size=8)
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(fixed)), strict_mode=True)
    for v in proto.graph.value_info:  # a fixed batch: every shape static, the RoPE part included
        assert all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim), v.name
    assert verify_onnx(fixed, m, x, atol=1e-4, batch_size=8)["passed"]
    path = export_onnx(m, tmp_path / "m.onnx", (3, 32, 32))
    proto = onnx.load(str(path))
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    for v in inferred.graph.value_info:  # the default dynamic batch: the batch is each tensor's one symbolic dim
        assert sum(not d.HasField("dim_value") for d in v.type.tensor_type.shape.dim) <= 1, v.name
    ops = {n.op_type for n in proto.graph.node}
    assert not ops & {"If", "Tile", "Loop", "Range", "NonZero"}, ops
    assert not any("rope" in n.name.lower() or "rotary" in n.name.lower() for n in proto.graph.node)
    report = verify_onnx(path, m, x, atol=1e-4)
    assert report["passed"], report
    half = convert_fp16(path, tmp_path / "m16.onnx")
    r16 = verify_onnx(half, m, x, atol=5e-2, rtol=5e-2)
    assert r16["passed"] and r16["agreement"] >= 0.9, r16


def test_class_token_last_block_rotates_its_queries():
    """global_pool='token' with the class-token last block (queries of token 0 only): sparsity 0 stays exact,
    so the block's queries are rotated with the first rows of the tables and its keys with all of them."""
    from edgeprune.layers.class_token_block import ClassTokenBlock

    m = _sharpen(canonical_model(_eva("vit_small_patch16_dinov3", num_classes=10, init_values=1.0, img_size=32,
                                      depth=2, global_pool="token")))
    x = torch.randn(16, 3, 32, 32)
    p = _pruned(m, x, target="both", sparsity=0.0, last_block="cls")
    assert isinstance(p.blocks[-1], ClassTokenBlock)
    with torch.no_grad():
        assert _rel(p(x[:8]), m(x[:8])) < 1e-6


def test_general_form_is_its_least_squares_optimum_and_beats_the_pair_form():
    """``rope_compensation="general"`` (a full M before the rotation): its calibration logit error equals the
    least-squares optimum over every d' x d' M (lstsq on the features vec(R_m^T k~_n q_m^T) of every logit), is
    at most the pair form's, and the fold puts it where RoPE rotates it (a wrong fold misses the optimum)."""
    from edgeprune.solve.qk_rope import unrotate

    m = _model(img_size=32, depth=1)
    x = torch.randn(24, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    q, k, scale = _rotated_qk(m, x)
    ref = (q @ k.transpose(-1, -2)) * scale
    errs, models = {}, {}
    for form in ("pair", "general"):
        p = _pruned(m, x, target="attn", sparsity=0.5, rope_compensation=form, qk_ridge_alpha=1e-10)
        qp, kp, sp = _rotated_qk(p, x)
        errs[form] = float(((qp @ kp.transpose(-1, -2)) * sp - ref)[:, 0].norm())
        models[form] = p
    pa, da = models["general"].blocks[0].attn, m.blocks[0].attn
    half, dhalf = pa.qk_dim // 2, da.qk_dim // 2
    kept = [next(c for c in range(dhalf) if torch.equal(pa.rope_sin[0, :, j], da.rope_sin[0, :, c])
                 and torch.equal(pa.rope_cos[0, :, j], da.rope_cos[0, :, c])) for j in range(half)]
    dims = torch.tensor(kept + [t + dhalf for t in kept])
    removed = [c for c in range(da.qk_dim) if c not in dims.tolist()]
    cos, sin = da.rope_cos[0][:, dims].double(), da.rope_sin[0][:, dims].double()
    q0, k0 = q[:, 0], k[:, 0]
    q_plain = unrotate(q0[..., dims][:, None], cos[None], sin[None])[:, 0]          # (B, n, d')
    ks = k0[..., dims]                                                              # rotated kept keys
    g = unrotate(ks[:, None, :, :].expand(-1, ks.shape[1], -1, -1),                 # g[b, m, n] = R_m^T k~_n
                 cos[None, :, None, :], sin[None, :, None, :])
    feats = (g[..., :, None] * q_plain[:, :, None, None, :]).reshape(-1, len(dims) ** 2) * scale
    target = ((q0[..., removed] @ k0[..., removed].transpose(-1, -2)) * scale).reshape(-1, 1)
    # the SVD driver: the features are rank-deficient (prefix tokens are not rotated), where gelsy can stop short
    best = float((target - feats @ torch.linalg.lstsq(feats, target, driver="gelsd").solution).norm())
    assert errs["general"] <= errs["pair"] * (1 + 1e-9)
    assert abs(errs["general"] - best) <= 1e-3 * best, (errs, best)
