"""The in-model cost of a block as a surface over its two sub-blocks' times (issue 52 item 2: the composition term).

A latency table times each sub-block alone (``mlp.ms`` at a width, ``attn.ms`` at heads / head dims) and blocks of
a few dims in sequence, inside a chain as long as the model (:mod:`edgeprune.latency.selfcheck`). A block inside a
model does not cost its sub-blocks' sum (each sub-block timed alone pays a call; on a 2-core CPU the in-model block
cost about half the sum). Tables before this term mapped the *sum* ``M + A`` through the chains of uniformly cut
blocks (``block_points``: dense, half, quarter), so a block cut in another mix -- a full MLP beside two narrow
heads, or the reverse -- was priced as if the MLP and the attention shared one in-model factor. They do not: on
the 2-core box the self-check's allocations that mix their cuts were measured 6-8% slower than that prediction at
x0.5 and x0.3, always in the same direction (docs/latency_budget.md).

The surface prices the two sub-blocks apart. Its knots are the grid times of the MLP at three widths
(``M_q < M_h < M_d``: a quarter, half and all of the dense width) and of the attention at three cuts
(``A_q < A_h < A_d``), and its values the per-block costs measured inside a model for all nine pairs (the dense,
half and quarter chains on the diagonal, six mixed chains off it: ``chain_mlp_<level>_attn_<level>``). A block of
sub-block times (M, A) costs the bilinear interpolation of the cell around (M, A) (extended by the edge cells
beyond the knots), and never less than :data:`FLOOR_SHARE` of the smallest knot's cost scaled by ``(M + A)``.

It reproduces every chain it was fitted on exactly, so the table's dense, half and quarter points add up as before;
what it adds is that an MLP-heavy and an attention-heavy block are priced by what such blocks cost in a model.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

#: below the smallest knot, a block costs at least this share of the smallest knot's cost scaled by its sub-block sum
FLOOR_SHARE = 0.1

#: the levels of the surface's knots: a quarter, half and all of the dense dims (smallest first)
LEVELS = (("quarter", 0.25), ("half", 0.5), ("dense", 1.0))


def chain_kind(mlp_level: str, attn_level: str) -> str:
    """The table entry of the chain of blocks with the MLP at ``mlp_level`` and the attention at ``attn_level``:
    ``chain`` (both dense), ``chain_half`` / ``chain_quarter`` (both at that level), else
    ``chain_mlp_<mlp_level>_attn_<attn_level>``."""
    if mlp_level == attn_level:
        return "chain" if mlp_level == "dense" else f"chain_{mlp_level}"
    return f"chain_mlp_{mlp_level}_attn_{attn_level}"


#: the mixed chains (off the surface's diagonal), ``{kind: (MLP fraction, attention fraction)}``
MIXED = {chain_kind(m, a): (fm, fa) for m, fm in LEVELS for a, fa in LEVELS if m != a}


#: the uniformly cut whole models a table times beside the dense one (``meta.parts.<kind>_ms``), ``{kind: (fraction of
#: the dense dims, the chain entry of the same blocks)}``: with the dense model they give the call each uniform chain
#: paid timed alone (:func:`level_calls`)
LEVEL_MODELS = {"model_half": (0.5, "chain_half"), "model_quarter": (0.25, "chain_quarter")}


def level_calls(parts: dict[str, Any], dense_model_ms: float | None) -> list[list[float]] | None:
    """The call each uniform chain paid timed alone, measured against the whole model of the same blocks (issue 52:
    the composition term): ``[[chain ms, call ms], ...]`` ascending in the chain's time, the call ``outside +
    chain - model`` (a model costs the model without its blocks plus its chain, less the one call the chain paid
    apart), at the dense, half and quarter dims; None where a table did not time the uniform models (a table built
    before them: :func:`chain_call` falls back to ``block - per_block``).

    A constant call (``block - per_block_ms``, the tables before) was measured off one dense block and subtracted
    from every chain: on the 2-core EPYC and Xeon boxes one dense block alone cost 2.5x a block inside a chain of 12
    and the call came off small chains whole, pricing small blocks 6-8% low at x0.3 on an idle box
    (docs/latency_budget.md). Measured per level, a small chain pays its own call.
    """
    chains = {"chain": dense_model_ms, **{chain: parts.get(f"{kind}_ms") for kind, (_f, chain) in LEVEL_MODELS.items()}}
    outside = parts.get("outside_ms")
    if outside is None or any(v is None for v in chains.values()) or any(parts.get(f"{c}_ms") is None for c in chains):
        return None
    points = sorted([float(parts[f"{c}_ms"]), float(outside) + float(parts[f"{c}_ms"]) - float(model)]
                    for c, model in chains.items())
    return [p for i, p in enumerate(points) if i == 0 or p[0] > points[i - 1][0]]  # equal chains (tiny grids): once


def chain_call(parts: dict[str, Any], chain_ms: float) -> float:
    """The call (ms) a chain timed alone in ``chain_ms`` paid, to subtract before its blocks are priced inside a
    model: linear in the chain's time through ``parts["calls"]`` (:func:`level_calls`), constant beyond the
    smallest and the largest chain; for a table without them the constant ``block_ms - per_block_ms``."""
    calls = parts.get("calls")
    if not calls:
        return float(parts["block_ms"]) - float(parts["per_block_ms"])
    xs = [p[0] for p in calls]
    if chain_ms <= xs[0] or len(calls) == 1:
        return float(calls[0][1])
    if chain_ms >= xs[-1]:
        return float(calls[-1][1])
    i, w = _segment(xs, chain_ms)
    return float(calls[i][1] + w * (calls[i + 1][1] - calls[i][1]))


def through(points: Sequence[Sequence[float]], x: float) -> float:
    """``y(x)`` piecewise-linear through ``points`` (``[[x, y], ...]`` ascending in x, at least 2), extended by the
    first and the last segment; below the first point never under ``FLOOR_SHARE x y_first x / x_first`` (a steep
    first segment -- chains timed under a load that moved -- would otherwise price small blocks at 0 or less: a
    self-check model of a tiny table was predicted at -1.4 ms, and the table then refused to load)."""
    i = min(max(bisect.bisect_left([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    y = float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    first_x, first_y = points[0]
    return max(y, FLOOR_SHARE * first_y * x / first_x) if x < first_x and first_x > 0 else y


def _segment(xs: Sequence[float], x: float) -> tuple[int, float]:
    """``(i, w)``: ``x`` lies at ``xs[i] + w (xs[i+1] - xs[i])`` (``w`` outside [0, 1] beyond the ends: the edge
    segment extended)."""
    i = min(max(bisect.bisect_left(list(xs), x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


def cost_at(surface: dict[str, Any], mlp_ms: float, attn_ms: float) -> float:
    """A block's in-model cost (ms) at sub-block times ``mlp_ms`` and ``attn_ms`` (ms): bilinear in the cell of
    ``surface`` (``{"mlp_ms": [knots], "attn_ms": [knots], "ms": [[per-block ms, attention knots across] per MLP
    knot]}``, knots strictly increasing, at least 2 each) around them, the edge cells extended; at least
    ``FLOOR_SHARE x ms[0][0] x (M + A) / (M_0 + A_0)``."""
    xs, ys, z = surface["mlp_ms"], surface["attn_ms"], surface["ms"]
    i, u = _segment(xs, mlp_ms)
    j, v = _segment(ys, attn_ms)
    y = ((1 - u) * (1 - v) * z[i][j] + u * (1 - v) * z[i + 1][j] + (1 - u) * v * z[i][j + 1]
         + u * v * z[i + 1][j + 1])
    floor = FLOOR_SHARE * z[0][0] * (mlp_ms + attn_ms) / (xs[0] + ys[0])
    return float(max(y, floor))


def fit(mlp_knots: Sequence[float], attn_knots: Sequence[float],
        per_block: dict[tuple[int, int], float]) -> tuple[dict[str, Any] | None, str | None]:
    """The surface through measured per-block costs: ``mlp_knots`` / ``attn_knots`` the sub-block times (ms) at
    :data:`LEVELS` (smallest first), ``per_block[(i, j)]`` the in-model cost (ms) of the block with the MLP at
    level i and the attention at level j. Levels whose knot does not grow (a model too small to cut to a quarter
    and a half apart) are left out, the smaller one first.

    Returns:
        ``(surface, None)``, or ``(None, why)`` when fewer than 2 levels remain on an axis or a cost is not
        positive (chains timed under a load that moved: the table then keeps ``block_points``).
    """
    keep_m = growing(mlp_knots)
    keep_a = growing(attn_knots)
    if len(keep_m) < 2 or len(keep_a) < 2:
        return None, "the quarter, half and dense dims give fewer than 2 distinct sub-block times"
    z = [[float(per_block[(i, j)]) for j in keep_a] for i in keep_m]
    if min(min(row) for row in z) <= 0:
        return None, "a chain timed no slower than the call it pays (the load moved between the timings)"
    return {"mlp_ms": [float(mlp_knots[i]) for i in keep_m], "attn_ms": [float(attn_knots[j]) for j in keep_a],
            "ms": z}, None


def growing(knots: Sequence[float]) -> list[int]:
    """The indices of ``knots`` that form a strictly increasing sequence ending at the last one, scanning down."""
    keep = [len(knots) - 1]
    for i in range(len(knots) - 2, -1, -1):
        if knots[i] < knots[keep[0]]:
            keep.insert(0, i)
    return keep


__all__ = ["FLOOR_SHARE", "LEVELS", "MIXED", "chain_kind", "cost_at", "fit", "growing", "through"]
