"""The cost of changing block shapes along a model (issue 52: the idle-box self-check).

A pruned model's blocks keep different dims, block by block. On ONNX Runtime's CPU provider a block whose shape
differs from the block before it costs more than the same block among blocks of its own shape: measured on the
project's 2-core Xeon box (deit_small, batch 8, interleaved in one process, docs/latency_budget.md), the twelve
blocks of the table's x0.5 self-check allocation ran 8.5% slower in their allocated order (five shapes in turn)
than the same twelve blocks sorted by shape (1 thread; 7.5% on 2 threads), and the sorted model cost what the
uniform models of its shapes add up to (-1%). Eager PyTorch showed no such cost (0.997). The chains a table times
are uniform, so every table before this term priced a mixed allocation 5-8% low on an idle box.

A table therefore times two whole models whose blocks change shape at every block (:data:`MODELS`: per-block dims
drawn from the grid with a fixed seed, none equal to its neighbour; :func:`blocks_of`) and fits one factor
(:func:`fit`): a block whose dims differ from the previous block's costs ``1 + factor`` times its in-model cost
(:func:`extra_ms`; the first block never pays it). The self-check's allocations, which the fit does not see, test
it. A table built before it has no factor and prices as before.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

#: the whole models a table times to measure the cost, ``{kind: seed}``
MODELS = {"model_mixed_a": 1, "model_mixed_b": 2}

#: the dims that make a block's shape
_KEYS = ("heads", "qk", "v", "mlp")


def changed(blocks: Sequence[dict[str, int]]) -> list[bool]:
    """Per block, whether its dims (heads, qk, v, mlp) differ from the previous block's (the first block: False)."""
    shape = [tuple(int(b[k]) for k in _KEYS) for b in blocks]
    return [i > 0 and shape[i] != shape[i - 1] for i in range(len(shape))]


def blocks_of(t: Any, kind: str) -> list[dict[str, int]]:
    """The per-block dims of the shape-change model ``kind`` (:data:`MODELS`) of table ``t``: each block's heads,
    Q/K dim, V dim and MLP width drawn (seeded) from the table's grid at or above its quarter-dims level (V = Q/K
    on a ``qk_equals_v`` table), redrawn while equal to the previous block's; ``depth`` blocks.

    Raises:
        KeyError: ``kind`` is not one of :data:`MODELS`.
    """
    from_grid = random.Random(MODELS[kind])
    k, r = t.key, t.rules
    floor = {"heads": k["num_heads"] / 4, "qk": k["head_dim"] / 4, "v": k["head_dim"] / 4, "mlp": k["mlp_hidden"] / 4}
    axes = {"heads": t.attn["heads"], "qk": t.attn["qk"], "v": t.attn["v"], "mlp": t.mlp["widths"]}
    pools = {name: [int(x) for x in values if x >= floor[name]] or [int(values[-1])] for name, values in axes.items()}
    out: list[dict[str, int]] = []
    for _ in range(int(k["depth"])):
        for _try in range(20):
            d = {name: from_grid.choice(pools[name]) for name in _KEYS}
            if r.get("qk_equals_v"):
                d["v"] = d["qk"]
            if not out or d != out[-1]:
                break
        out.append(d)
    return out


def extra_ms(t: Any, blocks: Sequence[dict[str, int]], tokens: Sequence[Sequence[int]] | None = None) -> float:
    """The ms a model of per-block ``blocks`` pays for changing shape: ``t.shape_change x`` the in-model cost
    (``t.block_total``, at the block's token counts where ``tokens`` gives them) of every block whose dims differ
    from the previous block's; 0 for a table without the factor."""
    factor = getattr(t, "shape_change", None)
    if not factor:
        return 0.0
    cost = (t.block_total(d) if tokens is None else t.block_total(d, int(tokens[i][0]), int(tokens[i][1]))
            for i, d in enumerate(blocks))
    return float(factor) * sum(c for c, moved in zip(cost, changed(blocks)) if moved)


def fit(t: Any) -> dict[str, Any] | None:
    """The factor from the table's shape-change models (``t.meta["parts"]["<kind>_ms"]``, timed whole): per model
    ``(measured - predicted without it) / the changed blocks' in-model cost``, their mean the factor. Call after
    the in-model cost (``block_surface`` / ``block_points``) is fitted.

    Returns:
        ``{"factor": f, "models": [{"kind", "blocks", "measured_ms", "additive_ms", "changed_ms", "factor"}]}``
        (``meta.parts.shape_change``), or None where the models were not timed (a table built before them, or a
        one-block model) or their mean factor is -1 or less (models timed far faster than their parts: the load
        moved; no term rather than a negative block cost).
    """
    parts = t.meta.get("parts") or {}
    models = []
    for kind in MODELS:
        ms = parts.get(f"{kind}_ms")
        if ms is None or int(t.key["depth"]) < 2:
            return None
        blocks = blocks_of(t, kind)
        additive = float(t.fixed_ms) + sum(t.block_total(d) for d in blocks)
        moved = sum(t.block_total(d) for d, c in zip(blocks, changed(blocks)) if c)
        if moved <= 0:
            return None
        models.append({"kind": kind, "blocks": blocks, "measured_ms": float(ms), "additive_ms": additive,
                       "changed_ms": moved, "factor": (float(ms) - additive) / moved})
    factor = sum(m["factor"] for m in models) / len(models)
    if factor <= -1:  # models timed far faster than their parts: the load moved; no term rather than a negative cost
        return None
    return {"factor": factor, "models": models}


__all__ = ["MODELS", "blocks_of", "changed", "extra_ms", "fit"]
