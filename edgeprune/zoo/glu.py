"""Packed gated MLPs (timm ``GluMlp``) converted exactly into timm's split ``SwiGLU`` (issue 54, METHODS.md §6
"Gated MLPs").

timm writes a gated MLP two ways:

* ``GluMlp``: one packed ``fc1`` Linear(D, 2H); its output splits into halves ``x1, x2`` (H each) and the
  hidden is ``x1 * act(x2)`` (``gate_last=True``) or ``act(x1) * x2`` (``gate_last=False``: DINOv2-g's
  ``SwiGLUPacked``, EVA-02's MLP);
* ``SwiGLU``: separate ``fc1_g`` (the gate) and ``fc1_x`` (the up projection), Linear(D, H) each, hidden
  ``act(fc1_g(u)) * fc1_x(u)`` (DINOv3 S+/H+, EVA-02 B/L).

The pipeline reads the second form (:mod:`edgeprune.anatomy`: ``fc1`` is the up projection ``fc1_x``,
``fc1_gate`` the gate ``fc1_g``), so hidden channel j is row j of each of the two and column j of ``fc2``.
:func:`convert_glu` rewrites every ``GluMlp`` of a model into a ``SwiGLU`` holding the same weights, split:
with ``W1`` (2H, D) and ``b1`` (2H,) the packed weight and bias, the gate is rows ``[0, H)`` when
``gate_last=False`` and rows ``[H, 2H)`` when ``gate_last=True``, the up projection the other half. The
activation, dropouts, hidden norm and ``fc2`` are moved over unchanged, so the function is exactly the same
(the same products, in the same order). A hidden norm (EVA-02 B/L ``scale_mlp``) is kept by the conversion
and refused by the anatomy (it normalises over all hidden channels, so removing one changes the others).

Refused, one line naming it: a ``GluMlp`` with 1x1 convolutions (``use_conv=True``; not a ViT's MLP).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from edgeprune._compat import import_timm
from edgeprune.anatomy import UnsupportedModelError
from edgeprune.zoo.converters import CONVERTERS, Converter


def _glu_class() -> type:
    import_timm()
    from timm.layers import GluMlp

    return GluMlp


def _mlps(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(index, block)`` of every block of ``model`` whose ``mlp`` is a timm ``GluMlp``."""
    cls = _glu_class()
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Module):
        return []
    return [(i, blk) for i, blk in enumerate(blocks) if isinstance(getattr(blk, "mlp", None), cls)]


def has_packed_glu(model: nn.Module) -> bool:
    """True when a block of ``model`` (a ViT with ``.blocks``) has a packed timm ``GluMlp``."""
    return bool(_mlps(model))


def _half(lin: nn.Linear, rows: slice) -> nn.Linear:
    """A new Linear(D, H) holding rows ``rows`` of ``lin`` (weight (2H, D) -> (H, D), bias (2H,) -> (H,))."""
    w = lin.weight.detach()[rows]
    out = nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if lin.bias is not None:
            out.bias.copy_(lin.bias.detach()[rows])
    for new, old in ((out.weight, lin.weight), (out.bias, lin.bias)):
        if old is not None:
            new.requires_grad_(old.requires_grad)
    return out


def split_glu(mlp: nn.Module, where: str = "mlp") -> nn.Module:
    """The timm ``SwiGLU`` computing exactly what the ``GluMlp`` ``mlp`` computes (module doc).

    Args:
        mlp: a timm ``GluMlp`` with a packed ``fc1`` Linear(D, 2H) and ``fc2`` Linear(H, D_out).
        where: the block, for messages.

    Returns:
        a ``SwiGLU`` with ``fc1_g`` / ``fc1_x`` Linear(D, H) (the gate / up halves of ``fc1``, per
        ``gate_last``) and ``mlp``'s own ``act``, ``drop1``, ``norm``, ``fc2``, ``drop2`` modules.

    Raises:
        UnsupportedModelError: a convolutional ``GluMlp`` or a packed width that is not even.
    """
    from timm.layers import SwiGLU
    fc1 = mlp.fc1
    if not isinstance(fc1, nn.Linear) or not isinstance(mlp.fc2, nn.Linear):
        raise UnsupportedModelError(f"{where}: a GluMlp with 1x1 convolutions (use_conv), not Linears")
    two_h = fc1.out_features
    if two_h % 2:
        raise UnsupportedModelError(f"{where}: a GluMlp whose packed fc1 has an odd width {two_h}")
    h = two_h // 2
    first, second = slice(0, h), slice(h, two_h)
    gate, up = (second, first) if bool(getattr(mlp, "gate_last", True)) else (first, second)
    with torch.device("meta"):  # the shell only: every weight is replaced below
        new = SwiGLU(fc1.in_features, h, mlp.fc2.out_features, bias=(fc1.bias is not None, mlp.fc2.bias is not None))
    new.fc1_g, new.fc1_x = _half(fc1, gate), _half(fc1, up)
    new.act, new.drop1, new.norm, new.fc2, new.drop2 = mlp.act, mlp.drop1, mlp.norm, mlp.fc2, mlp.drop2
    return new.train(mlp.training)


def _own_children(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own child registry (replacing a child there leaves
    ``module`` as it was); parameters, buffers and the other children are shared."""
    new = copy.copy(module)
    new._modules = dict(module._modules)
    return new


def convert_glu(model: nn.Module) -> nn.Module:
    """``model`` with every block's ``GluMlp`` replaced by its :func:`split_glu` ``SwiGLU``.

    ``model`` is left as it was: the result is a shallow copy along the path model -> blocks -> block that
    shares every other module (and ``fc2``, the activations and norms of the MLPs) with it; only the split
    ``fc1_g`` / ``fc1_x`` are new tensors (no second copy of a large model). Callers that change weights in
    place copy the result first (``edgeprune.prune`` does, unless ``inplace``).

    Args:
        model: a ViT (``.blocks``) with packed gated MLPs.

    Returns:
        the converted model (``model`` itself when it has no ``GluMlp``).

    Raises:
        UnsupportedModelError: a ``GluMlp`` :func:`split_glu` cannot convert (named).
    """
    targets = _mlps(model)
    if not targets:
        return model
    new, blocks = _own_children(model), _own_children(model.blocks)
    new._modules["blocks"] = blocks
    keys = list(blocks._modules)
    for i, blk in targets:
        own = _own_children(blk)
        own._modules["mlp"] = split_glu(blk.mlp, f"{type(model).__name__} block {i}")
        blocks._modules[keys[i]] = own
    return new


CONVERTERS.register("glu", Converter(applies=has_packed_glu, convert=convert_glu,
                                     what="timm GluMlp (packed fc1) -> SwiGLU (fc1_g, fc1_x)"),
                    replace=True)
