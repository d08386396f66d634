"""The registry of exact model conversions (:class:`Converter`, :data:`CONVERTERS`); the conversions register
themselves (:mod:`edgeprune.zoo.eva`, :mod:`edgeprune.zoo.glu`) and :func:`edgeprune.zoo.canonical.canonical_model`
applies them."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch.nn as nn

from edgeprune.registry import Registry


@dataclasses.dataclass(frozen=True)
class Converter:
    """One exact conversion.

    Attributes:
        applies: ``model -> bool``: the model (the ViT itself) has the form this converter rewrites.
        convert: ``model -> model``: the converted model (a new module or the same one changed in
            place), computing the same function in eval mode. Raises
            :class:`~edgeprune.anatomy.UnsupportedModelError` (one line, naming the feature) when the
            model has the form but a feature the conversion cannot keep exactly.
        what: a few words for messages and the run record (e.g. ``"timm Eva -> VisionTransformer"``).
    """

    applies: Callable[[nn.Module], bool]
    convert: Callable[[nn.Module], nn.Module]
    what: str


CONVERTERS: Registry[Converter] = Registry("model conversion")
