"""Known-answer tests for ``edgeprune.surgery`` (issue 17: kill the mutants that survived run 5).

Small random timm ViTs (D=32, 4 heads of head_dim 8, D_mlp=64, 16x16 images: a few ms each), with
and without biases, float32 and float64, and on the ``meta`` device. What is checked:

* ``shrink_mlp`` keeps exactly fc1's rows ``keep`` (and bias entries), installs the given fc2, keeps
  the block's dtype / device / bias-less layout, and updates the anatomy;
* ``qkv_parts`` splits the fused qkv in the documented ``[q; k; v]``, head-major layout;
* ``replace_attention`` gives a module whose forward equals attention computed by hand from the
  given per-head weights (softmax(q k^T / sqrt(qk_dim')) v, then proj);
* ``block_dims`` returns the exact per-block dims, and ``block_dims`` -> ``apply_structure`` ->
  strict ``load_state_dict`` rebuilds a pruned model bit-exactly (1 kept head, qk_dim != v_dim,
  pruned MLP; every bias combination), including the record's ``head_dim`` (and the model's when
  the record has none) and the head-count bounds 1 <= heads <= H.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from edgeprune.anatomy import find_anatomy
from edgeprune.layers.pruned_attention import PrunedAttention
from edgeprune.surgery import apply_structure, block_dims, qkv_parts, replace_attention, shrink_mlp

D, H, HD, DMLP = 32, 4, 8, 64


def _vit(timm, seed=0, qkv_bias=True, proj_bias=True, fc1_bias=None, dtype=torch.float32):
    """A 2-block ViT (D=32, H=4, head_dim 8, D_mlp=64) on 16x16 images; fc1_bias overrides fc1's bias."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    m = VisionTransformer(img_size=16, patch_size=8, num_classes=5, embed_dim=D, depth=2, num_heads=H,
                          mlp_ratio=DMLP / D, qkv_bias=qkv_bias, proj_bias=proj_bias)
    if fc1_bias is not None:
        for blk in m.blocks:
            blk.mlp.fc1 = nn.Linear(D, DMLP, bias=fc1_bias)
    with torch.no_grad():  # timm zero-inits biases: make them visible
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.to(dtype).eval()


def _prune(model):
    """Block 0: 1 head kept (head 2), qk_dim 3, v_dim 5, MLP channels 10 kept; block 1: all heads,
    dims unchanged, but a PrunedAttention (and the dense MLP). Weights are slices of the dense ones."""
    an = find_anatomy(model)
    b0, b1 = an.blocks
    p = qkv_parts(b0)
    keep = torch.tensor([2])
    sl = lambda t, n: None if t is None else t[keep][:, :n].clone()  # noqa: E731
    pw = b0.proj.weight.detach().reshape(D, H, HD)[:, keep, :5].reshape(D, 5).clone()
    pb = None if b0.proj.bias is None else b0.proj.bias.detach().clone()
    replace_attention(b0, sl(p["wq"], 3), sl(p["bq"], 3), sl(p["wk"], 3), sl(p["bk"], 3),
                      sl(p["wv"], 5), sl(p["bv"], 5), pw, pb)
    mk = torch.arange(0, DMLP, 6)  # 11 channels
    w2 = b0.fc2.weight.detach()[:, mk].clone()
    shrink_mlp(b0, mk, w2, None if b0.fc2.bias is None else b0.fc2.bias.detach().clone())
    p1 = qkv_parts(b1)
    replace_attention(b1, p1["wq"], p1["bq"], p1["wk"], p1["bk"], p1["wv"], p1["bv"],
                      b1.proj.weight.detach(), None if b1.proj.bias is None else b1.proj.bias.detach())
    return an


# ---- shrink_mlp / _linear ----------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_shrink_mlp_float64_keeps_rows_dtype_and_bias_layout(timm, bias):
    model = _vit(timm, qkv_bias=bias, proj_bias=bias, dtype=torch.float64)
    b = find_anatomy(model).blocks[1]
    w1 = b.fc1.weight.detach().clone()
    b1 = None if b.fc1.bias is None else b.fc1.bias.detach().clone()
    keep = torch.tensor([5, 1, 40, 7])
    w2 = torch.randn(D, 4, dtype=torch.float64)
    c2 = torch.randn(D, dtype=torch.float64) if bias else None
    shrink_mlp(b, keep, w2, c2)
    fc1, fc2 = b.block.mlp.fc1, b.block.mlp.fc2
    assert b.fc1 is fc1 and b.fc2 is fc2 and b.mlp_hidden == 4
    assert (fc1.in_features, fc1.out_features, fc2.in_features, fc2.out_features) == (D, 4, 4, D)
    assert fc1.weight.dtype == fc2.weight.dtype == torch.float64
    assert torch.equal(fc1.weight, w1[keep]) and torch.equal(fc2.weight, w2)
    if bias:
        assert torch.equal(fc1.bias, b1[keep]) and torch.equal(fc2.bias, c2)
    else:
        assert fc1.bias is None and fc2.bias is None
    x = torch.randn(3, D, dtype=torch.float64)
    h = F.gelu(x @ w1[keep].T + (0 if b1 is None else b1[keep]))
    ref = h @ w2.T + (0 if c2 is None else c2)
    torch.testing.assert_close(b.block.mlp(x), ref, rtol=1e-12, atol=1e-12)


