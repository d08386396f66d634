"""The model families edgeprune supports, and the ones it refuses (with the feature that stops it).

One list, used by the sparsity-0 equivalence guard (``tests/test_architectures.py``), by the
model-name suggestions of :func:`edgeprune.zoo.registry.get_model_spec`, and by the README's table.
Support means *exact*: a model whose blocks are timm's pre-norm ``Block`` with timm's standard
``Attention`` (fused ``qkv``, no q/k norm, no relative-position bias) and a plain ``Mlp``, or a model
converted exactly into that form first (:mod:`edgeprune.zoo.canonical`: timm ``Eva`` -- DINOv3,
``vit_*rope*`` -- with its RoPE tables held by the attention); pruning nothing reproduces the dense
logits (METHODS.md §4). Everything else is
refused by :func:`edgeprune.anatomy.find_anatomy` with a one-line
:class:`~edgeprune.anatomy.UnsupportedModelError` naming the feature.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    """A supported family.

    Attributes:
        family: human-readable name (README table).
        example: a small representative timm name (the guard test builds it).
        test_kwargs: ``timm.create_model`` keywords that make the example small (depth, img_size)
            without changing the block/attention types.
    """

    family: str
    example: str
    test_kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RefusedFamily:
    """A family edgeprune refuses.

    Attributes:
        family: human-readable name; example: a timm name of it; feature: the words the refusal
            message contains (what edgeprune cannot reproduce exactly); patterns: fnmatch
            patterns over timm names (used to refuse early, before a model is built).
    """

    family: str
    example: str
    feature: str
    patterns: tuple[str, ...]


_SMALL = {"depth": 2, "img_size": 32}
_NARROW = {**_SMALL, "embed_dim": 192, "num_heads": 3}  # base-width families at tiny width

SUPPORTED_ARCHITECTURES: tuple[Family, ...] = (
    Family("ViT (class token)", "vit_tiny_patch16_224", dict(_SMALL)),
    Family("DeiT", "deit_tiny_patch16_224", dict(_SMALL)),
    Family("DeiT distilled (class + distillation token)", "deit_tiny_distilled_patch16_224", dict(_SMALL)),
    Family("DeiT III (LayerScale, no pos-embed on class token)", "deit3_small_patch16_224", dict(_SMALL)),
    Family("DINOv2 (LayerScale)", "vit_small_patch14_dinov2", {"depth": 2, "img_size": 28}),
    Family("DINOv2 with register tokens", "vit_small_patch14_reg4_dinov2", {"depth": 2, "img_size": 28}),
    Family("DINOv2 giant (SwiGLU MLP: packed GluMlp, split by edgeprune.zoo.glu)", "vit_giant_patch14_dinov2",
           {"depth": 2, "img_size": 28, "embed_dim": 96, "num_heads": 2}),
    Family("ViT with register tokens, no class token, average pool", "vit_little_patch16_reg4_gap_256",
           dict(_SMALL)),
    Family("ViT, no class token, average pool", "vit_medium_patch16_gap_256", dict(_NARROW)),
    Family("CLIP ViT (pre-norm, QuickGELU)", "vit_base_patch16_clip_quickgelu_224", dict(_NARROW)),
    Family("SigLIP ViT (attention-pool head)", "vit_base_patch16_siglip_224", dict(_NARROW)),
    # timm Eva models, converted exactly (edgeprune.zoo.eva): RoPE tables held by the attention
    Family("DINOv3 (RoPE, 4 registers, LayerScale)", "vit_small_patch16_dinov3", dict(_SMALL)),
    Family("DINOv3 with q/v biases", "vit_small_patch16_dinov3_qkvb", dict(_SMALL)),
    Family("ViT with rotary position embedding (axial RoPE)", "vit_small_patch16_rope_224", dict(_SMALL)),
    Family("ViT with mixed (learned per-head) RoPE", "vit_small_patch16_rope_mixed_224", dict(_SMALL)),
    Family("ViT with RoPE, registers, average pool", "vit_medium_patch16_rope_reg1_gap_256", dict(_NARROW)),
    Family("Perception Encoder spatial (RoPE)", "vit_pe_spatial_tiny_patch16_512", dict(_SMALL)),
    Family("EVA-02 Ti/S (interleaved RoPE, SwiGLU, abs pos)", "eva02_tiny_patch14_224", {"depth": 2, "img_size": 28}),
    Family("DINOv3 S+ (RoPE, SwiGLU)", "vit_small_plus_patch16_dinov3", dict(_SMALL)),
    Family("DINOv3 B (RoPE, registers)", "vit_base_patch16_dinov3", dict(_NARROW)),
    Family("EVA-02 S (interleaved RoPE, SwiGLU)", "eva02_small_patch14_224", {"depth": 2, "img_size": 28}),
)
"""Supported families; the zoo names (``fmnist-vit``, ``dinov2-s14``) are timm ViTs of these."""

REFUSED_ARCHITECTURES: tuple[RefusedFamily, ...] = (
    RefusedFamily("ViT with relative-position bias", "vit_relpos_small_patch16_224",
                  "relative-position bias", ("vit_relpos_*",)),
    RefusedFamily("BEiT / BEiT v2", "beit_base_patch16_224", "relative-position bias",
                  ("beit_*", "beitv2_*")),
    RefusedFamily("BEiT3", "beit3_base_patch16_224", "attention scale norm", ("beit3_*",)),
    RefusedFamily("Perception Encoder core / lang (attention pool)", "vit_pe_core_tiny_patch16_384",
                  "attention pooling", ("vit_pe_core_*", "vit_pe_lang_*")),
    RefusedFamily("EVA-02 B/L (normed SwiGLU hidden, scale_mlp)", "eva02_base_patch14_224", "hidden norm",
                  ("eva02_base_*", "eva02_large_*")),
    RefusedFamily("ViT with post-norm blocks", "vit_base_patch16_rpn_224", "post-norm", ("vit_*_rpn_*",)),
    RefusedFamily("ViT with parallel attention/MLP blocks", "vit_small_patch16_18x2_224", "parallel",
                  ("vit_*_18x2_*", "vit_*_36x1_*", "vit_*_xp_*")),
    RefusedFamily("hybrid CNN-ViT", "vit_small_r26_s32_224", "hybrid CNN patch embedding",
                  ("vit_*_r26_*", "vit_*_r50_*", "vit_*_r_s16_*", "vit_*_resnet*")),
)

#: fnmatch patterns of timm names in the supported families (refused patterns are subtracted).
SUPPORTED_PATTERNS: tuple[str, ...] = ("vit_*", "deit_*", "deit3_*", "eva02_*")


def refused_family(name: str) -> RefusedFamily | None:
    """The refused family a timm model name belongs to, or None."""
    for fam in REFUSED_ARCHITECTURES:
        if any(fnmatch.fnmatchcase(name, p) for p in fam.patterns):
            return fam
    return None


def supported_timm_names(all_names: list[str]) -> list[str]:
    """The names in ``all_names`` (``timm.list_models()``) of the supported families, sorted.

    A name here may still be refused by :func:`edgeprune.anatomy.find_anatomy` (e.g. a qk-norm
    variant); the anatomy is the final check. Used for typo suggestions.
    """
    return sorted(n for n in all_names
                  if any(fnmatch.fnmatchcase(n, p) for p in SUPPORTED_PATTERNS) and refused_family(n) is None)
