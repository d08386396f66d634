"""The sparsity-0 equivalence guard over every supported architecture, and the refusals.

Issue 12, defect 1: ``vit_relpos_*`` was pruned silently wrong (``PrunedAttention`` dropped the
relative-position bias, 2.8% off at block 0 with nothing pruned) and BEiT crashed. METHODS.md §4:
pruning nothing reproduces the dense model. For every family in
:data:`edgeprune.zoo.families.SUPPORTED_ARCHITECTURES` (random init, 2 blocks, small images):

* ``edgeprune.prune(..., sparsity=0.0)`` through the real pipeline gives the dense logits, and
* replacing every block's attention by a :class:`PrunedAttention` that keeps every dim and every
  MLP by one that keeps every channel (the surgery a pruned block gets) gives the dense logits
  too (max abs diff <= 1e-5) -- this is what catches attention features the pruned layer drops;

every refused family raises a one-line :class:`UnsupportedModelError` naming its feature.
"""

from __future__ import annotations

import pytest
import torch

from edgeprune.anatomy import UnsupportedModelError, find_anatomy
from edgeprune.errors import UserError
from edgeprune.zoo.canonical import canonical_model
from edgeprune.zoo.families import REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES

TOL = 1e-5


def _randomize(model, seed):
    """Weights at which every branch matters (timm's init scales LayerScale to 1e-5 and the
    Linears to std 0.02, which would hide a wrong attention branch below any tolerance)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(shape):
        return torch.randn(shape, generator=g)

    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(rnd(mod.weight.shape) / mod.in_features ** 0.5)
                if mod.bias is not None:
                    mod.bias.copy_(0.3 * rnd(mod.bias.shape))
            elif isinstance(mod, torch.nn.LayerNorm) and mod.weight is not None:
                mod.weight.copy_(1 + 0.2 * rnd(mod.weight.shape))
            elif hasattr(mod, "gamma") and isinstance(mod.gamma, torch.nn.Parameter):  # LayerScale
                mod.gamma.copy_(0.5 + torch.rand(mod.gamma.shape, generator=g))
        for name, p in model.named_parameters():
            if name.split(".")[-1] in ("pos_embed", "cls_token", "reg_token", "dist_token", "latent"):
                p.copy_(0.5 * rnd(p.shape))
    return model


def _build(timm, name, kwargs, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = canonical_model(timm.create_model(name, pretrained=False, **kwargs).eval())
    _randomize(model, seed)
    an = find_anatomy(model)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(3, an.in_chans, *an.img_size, generator=g)
    return model, x


def _keep_everything(model):
    """Every block gets the pruned layers (PrunedAttention, new fc1/fc2) with all dims kept."""
    from edgeprune.layers.pruned_attention import PrunedAttention
    from edgeprune.layers.rotary_attention import is_rotary
    from edgeprune.surgery import qkv_parts, replace_attention, shrink_mlp

    for b in find_anatomy(model).blocks:
        p = qkv_parts(b)
        proj = b.proj
        rope = (b.attn.rope_cos, b.attn.rope_sin) if is_rotary(b.attn) else None  # the rotary surgery keeps them
        replace_attention(b, p["wq"], p["bq"], p["wk"], p["bk"], p["wv"], p["bv"], proj.weight.detach(),
                          None if proj.bias is None else proj.bias.detach(), rope=rope)
        shrink_mlp(b, torch.arange(b.mlp_hidden), b.fc2.weight.detach().clone(),
                   None if b.fc2.bias is None else b.fc2.bias.detach().clone())
        assert isinstance(b.block.attn, PrunedAttention)
    return model


@pytest.mark.parametrize("fam", SUPPORTED_ARCHITECTURES, ids=lambda f: f.example)
def test_pruning_nothing_reproduces_the_dense_logits(timm, fam):
    import edgeprune

    model, x = _build(timm, fam.example, fam.test_kwargs)
    with torch.no_grad():
        dense = model(x)
    res = edgeprune.prune(model, x, target="both", sparsity=0.0)
    with torch.no_grad():
        assert (res.model(x) - dense).abs().max().item() <= TOL
        surgered = _keep_everything(res.model)
        diff = (surgered(x) - dense).abs().max().item()
    assert diff <= TOL, f"{fam.example}: pruned layers with nothing pruned differ by {diff:.3g}"


def test_the_guard_catches_an_attention_feature_the_pruned_layer_drops(timm, monkeypatch):
    """The check above fails for relative-position attention once the refusal is bypassed."""
    from edgeprune import anatomy

    monkeypatch.setattr(anatomy, "unsupported_features", lambda vit: [])  # bypass the refusal
    model, x = _build(timm, "vit_relpos_small_patch16_224", {"depth": 2, "img_size": 32})
    with torch.no_grad():
        dense = model(x)
    with torch.no_grad():
        diff = (_keep_everything(model)(x) - dense).abs().max().item()
    assert diff > 100 * TOL


@pytest.mark.parametrize("fam", REFUSED_ARCHITECTURES, ids=lambda f: f.example)
def test_refused_architectures_name_the_feature(timm, fam):
    import edgeprune

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = timm.create_model(fam.example, pretrained=False, depth=1).eval()
    with pytest.raises(UnsupportedModelError) as info:  # a converted form (timm Eva) refused by its conversion
        find_anatomy(canonical_model(model))
    msg = str(info.value)
    assert fam.feature.lower() in msg.lower() and "\n" not in msg, msg
    assert isinstance(info.value, UserError)
    x = torch.randn(1, 3, 224, 224)
    with pytest.raises(UnsupportedModelError, match=fam.feature):
        edgeprune.prune(model, x, target="both", sparsity=0.5)


def test_the_model_spec_refuses_a_refused_family_before_building_it():
    from edgeprune.zoo.registry import get_model_spec

    for fam in REFUSED_ARCHITECTURES:
        with pytest.raises(UnsupportedModelError, match=fam.feature):
            get_model_spec(fam.example, random_init=True)


def test_unknown_attention_classes_are_refused(timm):
    from timm.layers.attention import Attention

    class MyAttention(Attention):
        pass

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, img_size=32)
    old = model.blocks[0].attn
    model.blocks[0].attn = MyAttention(old.qkv.in_features, num_heads=old.num_heads, qkv_bias=True)
    with pytest.raises(UnsupportedModelError, match="unknown attention class .*MyAttention"):
        find_anatomy(model)
