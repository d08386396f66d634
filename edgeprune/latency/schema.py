"""The schema of a latency table file (issue 41): a table is user input (built on another machine,
copied, possibly edited), checked once where it is loaded (:meth:`LatencyTable.from_dict`).

Every field a reader uses: the key (model dims, batch and threads positive integers; precision,
backend, device strings), the profile's rules (``mlp_round_to`` and ``head_dim_round_to`` positive
integers, ``qk_equals_v`` a bool), the grids (non-empty, strictly increasing integers, the last
point the dense dim of the key), the times (positive and finite, or null where not measured;
``fixed_ms`` may be 0, it is clamped), their shapes (one per grid point), every measured entry
having its time, a complete table having every time a prediction can read, and the bookkeeping of
a build in progress (``measured``, ``meta.settings``, ``meta.relative``). A damaged table is
refused in one line naming the file and the field, before any work (prune checks the table
before its calibration pass; ``derive --latency`` too), so no ``ZeroDivisionError`` or
``range() arg 3 must not be zero`` later.

Issue 40: a complete table must add up -- ``fixed_ms + depth x (MLP + attention at the dense dims +
block_overhead_ms)`` within :data:`ADD_UP_TOLERANCE` of ``dense_model_ms`` -- and a self-check it
records must agree with its own numbers (:func:`check_adds_up`); a table whose self-check was kept
with ``--force`` (``meta.self_check.forced``) is loaded and said to be unverified instead. Tables
without the issue-40 fields (``block_overhead_ms``, ``meta.parts``, ``meta.self_check``) load as
before when they add up (``block_overhead_ms`` = 0).
"""

from __future__ import annotations

from typing import Any

from edgeprune.errors import UserError
from edgeprune.latency import shape_change, surface
from edgeprune.latency.surface import LEVEL_MODELS, MIXED
from edgeprune.schema import Bool, Int, ListOf, MapOf, Num, Obj, Req, SchemaError, Str, check

__all__ = ["ADD_UP_TOLERANCE", "CHAIN_KINDS", "WHOLE_KINDS", "TABLE_SCHEMA", "check_adds_up", "check_table",
           "DAMAGED_HINT"]

#: how far (relative) a table's parts may be from the whole dense model, and a self-check's
#: prediction from its measurement
ADD_UP_TOLERANCE = 0.05

#: what to do about a damaged table (the message's parentheses)
DAMAGED_HINT = ("a damaged or hand-edited table: rebuild it with edgeprune latency-table --model M --device PROFILE "
                "-o FILE --force")

#: the block chains a table times (:mod:`edgeprune.latency.selfcheck`): the dense one, the uniformly cut ones
#: (half and quarter dims) and the mixed ones of the in-model cost surface (:mod:`edgeprune.latency.surface`)
CHAIN_KINDS = ("chain", "chain_half", "chain_quarter", *MIXED)

#: the entries a table times whole besides its grid: the dense model, the model without blocks, one block, the chains,
#: the uniformly cut whole models (:data:`edgeprune.latency.surface.LEVEL_MODELS`), the models that change shape at
#: every block (:data:`edgeprune.latency.shape_change.MODELS`)
WHOLE_KINDS = ("model", "outside", "block", *CHAIN_KINDS, *LEVEL_MODELS, *shape_change.MODELS)

_POS = Int(min=1)
_MS = Num(gt=0, nullable=True, want="a positive finite time in ms")
_DIMS = ListOf(Int(min=0), min_len=1, increasing=True)

_KEY = Obj({**{k: Req(_POS) for k in ("embed_dim", "depth", "num_heads", "head_dim", "mlp_hidden", "tokens",
                                       "batch")},
            "threads": Req(Int(min=1, nullable=True)),
            **{k: Req(Str(nonempty=True)) for k in ("precision", "backend", "device_name", "profile")},
            "backend_version": Str(nullable=True), "mlp_gated": Bool()})