def test_shrink_mlp_mixed_biases_and_meta_device(timm):
    # fc1 without bias, fc2 with one (fc1's layout is kept, fc2's follows the given bias)
    model = _vit(timm, fc1_bias=False)
    b = find_anatomy(model).blocks[0]
    shrink_mlp(b, torch.tensor([0, 3]), torch.randn(D, 2), torch.randn(D))
    assert b.fc1.bias is None and b.fc2.bias is not None and b.fc2.bias.shape == (D,)
    # modules are built on the block's device (here: meta, as CUDA would be)
    meta = _vit(timm).to("meta")
    bm = find_anatomy(meta).blocks[0]
    shrink_mlp(bm, torch.tensor([0, 3]), torch.empty(D, 2, device="meta"), torch.empty(D, device="meta"))
    assert {p.device.type for p in bm.block.mlp.parameters()} == {"meta"}


# ---- qkv_parts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_parts_layout_on_a_block_with_qk_dim_not_v_dim(timm, bias):
    model = _vit(timm, qkv_bias=bias)
    _prune(model)  # block 0 now: 1 head, qk 3, v 5
    for b, (h, dq, dv) in zip(find_anatomy(model).blocks, [(1, 3, 5), (H, HD, HD)]):
        w = b.qkv.weight.detach()
        p = qkv_parts(b)
        assert p["wq"].shape == (h, dq, D) and p["wk"].shape == (h, dq, D) and p["wv"].shape == (h, dv, D)
        for i in range(h):
            assert torch.equal(p["wq"][i], w[i * dq:(i + 1) * dq])
            assert torch.equal(p["wk"][i], w[h * dq + i * dq:h * dq + (i + 1) * dq])
            assert torch.equal(p["wv"][i], w[2 * h * dq + i * dv:2 * h * dq + (i + 1) * dv])
        if bias:
            c = b.qkv.bias.detach()
            assert torch.equal(p["bq"].reshape(-1), c[:h * dq])
            assert torch.equal(p["bk"].reshape(-1), c[h * dq:2 * h * dq])
            assert torch.equal(p["bv"].reshape(-1), c[2 * h * dq:])
            assert p["bq"].shape == (h, dq) and p["bk"].shape == (h, dq) and p["bv"].shape == (h, dv)
        else:
            assert p["bq"] is None and p["bk"] is None and p["bv"] is None


# ---- replace_attention ---------------------------------------------------------------------------
def _attention_by_hand(x, wq, bq, wk, bk, wv, bv, pw, pb):
    outs = []
    for i in range(wq.shape[0]):
        q = x @ wq[i].T + (0 if bq is None else bq[i])
        k = x @ wk[i].T + (0 if bk is None else bk[i])
        v = x @ wv[i].T + (0 if bv is None else bv[i])
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(wq.shape[1]), dim=-1)
        outs.append(a @ v)
    return torch.cat(outs, -1) @ pw.T + (0 if pb is None else pb)


@pytest.mark.parametrize("qkv_bias,proj_bias", [(True, False), (False, True), (False, False)])
def test_replace_attention_computes_attention_from_the_given_weights(timm, qkv_bias, proj_bias):
    model = _vit(timm, qkv_bias=qkv_bias, proj_bias=proj_bias, dtype=torch.float64)
    b = find_anatomy(model).blocks[1]
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    wq, wk, wv = r(2, 3, D), r(2, 3, D), r(2, 5, D)
    bq, bk, bv = (r(2, 3), r(2, 3), r(2, 5)) if qkv_bias else (None, None, None)
    pw, pb = r(D, 10), (r(D) if proj_bias else None)
    attn = replace_attention(b, wq, bq, wk, bk, wv, bv, pw, pb)
    assert isinstance(attn, PrunedAttention)
    assert b.block.attn is attn and b.attn is attn and b.qkv is attn.qkv and b.proj is attn.proj
    assert (b.num_heads, b.qk_dim, b.v_dim) == (2, 3, 5)
    assert (attn.num_heads, attn.qk_dim, attn.v_dim, attn.dense_head_dim) == (2, 3, 5, HD)
    assert attn.qkv.weight.dtype == torch.float64
    assert (attn.qkv.bias is not None) == qkv_bias and (attn.proj.bias is not None) == proj_bias
    x = r(2, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), _attention_by_hand(x, wq, bq, wk, bk, wv, bv, pw, pb),
                                   rtol=1e-10, atol=1e-10)
    # the anatomy of the edited model reads the same dims (and the dense head_dim)
    b2 = find_anatomy(model).blocks[1]
    assert (b2.num_heads, b2.qk_dim, b2.v_dim, b2.head_dim) == (2, 3, 5, HD)


