"""The modules a latency table times whole besides its grid (:mod:`edgeprune.latency.selfcheck`): the model without
its blocks, block chains at the dense, half, quarter and mixed dims (:mod:`edgeprune.latency.surface`), and models
rebuilt at pruned dims.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from edgeprune.latency import surface
from edgeprune.surgery import apply_structure, backbone_vit


def outside_model(anatomy: Any) -> nn.Module:
    """A copy of the model with no blocks: (B, C, H, W) -> the model's output; patch and position embedding, final
    norm and head only (eval mode)."""
    m = copy.deepcopy(anatomy.model).eval()
    backbone_vit(m).blocks = nn.Sequential()
    return m


def chain_length(depth: int) -> int:
    """How many blocks the ``chain`` entries run in sequence: the model's depth, at least 2."""
    return max(2, int(depth))


#: the fractions of the dense dims whose block chains, beside the dense one, fit the in-model block line
#: (``chain_half``, ``chain_quarter``; :func:`finish`)
FIT_FRACTIONS = {"chain_half": 0.5, "chain_quarter": 0.25}


def fraction_dims(t: Any, f: float) -> dict[str, int]:
    """Block dims at about the fraction ``f`` of the dense heads, head dims and MLP width, on the table's rules and
    within its grid (``{"heads", "qk", "v", "mlp"}``)."""
    k, r = t.key, t.rules
    d = _snap(k["head_dim"] * f, r["head_dim_round_to"], max(t.attn["qk"][0], t.attn["v"][0]), k["head_dim"])
    return {"heads": int(max(t.attn["heads"][0], round(k["num_heads"] * f))), "qk": d, "v": d,
            "mlp": _snap(k["mlp_hidden"] * f, r["mlp_round_to"], t.mlp["widths"][0], k["mlp_hidden"])}


def half_dims(t: Any) -> dict[str, int]:
    """The ``chain_half`` entry's block dims: about half the dense heads, head dims and MLP width, on the table's
    rules and within its grid."""
    return fraction_dims(t, 0.5)


def chain_dims(t: Any, kind: str) -> dict[str, int] | None:
    """The block dims of a chain entry: None (dense) for ``chain``, :func:`fraction_dims` of
    :data:`FIT_FRACTIONS` for the uniform ones, and for a mixed one (:data:`edgeprune.latency.surface.MIXED`) the
    attention of one fraction beside the MLP width of the other."""
    if kind == "chain":
        return None
    if kind in surface.MIXED:
        fm, fa = surface.MIXED[kind]
        return {**fraction_dims(t, fa), "mlp": fraction_dims(t, fm)["mlp"]}
    return fraction_dims(t, FIT_FRACTIONS[kind])


def chain_module(t: Any, anatomy: Any, kind: str) -> nn.Module:
    """The module of a chain entry ``kind`` (:data:`edgeprune.latency.schema.CHAIN_KINDS`): :func:`model_blocks` at
    :func:`chain_dims`."""
    return model_blocks(anatomy, chain_dims(t, kind))


def model_blocks(anatomy: Any, dims: dict[str, int] | None = None) -> nn.Module:
    """The blocks of a copy of the model -- dense, or rebuilt with every block at ``dims`` -- as one module in
    sequence, (B, N, D) -> (B, N, D); a one-block model's block twice (the second copy perturbed by a seeded 0.1%:
    distinct weights, which a runtime does not share)."""
    depth = len(anatomy.blocks)
    if dims is None:
        m = copy.deepcopy(anatomy.model)
    else:
        m = pruned_model(anatomy, [dims] * depth)
    blocks = list(backbone_vit(m).blocks)
    if len(blocks) == 1:
        extra = copy.deepcopy(blocks[0])
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in extra.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3 * (float(p.abs().mean()) + 1e-3))
        blocks.append(extra)
    return nn.Sequential(*blocks).eval()


def level_model(t: Any, anatomy: Any, kind: str) -> nn.Module:
    """The whole model of a level entry ``kind`` (:data:`edgeprune.latency.surface.LEVEL_MODELS`): every block at
    :func:`fraction_dims` of its fraction, (B, C, H, W) -> the model's output."""
    f, _chain = surface.LEVEL_MODELS[kind]
    return pruned_model(anatomy, [fraction_dims(t, f)] * len(anatomy.blocks))


def pruned_model(anatomy: Any, blocks: list[dict[str, int]], seed: int = 0) -> nn.Module:
    """A copy of the (dense) model rebuilt with per-block kept dims ``blocks`` (``{"mlp", "heads", "qk", "v"}``;
    :func:`edgeprune.surgery.apply_structure`, seeded random weights in the resized modules), eval mode."""
    torch.manual_seed(seed)
    m = copy.deepcopy(anatomy.model)
    hd = anatomy.blocks[0].head_dim
    apply_structure(m, [{"num_heads": d["heads"], "head_dim": hd, "qk_dim": d["qk"], "v_dim": d["v"],
                         "mlp_hidden": d["mlp"]} for d in blocks])
    return m.eval()


def _snap(x: float, step: int, lo: int, hi: int) -> int:
    """``x`` rounded to a multiple of ``step``, within ``[lo, hi]``."""
    return int(min(hi, max(lo, step * round(x / step))))


__all__ = ["FIT_FRACTIONS", "chain_dims", "chain_length", "chain_module", "fraction_dims", "half_dims", "level_model",
           "model_blocks",
           "outside_model", "pruned_model"]
