"""The parts of a model a latency table times besides the grid, and its self-check (issue 40, item 1).

A table predicts a model as ``fixed_ms + sum over blocks (block_scale x (MLP + attention) +
block_overhead_ms)``. Its parts are timed directly, not by subtraction:

* ``outside``: the model with its blocks removed (patch embedding, position embedding, final norm,
  head; :func:`outside_model`) -- ``fixed_ms``;
* ``block`` and ``chain``: one dense block, and the model's own blocks in sequence (at least 2,
  :func:`chain_length`; the weights of as many blocks as the model has, so the caches see what they
  see in the model), each timed whole (:func:`dense_blocks`): a block inside a model costs
  ``per_block_ms = (chain - block) / (chain_blocks - 1)`` -- what a call costs (a module timed alone
  pays it once; inside the model the blocks do not) cancels in the difference;
* ``chain_half`` and ``chain_quarter``: the blocks of models of about half and a quarter of the dense dims
  (:func:`fraction_dims`), in sequence: a block of those dims inside a model costs ``(chain_x - call) /
  chain_blocks``;
* ``model_half`` and ``model_quarter``: whole models with every block at those dims; with the dense model they give
  the call each chain paid timed alone, ``outside + chain_x - model_x``, linear in the chain's time between them
  (:func:`edgeprune.latency.surface.chain_call`; issue 52: one call measured off one dense block, ``block -
  per_block_ms``, came off small chains whole and priced small blocks low on an idle box -- tables without these
  models keep it);
* the six mixed chains (:data:`edgeprune.latency.surface.MIXED`: the MLP of one of those levels beside the attention
  of another): with the three above, the nine points of the in-model cost surface over the two sub-blocks apart
  (``block_surface``, :mod:`edgeprune.latency.surface`; issue 52: a block cut in a mix of its own -- full MLP,
  narrow heads -- costs what such blocks cost in a model, not what the sum's map of uniform blocks says).

A block inside a model does not cost what its two sub-blocks cost timed apart (each paid a call;
measured on a shared 2-core CPU it was also cheaper in proportion to its size): the three per-block
costs against the sub-blocks' sums give a piecewise-linear map (``block_points``, :func:`finish`).
A line through two points (dense and half, the tables of before: ``block_scale``,
``block_overhead_ms``) extrapolated the half point's error to small blocks: a deit_small table
predicted an x0.3 allocation 10.7% low (issue 40, measured on the 2-core box under load); the
quarter point pins the small end.

Then the self-check (:func:`allocations`, :func:`verdict`): a few allocations spread over the grid
-- the dense model, and about x0.7, x0.5 and x0.3 of it with heads, head dims (Q/K apart from V
where the rules allow) and MLP widths cut in a different mix per block -- are predicted by the table
and timed as whole models of that shape (:func:`pruned_model`: the structural rebuild of run loading,
``edgeprune.surgery.apply_structure``, random weights: only the time matters). A prediction more than
:data:`~edgeprune.latency.schema.ADD_UP_TOLERANCE` from its measurement fails the table, naming the
part that is off.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

from edgeprune.errors import RuntimeFault
from edgeprune.latency import load, shape_change, surface
from edgeprune.latency.chains import (FIT_FRACTIONS, _snap, chain_dims, chain_length, chain_module,  # noqa: F401
                                      fraction_dims, half_dims, model_blocks, outside_model, pruned_model)
from edgeprune.latency.schema import ADD_UP_TOLERANCE, CHAIN_KINDS
from edgeprune.surgery import backbone_vit
from edgeprune.tokens.apply import apply_token_merge
from edgeprune.tokens.merge import split_sizes
from edgeprune.tokens.schedule import plan_merges

#: the fractions of the dense block the self-check's pruned allocations aim at
FRACTIONS = (0.7, 0.5, 0.3)

#: per block, the exponents (heads, head dims, MLP width) of the fraction: the mix of cuts rotates over the blocks
_MIXES = ((1.0, 0.0, 1.0), (0.0, 1.0, 1.0), (0.5, 0.5, 1.0), (0.0, 0.0, 2.0), (1.0, 1.0, 0.0))


def allocations(t: Any) -> list[tuple[str, list[dict[str, int]]]]:
    """``[(name, per-block dims)]``: the dense model, then one allocation per :data:`FRACTIONS` (module doc).

    Each block keeps about the fraction f of its cost, cut in the mix ``_MIXES[i % 5]`` (heads to
    ``H f^a``, head dims to ``d f^b`` -- Q/K a quarter below and V a quarter above where the table's
    rules do not tie them -- MLP width to ``M f^c``), on the rules' multiples and within the grid.
    """
    k, r = t.key, t.rules
    H, d, M = k["num_heads"], k["head_dim"], k["mlp_hidden"]
    lo_h, lo_d, lo_v, lo_m = t.attn["heads"][0], t.attn["qk"][0], t.attn["v"][0], t.mlp["widths"][0]
    out = [("dense", [t.dense_dims() for _ in range(k["depth"])])]
    for f in FRACTIONS:
        blocks = []
        for i in range(k["depth"]):
            a, b, c = _MIXES[i % len(_MIXES)]
            dims = d * f ** b
            qk_scale, v_scale = (1.0, 1.0) if r["qk_equals_v"] or b == 0 else (0.75, 1.25)
            qk = _snap(dims * qk_scale, r["head_dim_round_to"], lo_d, d)
            v = qk if r["qk_equals_v"] else _snap(dims * v_scale, r["head_dim_round_to"], lo_v, d)
            blocks.append({"heads": int(min(H, max(lo_h, round(H * f ** a)))), "qk": qk, "v": v,
                           "mlp": _snap(M * f ** c, r["mlp_round_to"], lo_m, M)})
        out.append((f"x{f:.1f}", blocks))
    return out


def _span(blocks: list[dict[str, int]]) -> str:
    """``heads 2-6, qk 16-64, v 32-64, mlp 384-1536``: the range of each kept dim over the blocks."""
    parts = []
    for name in ("heads", "qk", "v", "mlp"):
        lo, hi = min(b[name] for b in blocks), max(b[name] for b in blocks)
        parts.append(f"{name} {lo}" if lo == hi else f"{name} {lo}-{hi}")
    return ", ".join(parts)


def merged_check(t: Any, anatomy: Any) -> tuple[str, list[dict[str, int]], list[int], list[list[int]]] | None:
    """The self-check's merged model on a table whose token axis timed the merge step (issue 44): ``(name, dense
    dims per block, r per block, [[tokens the attention sees, tokens the MLP sees], ...])`` of the dense widths
    merging a constant r per block, the largest r whose last MLP still sees at least the axis's smallest count;
    None without such an axis (or a model too short of tokens to merge one per block)."""
    if not t.tokens or "merge" not in t.tokens:
        return None
    depth, n = int(t.key["depth"]), int(t.key["tokens"])
    prefix = int(getattr(backbone_vit(anatomy.model), "num_prefix_tokens", 0))
    r = min((n - int(t.tokens["counts"][0])) // depth, split_sizes(n, prefix)[1])
    if r < 1:
        return None
    rs, counts = plan_merges(r, depth, n, prefix)
    pairs = [[int(c), int(c - q)] for c, q in zip(counts, rs)]
    return f"merged r={r}", [t.dense_dims() for _ in range(depth)], rs, pairs


def run_check(t: Any, anatomy: Any, measure: Callable[[nn.Module], float]) -> dict[str, Any]:
    """Predict and time every :func:`allocations` model (the dense one is ``t.dense_model_ms``, already timed) and
    the :func:`merged_check` model where there is one; ``measure(model) -> ms``. Returns the table's
    ``meta["self_check"]`` (:func:`verdict`).

    Issue 52 (a busy machine): a model that misses the tolerance is timed once more and keeps its faster time (a
    load only slows a run down: ``attempts`` 2), and the dense model is timed again after the others: how far it
    moved from its timing in the build (``load.dense_drift``) and the machine's load figures (``load.end``, beside
    ``t.meta["load"]["start"]`` where the build recorded it) let :func:`verdict` name the load, not the table, when
    it moved the timings."""
    tolerance = ADD_UP_TOLERANCE
    models = []

    def timed(model: nn.Module, pred: float) -> tuple[float, int]:
        ms = float(measure(model))
        if abs(pred / ms - 1.0) <= tolerance:
            return ms, 1
        return min(ms, float(measure(model))), 2  # re-timed on a miss: the faster of the two

    for name, blocks in allocations(t):
        pred = t.model_ms(blocks)
        ms, attempts = (float(t.dense_model_ms), 1) if name == "dense" else timed(pruned_model(anatomy, blocks), pred)
        models.append({"name": name, "predicted_ms": pred, "measured_ms": ms, "error": pred / ms - 1.0,
                       "blocks": blocks, "attempts": attempts})
    merged = merged_check(t, anatomy)
    if merged is not None:
        name, blocks, rs, pairs = merged
        model = pruned_model(anatomy, blocks)
        apply_token_merge(model, rs)
        pred = t.model_ms(blocks, pairs)
        ms, attempts = timed(model, pred)
        models.append({"name": name, "predicted_ms": pred, "measured_ms": ms, "error": pred / ms - 1.0,
                       "blocks": blocks, "tokens": pairs, "attempts": attempts})
    dense_again = float(measure(anatomy.model))
    clock = t.meta.get("settings", {}).get("clock") or load.CLOCK
    load_info = {"start": (t.meta.get("load") or {}).get("start"), "end": load.snapshot(clock),
                 "dense_ms_again": dense_again, "dense_drift": load.drift(t.dense_model_ms, dense_again)}
    return verdict(t, models, tolerance, load_info)


def load_cause(load_info: dict[str, Any] | None, tolerance: float) -> str | None:
    """The words for "the machine's load moved the timings" when the self-check's load figures show it, else None:
    the dense model timed again at the self-check moved by more than half the tolerance from its timing in the
    build, or the machine counted as loaded (:func:`edgeprune.latency.load.loaded`) at the build's start or end."""
    if not load_info:
        return None
    drift = load_info.get("dense_drift")
    busiest = load.busiest([load_info.get("start"), load_info.get("end")]) or {}
    figures = (f"load average {busiest['load_1m']:.1f} on {busiest['cores']} cores"
               if busiest.get("load_1m") is not None else "no load average on this platform")
    if drift is not None and abs(drift) > tolerance / 2:
        return f"the machine's load changed the timings by {100 * drift:+.1f}% during the build ({figures})"
    why = load.loaded(busiest) if busiest else None
    if why:
        return f"the machine was loaded during the build ({why})"
    return None