_RULES = Obj({"mlp_round_to": Req(_POS), "head_dim_round_to": Req(_POS), "qk_equals_v": Req(Bool())})

_SETTINGS = Obj({"warmup": Int(min=0, nullable=True), "iterations": Int(min=1, nullable=True),
                 "repeats": Int(min=1, nullable=True), "spread": Num(gt=0, nullable=True),
                 "retries": Int(min=0, nullable=True),
                 "max_seconds": Num(gt=0, nullable=True), "min_iterations": Int(min=1, nullable=True),
                 "statistic": Str(choices=("p50", "min"), nullable=True), "interleave": Bool(nullable=True),
                 "clock": Str(choices=("wall", "cpu"), nullable=True), "cuda_graphs": Bool(nullable=True),
                 "input": Str(nullable=True)})

_RELATIVE = Obj({"mlp": Req(MapOf(Num(gt=0))), "attn": Req(MapOf(Num(gt=0))), "model": Num(gt=0, nullable=True),
                 "outside": Num(gt=0, nullable=True), "block": Num(gt=0, nullable=True),
                 **{k: Num(gt=0, nullable=True) for k in (*CHAIN_KINDS, *LEVEL_MODELS, *shape_change.MODELS)},
                 "reference_ms": Req(Obj({"mlp": Req(ListOf(Num(gt=0))), "attn": Req(ListOf(Num(gt=0)))}))})

_PARTS = Obj({"outside_ms": Num(gt=0, nullable=True), "block_ms": Num(gt=0, nullable=True),
              "chain_ms": Num(gt=0, nullable=True), "chain_half_ms": Num(gt=0, nullable=True),
              "chain_blocks": Int(min=2), "sub_blocks_ms": Num(gt=0), "sub_blocks_half_ms": Num(gt=0),
              "per_block_ms": Num(gt=0), "per_block_half_ms": Num(gt=0), "half_dims": MapOf(Int(min=1)),
              "chain_quarter_ms": Num(gt=0, nullable=True), "sub_blocks_quarter_ms": Num(gt=0),
              "per_block_quarter_ms": Num(), "quarter_dims": MapOf(Int(min=1)),
              "points_used": Int(min=1), "left_out": ListOf(Str(nonempty=True)),
              **{f"{k}_ms": Num(gt=0, nullable=True) for k in (*MIXED, *LEVEL_MODELS, *shape_change.MODELS)},
              "surface": Str(), "call_ms": Num(), "calls": ListOf(ListOf(Num(), min_len=2, max_len=2), min_len=1),
              "shape_change": Obj({"factor": Req(Num(gt=-1)), "models": ListOf(Obj({}))})})

_CHECKED = Obj({"name": Req(Str(nonempty=True)), "predicted_ms": Req(Num(gt=0)), "measured_ms": Req(Num(gt=0)),
                "error": Num(), "blocks": Req(ListOf(MapOf(Int(min=1)), min_len=1)),
                "tokens": ListOf(ListOf(Int(min=1), min_len=2)), "attempts": Int(min=1)})

#: the machine's load figures (edgeprune.latency.load.snapshot)
_LOAD = Obj({"load_1m": Num(ge=0, nullable=True), "load_5m": Num(ge=0, nullable=True), "cores": Int(min=1),
             "clock": Str()}, nullable=True)

_SELF_CHECK = Obj({"passed": Req(Bool()), "tolerance": Req(Num(gt=0, le=1)), "forced": Bool(),
                   "failure": Str(nullable=True), "models": Req(ListOf(_CHECKED)),
                   "cause": Str(choices=("load", "table"), nullable=True),
                   "load": Obj({"start": _LOAD, "end": _LOAD, "dense_ms_again": Num(gt=0), "dense_drift": Num()})})

_META = Obj({"complete": Bool(), "settings": _SETTINGS, "relative": _RELATIVE, "created": Str(nullable=True),
             "edgeprune": Str(nullable=True), "parts": _PARTS, "self_check": _SELF_CHECK,
             "load": Obj({"start": _LOAD})})

