"""The one budget parser of ``edgeprune prune`` and ``edgeprune derive`` (CLI text or Python numbers ->
:class:`Budget`).

``--flops 0.5`` is a fraction of the dense model, ``--flops 2.3G`` absolute (suffixes k / M / G / T multiply by
1e3 / 1e6 / 1e9 / 1e12, case-insensitive; numbers only). A kind whose cost model declares a ``unit`` (``latency``:
``"ms"``) reads its absolute budgets with that unit and only with it: ``--latency 12ms`` is absolute (even below
1 ms), ``--latency 0.5`` a fraction, and a bare number > 1 is refused as ambiguous. A kind whose cost model declares
``needs_table`` carries the path of its table (``make_budget(table=...)``); without one the message is the cost
model's ``missing_table`` line.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from edgeprune.budget.budget import Budget
from edgeprune.budget.registry import kind_attr, list_cost_models
from edgeprune.errors import UserError

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)\s*$")


def budget_kinds() -> list[str]:
    """The budget kinds a budget may name: the registered cost models (``flops``, ``params``, ``latency`` ...)."""
    return list_cost_models()


def kind_unit(kind: str) -> str | None:
    """The unit of a kind's absolute budgets when its cost model declares one (``latency``: "ms")."""
    return kind_attr(kind, "unit")


def parse_with_unit(text: Any, kind: str, unit: str) -> tuple[float, bool]:
    """``"12ms"`` -> (12.0, True) (absolute), ``"0.5"`` / 0.5 -> (0.5, False) (a fraction).

    Raises:
        UserError: not a number with an optional ``unit`` suffix, <= 0, not finite, or a bare number > 1 (a fraction
            must be <= 1; an absolute budget names its unit).
    """
    raw = text.strip() if isinstance(text, str) else text
    absolute = isinstance(raw, str) and raw.lower().endswith(unit.lower())
    if absolute:
        raw = raw[: -len(unit)]
    m = _NUMBER.match(raw) if isinstance(raw, str) else None
    if isinstance(raw, str) and (m is None or m.group(2)):  # no k/M/G suffix: the unit says it
        raise UserError(f"--{kind} must be a fraction of the dense model (e.g. 0.5) or a value in {unit} "
                        f"(e.g. 12{unit}), got {text!r}")
    value = parse_budget_value(raw, kind)
    if not absolute and value > 1:
        raise UserError(f"--{kind} {text!r} is ambiguous: give a fraction of the dense model in (0, 1] "
                        f"(e.g. 0.5) or a value with its unit (e.g. {value:g}{unit})")
    return value, absolute


def parse_budget_value(text: Any, kind: str = "flops") -> float:
    """``"0.5"`` -> 0.5, ``"2.3G"`` -> 2.3e9, ``"20M"`` -> 2e7, a number -> itself.

    Args:
        text: a str (CLI) or a number (Python API).
        kind: the budget kind (for the message: ``--<kind>``).

    Returns:
        the value, > 0 (<= 1: a fraction; > 1: an absolute count).

    Raises:
        UserError: not a number with an optional k/M/G/T suffix, or <= 0, or not finite.
    """
    if isinstance(text, bool):
        raise UserError(f"--{kind} must be a number, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _NUMBER.match(str(text))
        if not m:
            raise UserError(f"--{kind} must be a fraction of the dense model (e.g. 0.5) or a count with an "
                            f"optional k/M/G/T suffix (e.g. 2.3G), got {text!r}")
        value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"--{kind} must be > 0 (a fraction in (0, 1] or an absolute count), got {text!r}")
    return value


def make_budget(flops: Any = None, params: Any = None, *, table: Any = None, **kinds: Any) -> Budget | None:
    """The :class:`Budget` from at most one of ``flops=``, ``params=`` or ``<kind>=`` for another registered kind
    (CLI strings or numbers), or None when none is given. ``table``: the path of the kind's table (kinds whose
    cost model ``needs_table``: ``latency``).

    Raises:
        UserError: more than one given, an unregistered kind, a bad value (:func:`parse_budget_value`,
            :func:`parse_with_unit`), a table missing for a kind that needs one or given for one that does not.
    """
    given = {k: v for k, v in {"flops": flops, "params": params, **kinds}.items() if v is not None}
    for k in given:
        if k not in budget_kinds():
            raise UserError(f"unknown budget kind {k!r} (choose from {', '.join(budget_kinds())})")
    if len(given) > 1:
        names = [f"--{k}" for k in given]
        if len(names) == 2:
            raise UserError(f"give either {names[0]} or {names[1]}, not both")
        raise UserError(f"give one budget, not several: {', '.join(names)}")
    if not given:
        if table is not None:
            raise UserError("--latency-table goes with --latency (a latency budget); no latency budget was given")
        return None
    ((kind, value),) = given.items()
    unit = kind_unit(kind)
    if unit is None:
        v, absolute = parse_budget_value(value, kind), False
    else:
        v, absolute = parse_with_unit(value, kind, unit)
    return Budget(kind, v, unit if absolute else None, os.fspath(table) if table is not None else None)


def validate_budget(budget: Any) -> Budget:
    """A budget given from Python (a :class:`Budget` or its record form ``{"kind", "value"[, "unit", "table"]}``),
    checked.

    Raises:
        UserError: not a budget, or as :class:`Budget`.
    """
    return Budget.from_dict(budget)