def verdict(t: Any, models: list[dict[str, Any]], tolerance: float = ADD_UP_TOLERANCE,
            load_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"passed", "tolerance", "failure", "cause", "models", "load"}``: failed when a model's ``error``
    (predicted / measured - 1) exceeds ``tolerance``; ``failure`` names the worst model and the part that is off
    (the dense model: the parts outside / per block do not add up to the whole; a pruned one: the grid's entries at
    its dims) and, first, the machine's load when ``load_info`` (:func:`run_check`) shows it moved the timings
    (:func:`load_cause`; ``cause`` "load", else "table"; None when it passed)."""
    bad = [m for m in models if abs(m["error"]) > tolerance]
    failure = None
    cause = None
    if bad:
        m = max(bad, key=lambda m: abs(m["error"]))
        say = (f"predicted {m['predicted_ms']:.4g} ms, measured {m['measured_ms']:.4g} ms whole "
               f"({100 * m['error']:+.1f}%, more than {100 * tolerance:.0f}%)")
        if "tokens" in m:
            failure = (f"the token axis (tokens.mlp / tokens.attn / tokens.merge) is off for the {m['name']} model "
                       f"(tokens per block {m['tokens'][0][0]} -> {m['tokens'][-1][1]}): {say}")
        elif m["name"] == "dense":
            block = t.block_total(t.dense_dims())
            failure = (f"the parts do not add up to the dense model: outside the blocks {t.fixed_ms:.4g} ms + "
                       f"{t.key['depth']} x block {block:.4g} ms {say}")
        else:
            failure = (f"the sub-block entries (mlp.ms / attn.ms) are off at the pruned dims of allocation "
                       f"{m['name']} ({_span(m['blocks'])}): {say}")
        by_load = load_cause(load_info, tolerance)
        cause = "load" if by_load else "table"
        if by_load:
            failure = f"{by_load}, so the check cannot tell a table error from the load; what it saw: {failure}"
    out = {"passed": not bad, "tolerance": tolerance, "failure": failure, "cause": cause, "models": models}
    if load_info is not None:
        out["load"] = load_info
    return out


class SelfCheckFailed(RuntimeFault):
    """The table's prediction of whole models missed their measurement (exit 1; ``--force`` keeps the table)."""