_MEASURED = Obj({"mlp": ListOf(Int(min=0)), "attn": ListOf(ListOf(Int(min=0), min_len=3, max_len=3)),
                 **{k: Bool() for k in WHOLE_KINDS}, "tokens_mlp": ListOf(Int(min=1)),
                 "tokens_attn": ListOf(Int(min=1)), "tokens_merge": ListOf(Int(min=1))})

#: the token axis (``latency-table --tokens``): counts ascending, ending at key.tokens; a time ratio per count
_TOKENS = Obj({"counts": Req(ListOf(Int(min=1), min_len=2, increasing=True)), "mlp": Req(ListOf(_MS)),
               "attn": Req(ListOf(_MS)), "merge": ListOf(_MS)})


def _fail(field: str, problem: str) -> SchemaError:
    return SchemaError(field, problem)


def _consistent(d: dict, field: str) -> None:
    """The cross-field checks: shapes, dense dims at the grids' ends, measured entries' times."""
    key, rules, mlp, attn = d["key"], d["rules"], d["mlp"], d["attn"]
    if len(mlp["ms"]) != len(mlp["widths"]):
        raise _fail("mlp.ms", f"must have one time per width ({len(mlp['widths'])}), has {len(mlp['ms'])}")
    shape = [len(attn["heads"]), len(attn["qk"]), len(attn["v"])]
    ms = attn["ms"]
    if len(ms) != shape[0] or any(len(p) != shape[1] for p in ms) or any(len(r) != shape[2] for p in ms for r in p):
        raise _fail("attn.ms", f"must be a nested list of shape {shape} (heads x qk x v)")
    for name, grid, dense in (("mlp.widths", mlp["widths"], "mlp_hidden"), ("attn.heads", attn["heads"], "num_heads"),
                              ("attn.qk", attn["qk"], "head_dim"), ("attn.v", attn["v"], "head_dim")):
        if grid[-1] != key[dense]:
            raise _fail(name, f"must end at the dense dim key.{dense} = {key[dense]}, ends at {grid[-1]}")
    if rules["qk_equals_v"] and attn["qk"] != attn["v"]:
        raise _fail("attn.v", "must equal attn.qk under rules.qk_equals_v")
    complete = bool(d.get("meta", {}).get("complete", True))
    _times_present(d, complete)
    _token_axis(d, complete)


def _token_axis(d: dict, complete: bool) -> None:
    """The token axis (where present): one ratio per count, the last count the model's, ratio 1 there, every
    measured count's ratio present (every count's, on a complete table)."""
    ax = d.get("tokens")
    if ax is None:
        return
    counts, full = ax["counts"], d["key"]["tokens"]
    if counts[-1] != full:
        raise _fail("tokens.counts", f"must end at the model's key.tokens = {full}, ends at {counts[-1]}")
    for part in ("mlp", "attn", "merge"):
        ratios = ax.get(part)
        if ratios is None:  # "merge": a table built before the merge step was timed
            continue
        if len(ratios) != len(counts):
            raise _fail(f"tokens.{part}", f"must have one ratio per count ({len(counts)}), has {len(ratios)}")
        if part != "merge" and ratios[-1] != 1.0:
            raise _fail(f"tokens.{part}[{len(counts) - 1}]", f"must be 1 (the full count), got {ratios[-1]}")
        measured = d.get("measured", {}).get(f"tokens_{part}", [])
        for i, (n, x) in enumerate(zip(counts, ratios)):
            if x is None and (complete or n in measured):
                raise _fail(f"tokens.{part}[{i}]", "is null in a complete table" if complete else
                            f"is null, but measured.tokens_{part} says it was measured")


