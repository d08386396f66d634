"""Anatomy on every supported family (random init) and clear errors for anything else."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from edgeprune.anatomy import UnsupportedModelError, find_anatomy
from edgeprune.flops import model_flops


@pytest.mark.parametrize("name,kwargs,prefix,ls,heads,head_dim,mlp", [
    ("deit_tiny_patch16_224", {}, 1, False, 3, 64, 768),
    ("vit_tiny_patch16_224", {}, 1, False, 3, 64, 768),
    ("deit3_small_patch16_224", {}, 1, True, 6, 64, 1536),
    ("deit_tiny_distilled_patch16_224", {}, 2, False, 3, 64, 768),
    ("vit_small_patch14_dinov2", {"img_size": 126}, 1, True, 6, 64, 1536),
])
def test_anatomy_families(timm, name, kwargs, prefix, ls, heads, head_dim, mlp):
    model = timm.create_model(name, pretrained=False, **kwargs)
    an = find_anatomy(model)
    assert an.num_prefix_tokens == prefix
    assert len(an.blocks) == 12
    b = an.blocks[0]
    assert (b.num_heads, b.head_dim, b.qk_dim, b.v_dim, b.mlp_hidden) == (heads, head_dim, head_dim, head_dim, mlp)
    assert (b.ls1 is not None) == ls and (b.ls2 is not None) == ls
    assert b.qkv.out_features == 3 * heads * head_dim
    assert an.num_tokens == prefix + an.num_patches
    # the token count the model really uses
    seen = {}
    h = b.block.register_forward_pre_hook(lambda m, a: seen.__setitem__("n", a[0].shape[1]))
    with torch.no_grad():
        model(torch.randn(1, 3, *an.img_size))
    h.remove()
    assert seen["n"] == an.num_tokens


def test_deit3_has_no_class_token_in_pos_embed(timm):
    model = timm.create_model("deit3_small_patch16_224", pretrained=False)
    an = find_anatomy(model)
    assert model.pos_embed.shape[1] == an.num_patches  # prefix tokens added after pos_embed


def test_flops_match_torch_flop_counter(timm):
    from torch.utils.flop_counter import FlopCounterMode

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    an = find_anatomy(model)
    for b in an.blocks:  # explicit q @ k^T and attn @ v, which the counter sees on CPU
        b.attn.fused_attn = False
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    counted = fc.get_total_flops()
    ours = model_flops(an)["total"]
    assert abs(ours - counted) / counted < 0.01, (ours, counted)


def test_unsupported_models_name_what_is_missing(timm):
    with pytest.raises(UnsupportedModelError, match="blocks"):
        find_anatomy(nn.Sequential(nn.Linear(3, 3)))
    swiglu = timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False, img_size=56,
                               mlp_layer=timm.layers.SwiGLUPacked, mlp_ratio=2.66667 * 2)
    with pytest.raises(UnsupportedModelError, match="fc1/act/fc2|GLU|hidden norm"):
        find_anatomy(swiglu)


def test_dinov2_wrapper_anatomy():
    from edgeprune.zoo.dinov2 import create_dinov2_s14

    model = create_dinov2_s14(pretrained=False)
    an = find_anatomy(model)
    assert an.vit is model.backbone
    assert an.num_tokens == 257 and an.blocks[0].ls1 is not None


def test_dinov2_flops_include_the_decoder_and_match_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    from edgeprune.zoo.dinov2 import create_dinov2_s14

    model = create_dinov2_s14(pretrained=False).eval()
    an = find_anatomy(model)
    for b in an.blocks:
        b.attn.fused_attn = False
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    counted = fc.get_total_flops()
    ours = model_flops(an)
    assert ours["head"] == model.head_flops((224, 224)) > 2e9  # three 4x4 transposed convs
    assert abs(ours["total"] - counted) / counted < 0.01, (ours["total"], counted)