def _retime(t: Any, problem: str) -> RuntimeFault:
    """Mark the block entries unmeasured (a rerun or :func:`~edgeprune.latency.build` times them again) and say
    why."""
    for kind in ("block", *CHAIN_KINDS):
        t.measured[kind] = False
    return RuntimeFault(f"latency table: {problem}: the machine's load changed too much between them (rerun the "
                        "command: it times them again)")


def finish(t: Any, keep_disordered: bool = False) -> Any:
    """Fill ``fixed_ms`` (the model without its blocks, timed) and the in-model block cost ``block_points``
    (module doc): the per-block costs inside a model against the two sub-blocks' sum at the dense dims and the
    :data:`FIT_FRACTIONS` chains (the points of distinct dims), through which ``LatencyTable.block_total`` is
    piecewise-linear; ``block_scale`` / ``block_overhead_ms`` keep the line through the dense and half point.
    ``meta["fixed_by_subtraction_ms"]`` keeps what the subtraction of earlier tables gave (dense model - depth x
    sub-blocks), for comparison. Not yet complete (the self-check decides).

    ``keep_disordered`` (``--force`` after the last re-timing): chains that still disagree are left out instead
    of refused -- the in-model cost falls back to the sub-blocks' sum where the dense chain itself is off -- and
    ``parts["left_out"]`` says which; the self-check then judges the table (and ``--force`` keeps it unverified).

    Raises:
        RuntimeFault: the dense and half chains disagree (the half block timed slower): the load moved (not with
            ``keep_disordered``).
    """
    k, parts = t.key, t.meta["parts"]
    n = chain_length(k["depth"])
    sub = t.block_ms(t.dense_dims())
    per_block = (float(parts["chain_ms"]) - float(parts["block_ms"])) / (n - 1)
    call = float(parts["block_ms"]) - per_block
    left_out = []
    parts.pop("calls", None)
    if keep_disordered and per_block <= 0:  # the dense chain itself is off: the sub-blocks' sum, no call term
        left_out.append(f"chain ({n} blocks {parts['chain_ms']:.4g} ms, one {parts['block_ms']:.4g} ms)")
        per_block, call = sub, float(parts["block_ms"]) - sub
    elif per_block > 0:
        calls = surface.level_calls(parts, t.dense_model_ms)  # issue 52: each chain's own call, off the whole models
        if calls:
            parts["calls"] = calls
            call = surface.chain_call(parts, float(parts["chain_ms"]))
            per_block = (float(parts["chain_ms"]) - call) / n
    parts.update(sub_blocks_ms=sub, chain_blocks=n, per_block_ms=per_block, call_ms=call)
    points, seen = [(sub, per_block)], [t.dense_dims()]
    for kind in FIT_FRACTIONS:  # largest first
        dims = chain_dims(t, kind)
        name = kind.removeprefix("chain_")
        chain_ms = float(parts[f"{kind}_ms"])
        sub_f, per_f = t.block_ms(dims), (chain_ms - surface.chain_call(parts, chain_ms)) / n
        parts.update({f"{name}_dims": dims, f"sub_blocks_{name}_ms": sub_f, f"per_block_{name}_ms": per_f})
        if dims in seen:
            continue
        seen.append(dims)
        if kind == "chain_half" and not (0 < per_f < per_block and sub_f < sub) and keep_disordered:
            left_out.append(f"chain_half ({n} half blocks {parts['chain_half_ms']:.4g} ms)")
            parts.pop("per_block_half_ms")  # not a point of the in-model cost (check_adds_up skips it)
        elif kind == "chain_half" and not (0 < per_f < per_block and sub_f < sub):
            raise _retime(t, f"the model's {n} blocks in sequence timed {parts['chain_ms']:.4g} ms, one alone "
                             f"{parts['block_ms']:.4g} ms, {n} half blocks {parts['chain_half_ms']:.4g} ms")
        if 0 < per_f < points[-1][1] and sub_f < points[-1][0]:
            points.append((sub_f, per_f))  # a smaller point out of order (tiny blocks, noise) is left out
    parts["points_used"] = len(points)
    parts["left_out"] = left_out
    (x1, y1), (x0, y0) = points[0], points[1] if len(points) > 1 else points[0]
    t.block_scale = (y1 - y0) / (x1 - x0) if x1 > x0 else 1.0  # the line through the dense and the half point
    t.block_overhead_ms = y1 - t.block_scale * x1
    t.block_points = [[float(x), float(y)] for x, y in sorted(points)] if len(points) > 1 else None
    t.block_surface = _surface(t, parts, n)
    t.fixed_ms = float(parts["outside_ms"])
    fitted = shape_change.fit(t)  # issue 52: a block that changes shape costs more (after the in-model cost)
    parts.pop("shape_change", None)
    if fitted is not None:
        parts["shape_change"] = fitted
    t.shape_change = None if fitted is None else float(fitted["factor"])
    t.meta["fixed_by_subtraction_ms"] = float(t.dense_model_ms) - k["depth"] * sub
    return t