def _times_present(d: dict, complete: bool) -> None:
    """Every measured entry (every entry a prediction reads, on a complete table) has its time."""
    mlp, attn, measured = d["mlp"], d["attn"], d.get("measured", {})
    widths = mlp["widths"]
    for w in measured.get("mlp", []):
        if w not in widths:
            raise _fail("measured.mlp", f"names width {w}, which is not in mlp.widths")
        if mlp["ms"][widths.index(w)] is None:
            raise _fail(f"mlp.ms[{widths.index(w)}]", "is null, but measured.mlp says it was measured")
    for h, q, v in measured.get("attn", []):
        if h not in attn["heads"] or q not in attn["qk"] or v not in attn["v"]:
            raise _fail("measured.attn", f"names [{h}, {q}, {v}], which is not on the attn grid")
        i, j, k = attn["heads"].index(h), attn["qk"].index(q), attn["v"].index(v)
        if attn["ms"][i][j][k] is None and not (d["rules"]["qk_equals_v"] and q != v):  # off-diagonal: never read
            raise _fail(f"attn.ms[{i}][{j}][{k}]", "is null, but measured.attn says it was measured")
    if not complete:
        return
    for i, x in enumerate(mlp["ms"]):
        if x is None:
            raise _fail(f"mlp.ms[{i}]", "is null in a complete table")
    diagonal = d["rules"]["qk_equals_v"]
    for i, plane in enumerate(attn["ms"]):
        for j, row in enumerate(plane):
            for k, x in enumerate(row):
                if x is None and (not diagonal or j == k):
                    raise _fail(f"attn.ms[{i}][{j}][{k}]", "is null in a complete table")
    for name in ("fixed_ms", "dense_model_ms"):
        if d[name] is None:
            raise _fail(name, "is null in a complete table")
    for name in ("block_overhead_ms", "block_scale"):
        if name in d and d[name] is None:
            raise _fail(name, "is null in a complete table")
    parts = d.get("meta", {}).get("parts") or {}
    for kind in WHOLE_KINDS[1:]:
        if measured.get(kind) and parts.get(f"{kind}_ms") is None:
            raise _fail(f"meta.parts.{kind}_ms", f"is missing or null, but measured.{kind} says it was measured")


TABLE_SCHEMA = Obj({
    "format": Req(Str()),
    "key": Req(_KEY),
    "rules": Req(_RULES),
    "mlp": Req(Obj({"widths": Req(_DIMS), "ms": Req(ListOf(_MS))})),
    "attn": Req(Obj({"heads": Req(_DIMS), "qk": Req(_DIMS), "v": Req(_DIMS),
                     "ms": Req(ListOf(ListOf(ListOf(_MS))))})),
    "fixed_ms": Req(Num(ge=0, nullable=True, want="a finite time >= 0 in ms")),
    "dense_model_ms": Req(_MS),
    "block_overhead_ms": Num(nullable=True, want="a finite time in ms (negative: a call the block saves)"),
    "block_scale": Num(gt=0, nullable=True),
    "block_points": ListOf(ListOf(Num(gt=0), min_len=2, max_len=2), min_len=2, nullable=True),
    "block_surface": Obj({"mlp_ms": Req(ListOf(Num(gt=0), min_len=2, increasing=True)),
                          "attn_ms": Req(ListOf(Num(gt=0), min_len=2, increasing=True)),
                          "ms": Req(ListOf(ListOf(Num(gt=0), min_len=2), min_len=2))}, nullable=True),
    "shape_change": Num(gt=-1, nullable=True, want="a factor > -1 (the extra cost of a block that changes shape)"),
    "tokens": _TOKENS,
    "measured": _MEASURED,
    "meta": _META,
}, then=_consistent)


