"""The closed-form error curve of one allocation unit, computed once per statistics object (issue 40: the
candidate allocations, the measured rescaling and the latency correction's rounds all read the same curves).
The formulas are :mod:`edgeprune.allocation.curves`'; the grid is :mod:`edgeprune.allocation.rules`'.
"""

from __future__ import annotations

import dataclasses
import time

from edgeprune.allocation.curves import Curve, heads_curve, mlp_curve, qk_curve, v_curve
from edgeprune.allocation.rules import Grid
from edgeprune.errors import UserError


#: ``stats.derived`` key of the seconds spent computing curves (the record's cost split)
CURVE_SECONDS = "allocation.curve_seconds"


def raw_curve(b, unit: str, stats, cfg, grid: Grid) -> Curve:
    """A fresh copy of unit ``unit``'s curve of block ``b`` before normalisation, computed once per statistics
    object, unit, grid and CORP settings (``stats.derived``): the candidate allocations, the measured rescaling and
    the latency correction's rounds all ask for the same curves (issue 40: the allocation's repeated work)."""
    settings = dataclasses.replace(cfg, budget=None, dims=None, allocation_check_images=0)
    key = ("allocation.curve", b.index, unit, repr(grid.describe()), repr(settings))
    cache = stats.derived
    if key not in cache:
        t0 = time.perf_counter()
        cache[key] = compute_curve(b, unit, stats, cfg, grid)
        cache[CURVE_SECONDS] = cache.get(CURVE_SECONDS, 0.0) + time.perf_counter() - t0
    c = cache[key]
    return dataclasses.replace(c, ks=list(c.ks), raw=list(c.raw))


def compute_curve(b, unit: str, stats, cfg, grid: Grid) -> Curve:
    """Unit ``unit``'s closed-form error curve of block ``b`` (``edgeprune.allocation.curves``)."""
    if unit == "mlp":
        st = stats.mlp[b.index] if stats.mlp else None
        if st is None:
            raise UserError("budgeted allocation of the MLP needs its calibration statistics")
        r = grid.round_to["mlp"]
        mlp_cfg = cfg if r == cfg.round_to else dataclasses.replace(cfg, round_to=r)
        return mlp_curve(b, st, mlp_cfg)
    if unit == "qk":
        return qk_curve(b, _need(stats.qk, b, "Q/K"), cfg, grid.sizes("qk", b.qk_dim))
    if unit == "v":
        return v_curve(b, _need(stats.vo, b, "V/O"), cfg, grid.sizes("v", b.v_dim))
    if unit == "heads":
        return heads_curve(b, _need(stats.vo, b, "V/O"), cfg)
    r = grid.round_to["qk"]  # fused: Q/K and V to the same kept dim
    ks = [k for k in grid.sizes("qk", min(b.qk_dim, b.v_dim)) if k % r == 0 or k == b.qk_dim == b.v_dim]
    ks = [k for k in ks if k >= grid.lower.get("v", 0)] or ks
    if unit == "qk+v:qk":
        return qk_curve(b, _need(stats.qk, b, "Q/K"), cfg, ks)
    return v_curve(b, _need(stats.vo, b, "V/O"), cfg, ks)


def _need(lst, b, what):
    st = lst[b.index] if lst else None
    if st is None:
        raise UserError(f"budgeted allocation of {what} needs its calibration statistics")
    return st