def test_replace_attention_on_the_meta_device(timm):
    b = find_anatomy(_vit(timm).to("meta")).blocks[0]
    e = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    attn = replace_attention(b, e(1, 2, D), e(1, 2), e(1, 2, D), e(1, 2), e(1, 4, D), e(1, 4), e(D, 4), e(D))
    assert {p.device.type for p in attn.parameters()} == {"meta"}


# ---- block_dims -> apply_structure round trip ------------------------------------------------------
@pytest.mark.parametrize("qkv_bias,proj_bias,fc1_bias", [(False, False, None), (True, False, None),
                                                         (False, True, None), (True, True, False)])
def test_block_dims_apply_structure_round_trip_is_exact(timm, qkv_bias, proj_bias, fc1_bias):
    pruned = _vit(timm, 0, qkv_bias, proj_bias, fc1_bias)
    an = _prune(pruned)
    rec = block_dims(an)
    assert rec == [dict(index=0, num_heads=1, head_dim=HD, qk_dim=3, v_dim=5, mlp_hidden=11),
                   dict(index=1, num_heads=H, head_dim=HD, qk_dim=HD, v_dim=HD, mlp_hidden=DMLP)]
    fresh = _vit(timm, 1, qkv_bias, proj_bias, fc1_bias)  # other weights, same dense layout
    assert apply_structure(fresh, rec) is fresh
    assert block_dims(find_anatomy(fresh)) == rec
    a0 = fresh.blocks[0].attn  # block 1 keeps its dense dims: timm's Attention loads the same keys
    assert isinstance(a0, PrunedAttention) and a0.dense_head_dim == HD
    fresh.load_state_dict(pruned.state_dict(), strict=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(fresh(x), pruned(x))


def test_apply_structure_head_dim_from_the_record_and_head_bounds(timm):
    model = _vit(timm)
    rec = block_dims(find_anatomy(model))
    # every head count 1..H is accepted; the record's head_dim is what the rebuilt module remembers
    for heads in (1, H):
        rec[0].update(num_heads=heads, qk_dim=2, v_dim=3, head_dim=16)
        rec[1].update(num_heads=heads, qk_dim=4, v_dim=4)
        del rec[1]["head_dim"]  # an older record: the model's own head_dim is used
        m = apply_structure(_vit(timm), rec)
        a0, a1 = m.blocks[0].attn, m.blocks[1].attn
        assert (a0.num_heads, a0.qk_dim, a0.v_dim, a0.dense_head_dim) == (heads, 2, 3, 16)
        assert (a1.num_heads, a1.qk_dim, a1.v_dim, a1.dense_head_dim) == (heads, 4, 4, HD)
        assert a0.qkv.weight.shape == (heads * 7, D) and a0.proj.weight.shape == (D, heads * 3)
        rec[1]["head_dim"] = HD
    for bad in (0, H + 1):
        rec[0]["num_heads"] = bad
        with pytest.raises(ValueError, match=f"block 0: record has {bad} heads, model {H}"):
            apply_structure(_vit(timm), rec)
    with pytest.raises(ValueError, match="record has 1 blocks, model has 2"):
        apply_structure(_vit(timm), rec[:1])


def test_apply_structure_rebuilds_an_already_pruned_attention_and_keeps_a_dense_one(timm):
    # a model that already holds PrunedAttention modules is given fresh ones of the record's dims
    pruned = _vit(timm)
    _prune(pruned)
    rec = block_dims(find_anatomy(pruned))
    old = [blk.attn for blk in pruned.blocks]
    apply_structure(pruned, rec)
    assert all(blk.attn is not o for blk, o in zip(pruned.blocks, old))
    assert block_dims(find_anatomy(pruned)) == rec
    # a dense record leaves a dense model's modules alone (same objects, same weights)
    dense = _vit(timm)
    mods = [(blk.attn, blk.mlp.fc1, blk.mlp.fc2) for blk in dense.blocks]
    apply_structure(dense, block_dims(find_anatomy(dense)))
    assert [(blk.attn, blk.mlp.fc1, blk.mlp.fc2) for blk in dense.blocks] == mods