def check_table(data: Any, label: str) -> dict:
    """``data`` (a parsed table file) if it fits :data:`TABLE_SCHEMA`.

    Args:
        data: the parsed JSON (its ``"format"`` already checked by the caller).
        label: the file, for the message (``"latency table 't.json'"``).

    Raises:
        UserError: ``"latency table 't.json': field 'rules.mlp_round_to' must be a positive
            integer, got 0 (a damaged or hand-edited table: rebuild it ... --force)"``.
    """
    return check(TABLE_SCHEMA, data, label, DAMAGED_HINT)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def check_adds_up(t: Any) -> None:
    """A complete table's parts add up to its whole dense model, and its self-check agrees with its numbers.

    Args:
        t: a :class:`~edgeprune.latency.table.LatencyTable` (complete; a partial one is not checked).

    Raises:
        SchemaError: naming the part: ``dense_model_ms`` when ``fixed_ms + depth x (MLP + attention + overhead)``
            is more than :data:`ADD_UP_TOLERANCE` from it (the message gives each part), ``block_overhead_ms``
            when it does not follow from ``meta.parts``, ``meta.self_check.models[i]`` when a check that says
            it passed misses, or whose prediction the table does not make. Skipped for a table kept with
            ``--force`` (``meta.self_check.forced``: loaded as unverified).
    """
    chk = t.meta.get("self_check") or {}
    if not t.complete or chk.get("forced"):
        return
    k, tol = t.key, ADD_UP_TOLERANCE
    dense = t.dense_dims()
    mlp, attn = t.mlp_ms(dense["mlp"]), t.attn_ms(dense["heads"], dense["qk"], dense["v"])
    over, scale = float(t.block_overhead_ms), float(t.block_scale)
    parts = t.meta.get("parts")
    quarter = (parts or {}).get("quarter_dims") if len(t.block_points or ()) > 2 else None  # used where it fit
    for pb, dims in (("per_block_ms", dense), ("per_block_half_ms", (parts or {}).get("half_dims")),
                     ("per_block_quarter_ms", quarter)):
        block = (parts or {}).get(pb)
        if block is None or not dims:
            continue
        line = scale * t.block_ms(dims) + over
        points = surface.through(t.block_points, t.block_ms(dims)) if t.block_points else line
        for field, got in (("block_points", points), ("block_overhead_ms", line)):
            if pb == "per_block_quarter_ms" and field == "block_overhead_ms":
                continue  # the line runs through the dense and the half point only
            if abs(block - got) > tol * block:
                raise _fail(field, f"is {over:.4g} ms with block_scale {scale:.4g} and block_points "
                            f"{t.block_points}: they give {got:.4g} ms per block at {dims}, but meta.parts.{pb} is "
                            f"{block:.4g} ms")
    if t.block_surface and parts:
        _check_surface(t, parts, tol)
    if parts is not None and parts.get("outside_ms") is not None and (
            abs(float(t.fixed_ms) - parts["outside_ms"]) > tol * parts["outside_ms"]):
        raise _fail("fixed_ms", f"is {t.fixed_ms:.4g} ms, but the model without its blocks was timed at "
                    f"{parts['outside_ms']:.4g} ms (meta.parts.outside_ms)")
    whole = t.dense_ms()
    gap = whole / float(t.dense_model_ms) - 1.0
    if abs(gap) > tol:
        raise _fail("dense_model_ms", f"is {t.dense_model_ms:.4g} ms, but the table's parts add up to {whole:.4g} ms "
                    f"(fixed_ms {t.fixed_ms:.4g} + depth {k['depth']} x (block_scale {scale:.4g} x (mlp {mlp:.4g} + "
                    f"attn {attn:.4g}) + block_overhead_ms {over:.4g})): {_pct(gap)}, more than {100 * tol:.0f}%")
    if t.shape_change is not None:
        fitted = shape_change.fit(t)
        if fitted is None or abs(fitted["factor"] - float(t.shape_change)) > 1e-6 * max(1.0, abs(fitted["factor"])):
            raise _fail("shape_change", f"is {float(t.shape_change):.4g}, but the table's shape-change models give "
                        + ("none (meta.parts.model_mixed_*_ms missing)" if fitted is None else
                           f"{fitted['factor']:.4g}"))
    for i, m in enumerate(chk.get("models", [])):
        field = f"meta.self_check.models[{i}]"
        try:
            pred = t.model_ms(m["blocks"], m.get("tokens"))
        except UserError as err:
            raise _fail(f"{field}.blocks", f"cannot be predicted by this table: {err}") from None
        if abs(pred - m["predicted_ms"]) > 1e-6 * max(1.0, pred):
            raise _fail(f"{field}.predicted_ms", f"is {m['predicted_ms']:.4g} ms, but the table predicts {pred:.4g} "
                        f"ms for its blocks (entries edited after the self-check)")
        miss = pred / m["measured_ms"] - 1.0
        if chk.get("passed") and abs(miss) > chk["tolerance"]:
            raise _fail(field, f"({m['name']}) is predicted {pred:.4g} ms, measured {m['measured_ms']:.4g} ms "
                        f"({_pct(miss)}), beyond the tolerance {100 * chk['tolerance']:.0f}%, but "
                        "meta.self_check.passed is true")


