"""Exact conversions of the ViT variants edgeprune prunes into the one form its pipeline reads.

The pipeline (anatomy -> statistics -> plan -> solve -> surgery -> export) reads a timm
``VisionTransformer`` whose blocks are timm's pre-norm ``Block``. Models written another way but
computing the same function are *converted* first, exactly (no weight changes beyond regrouping):

* ``eva`` (:mod:`edgeprune.zoo.eva`): timm ``Eva`` (DINOv3, EVA-02, ``vit_*rope*``) -> a
  ``VisionTransformer`` whose attention is :class:`~edgeprune.layers.rotary_attention.RotaryAttention`
  (fused ``qkv``, the RoPE tables of the fixed image size held as buffers);
* gated MLPs (timm ``GluMlp`` / ``SwiGLU``), when their converter is registered.

Each conversion is a :class:`Converter` in :data:`CONVERTERS` (one :class:`~edgeprune.registry.Registry`);
:func:`canonical_model` applies them until none applies. A model already canonical is returned as it
is. :class:`~edgeprune.zoo.registry.ModelSpec` converts every model it builds (after its checkpoint is
loaded, so the checkpoint's own key names apply), and the Python entry points convert a model passed in.
"""

from __future__ import annotations

import torch.nn as nn
from edgeprune.backbone import BackboneError, backbone_of, replace_backbone

from edgeprune.zoo import eva, glu  # noqa: F401  (register "eva", then "glu": Eva keeps its MLPs for it)
from edgeprune.zoo.converters import CONVERTERS, Converter

__all__ = ["CONVERTERS", "Converter", "canonical_model", "conversions_for"]


def conversions_for(model: nn.Module) -> list[str]:
    """Names of the registered conversions that apply to ``model`` now (empty: already canonical)."""
    return [name for name, conv in CONVERTERS.items() if conv.applies(_vit_of(model))]


def _vit_of(model: nn.Module) -> nn.Module:
    try:
        return backbone_of(model)
    except BackboneError:
        return model  # find_anatomy says why


def canonical_model(model: nn.Module) -> nn.Module:
    """``model`` in the form the pipeline reads, converted exactly (see the module docstring).

    A network holding its ViT (:mod:`edgeprune.backbone`) keeps its other modules; its backbone is converted.
    Eval mode is kept as it was.

    Returns:
        The converted model (``model`` itself when nothing applies).

    Raises:
        UnsupportedModelError: a converter's model has a feature the conversion cannot keep.
    """
    for _ in range(len(CONVERTERS) + 1):
        vit = _vit_of(model)
        pending = [conv for _, conv in CONVERTERS.items() if conv.applies(vit)]
        if not pending:
            return model
        new = pending[0].convert(vit)
        if vit is model:
            model = new
        else:
            replace_backbone(model, new)
    raise RuntimeError("model conversions did not settle (a converter applies to its own output)")
