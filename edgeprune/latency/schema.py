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
"""

from __future__ import annotations

from typing import Any

from edgeprune.schema import Bool, Int, ListOf, MapOf, Num, Obj, Req, SchemaError, Str, check

__all__ = ["TABLE_SCHEMA", "check_table", "DAMAGED_HINT"]

#: what to do about a damaged table (the message's parentheses)
DAMAGED_HINT = ("a damaged or hand-edited table: rebuild it with edgeprune latency-table --model M --device PROFILE "
                "-o FILE --force")

_POS = Int(min=1)
_MS = Num(gt=0, nullable=True, want="a positive finite time in ms")
_DIMS = ListOf(Int(min=0), min_len=1, increasing=True)

_KEY = Obj({**{k: Req(_POS) for k in ("embed_dim", "depth", "num_heads", "head_dim", "mlp_hidden", "tokens",
                                       "batch")},
            "threads": Req(Int(min=1, nullable=True)),
            **{k: Req(Str(nonempty=True)) for k in ("precision", "backend", "device_name", "profile")},
            "backend_version": Str(nullable=True)})

_RULES = Obj({"mlp_round_to": Req(_POS), "head_dim_round_to": Req(_POS), "qk_equals_v": Req(Bool())})

_SETTINGS = Obj({"warmup": Int(min=0, nullable=True), "iterations": Int(min=1, nullable=True),
                 "max_seconds": Num(gt=0, nullable=True), "min_iterations": Int(min=1, nullable=True),
                 "statistic": Str(choices=("p50", "min"), nullable=True), "interleave": Bool(nullable=True),
                 "clock": Str(choices=("wall", "cpu"), nullable=True), "cuda_graphs": Bool(nullable=True),
                 "input": Str(nullable=True)})

_RELATIVE = Obj({"mlp": Req(MapOf(Num(gt=0))), "attn": Req(MapOf(Num(gt=0))), "model": Num(gt=0, nullable=True),
                 "reference_ms": Req(Obj({"mlp": Req(ListOf(Num(gt=0))), "attn": Req(ListOf(Num(gt=0)))}))})

_META = Obj({"complete": Bool(), "settings": _SETTINGS, "relative": _RELATIVE, "created": Str(nullable=True),
             "edgeprune": Str(nullable=True)})

_MEASURED = Obj({"mlp": ListOf(Int(min=0)), "attn": ListOf(ListOf(Int(min=0), min_len=3, max_len=3)),
                 "model": Bool()})


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


TABLE_SCHEMA = Obj({
    "format": Req(Str()),
    "key": Req(_KEY),
    "rules": Req(_RULES),
    "mlp": Req(Obj({"widths": Req(_DIMS), "ms": Req(ListOf(_MS))})),
    "attn": Req(Obj({"heads": Req(_DIMS), "qk": Req(_DIMS), "v": Req(_DIMS),
                     "ms": Req(ListOf(ListOf(ListOf(_MS))))})),
    "fixed_ms": Req(Num(ge=0, nullable=True, want="a finite time >= 0 in ms")),
    "dense_model_ms": Req(_MS),
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