def _check_surface(t: Any, parts: dict, tol: float) -> None:
    """The surface's knots are the grid's times at the levels' dims (``meta.parts.<level>_dims``) and its cells the
    chains' per-block costs (``(meta.parts.<chain>_ms - call) / chain_blocks``, the call
    :func:`edgeprune.latency.surface.chain_call`: through ``meta.parts.calls``, else ``block_ms - per_block_ms``),
    each within ``tol``; ``meta.parts.calls`` are what the table's chains and models give.

    Raises:
        SchemaError: ``block_surface``, naming the knot or the cell that does not follow.
    """
    sf = t.block_surface
    if len(sf["ms"]) != len(sf["mlp_ms"]) or any(len(row) != len(sf["attn_ms"]) for row in sf["ms"]):
        raise _fail("block_surface", "ms must hold one row per mlp_ms knot and one cell per attn_ms knot")
    dims = {name: parts.get(f"{name}_dims") or t.dense_dims() for name, _f in surface.LEVELS}
    at = {"mlp_ms": {n: t.mlp_ms(d["mlp"]) for n, d in dims.items()},
          "attn_ms": {n: t.attn_ms(d["heads"], d["qk"], d["v"]) for n, d in dims.items()}}
    levels = [name for name, _f in surface.LEVELS]
    names: dict[str, list[str]] = {}
    for axis, times in at.items():  # the knots the fit kept (surface.growing), matched by position, not by value
        values = [times[name] for name in levels]
        keep = surface.growing(values)
        want = [values[i] for i in keep]
        if len(sf[axis]) != len(want) or any(abs(k - x) > tol * x for k, x in zip(sf[axis], want)):
            shown = ", ".join(f"{x:.4g}" for x in values)
            raise _fail("block_surface", f"{axis} knots {', '.join(f'{k:.4g}' for k in sf[axis])} ms are not the "
                        f"grid's times at the quarter, half and dense dims ({shown} ms)")
        names[axis] = [levels[i] for i in keep]
    n, block, per = parts.get("chain_blocks"), parts.get("block_ms"), parts.get("per_block_ms")
    if not n or ((block is None or per is None) and not parts.get("calls")):
        return
    calls = surface.level_calls(parts, t.dense_model_ms)
    given = parts.get("calls")
    if given and (calls is None or len(calls) != len(given) or any(
            abs(a - b) > tol * abs(want[0]) for want, got in zip(calls, given) for a, b in zip(want, got))):
        raise _fail("meta.parts.calls", "are not outside + chain - model of the table's dense, half and quarter "
                    "chains and models")
    for i, nm in enumerate(names["mlp_ms"]):
        for j, na in enumerate(names["attn_ms"]):
            ms = parts.get(f"{surface.chain_kind(nm, na)}_ms")
            want = None if ms is None else (float(ms) - surface.chain_call(parts, float(ms))) / n
            if want is not None and abs(sf["ms"][i][j] - want) > tol * abs(want):
                raise _fail("block_surface", f"cell [{i}][{j}] (MLP {nm}, attention {na}) is {sf['ms'][i][j]:.4g} ms, "
                            f"but the chain {surface.chain_kind(nm, na)} gives {want:.4g} ms per block")