def _surface(t: Any, parts: dict[str, Any], n: int) -> dict[str, Any] | None:
    """The in-model cost surface (:func:`edgeprune.latency.surface.fit`) of the nine chains, a block of them
    costing ``(chain - call) / n`` (the call :func:`edgeprune.latency.surface.chain_call`); None
    (``parts["surface"]`` says why) where a chain is not measured (a table
    built before the surface) or the fit refuses."""
    levels = [(name, fraction_dims(t, f)) for name, f in surface.LEVELS]
    chains = {(i, j): parts.get(f"{surface.chain_kind(a, b)}_ms") for i, (a, _) in enumerate(levels)
              for j, (b, _) in enumerate(levels)}
    if parts.get("left_out") or None in chains.values():
        parts["surface"] = "not fitted: " + ("chains left out (--force)" if parts.get("left_out") else
                                             "the mixed chains were not timed")
        return None
    fitted, why = surface.fit([t.mlp_ms(d["mlp"]) for _, d in levels],
                              [t.attn_ms(d["heads"], d["qk"], d["v"]) for _, d in levels],
                              {ij: (float(ms) - surface.chain_call(parts, float(ms))) / n for ij, ms in chains.items()})
    parts["surface"] = "fitted" if fitted else f"not fitted: {why}"
    return fitted


def conclude(t: Any, check: dict, force: bool, out: Path) -> Any:
    """Record the self-check ``check`` (:func:`~edgeprune.latency.selfcheck.verdict`) and mark the table complete
    when it passed or ``force`` keeps it (then ``forced``: unverified); save it.

    Raises:
        SelfCheckFailed: it missed and not ``force`` (the table is saved incomplete: a rerun times the check
            again).
    """
    check["forced"] = bool(force and not check["passed"])
    t.meta["self_check"] = check
    t.meta["complete"] = bool(check["passed"] or force)
    if t.meta["complete"]:
        t.meta["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t.save(out)
    if not t.meta["complete"]:
        rerun = "when the machine is quieter" if check.get("cause") == "load" else "to time the check again"
        raise SelfCheckFailed(f"latency table self-check failed: {check['failure']} ({out} is left incomplete: "
                              f"rerun the command {rerun}, or add --force to keep it unverified)")
    return t


__all__ = ["CHAIN_KINDS", "SelfCheckFailed", "conclude", "finish", "FRACTIONS", "FIT_FRACTIONS", "allocations",
           "chain_dims", "chain_length", "fraction_dims", "half_dims", "model_blocks", "outside_model", "pruned_model",
           "run_check", "verdict"]
