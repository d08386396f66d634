"""Budgets, one parser for ``edgeprune prune`` and ``edgeprune derive``: ``--flops 0.5`` (a fraction
of the dense model) or ``--flops 2.3G`` (absolute).

A budget is ``{"kind": K, "value": v}`` where K is a registered budget kind
(:func:`edgeprune.allocation.cost.list_cost_models`: ``flops``, ``params``; a new kind is a new
registered cost model, nothing here changes): ``0 < v <= 1`` is a fraction of the dense (unpruned
input) model, ``v > 1`` an absolute count (FLOPs per image, = 2 x MACs, or parameters).
Suffixes k / M / G / T multiply by 1e3 / 1e6 / 1e9 / 1e12 (case-insensitive; an optional trailing
"FLOPs" / "params" word is not accepted -- numbers only).
"""

from __future__ import annotations

import math
import re

from edgeprune.allocation.cost import list_cost_models
from edgeprune.errors import UserError

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)\s*$")


def budget_kinds() -> list[str]:
    """The budget kinds a budget may name: the registered cost models (``flops``, ``params``, ...)."""
    return list_cost_models()


def parse_budget_value(text, kind: str = "flops") -> float:
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


def make_budget(flops=None, params=None, **kinds) -> dict | None:
    """The budget dict (``CorpConfig.budget``, NuWa's budget) from at most one of ``flops=``,
    ``params=`` or ``<kind>=`` for another registered kind (CLI strings or numbers), or None.

    Raises:
        UserError: more than one given, an unregistered kind, or a bad value
            (:func:`parse_budget_value`).
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
        return None
    ((kind, value),) = given.items()
    return {"kind": kind, "value": parse_budget_value(value, kind)}


def validate_budget(budget: dict) -> None:
    """Checks a budget dict (e.g. ``CorpConfig.budget`` given from Python).

    Raises:
        UserError: not a ``{"kind": K, "value": v}`` dict, K not a registered kind (the message lists
            :func:`budget_kinds`), or v not a finite number > 0.
    """
    kinds = budget_kinds()
    if not isinstance(budget, dict) or "kind" not in budget:
        raise UserError(f"budget must be {{'kind': {' | '.join(repr(k) for k in kinds)}, 'value': v}}, got {budget!r}")
    if budget["kind"] not in kinds:
        raise UserError(f"unknown budget kind {budget['kind']!r} (choose from {', '.join(kinds)})")
    v = budget.get("value")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
        raise UserError(f"the {budget['kind']} budget must be > 0, got {v!r}")


def target_cost(budget: dict, dense_cost: float) -> float:
    """Absolute budget: ``value * dense_cost`` for a fraction (value <= 1), else ``value``."""
    v = float(budget["value"])
    return v * dense_cost if v <= 1.0 else v


def is_fraction(budget: dict) -> bool:
    """Whether the budget's value is a fraction of the dense model (<= 1) rather than a count."""
    return float(budget["value"]) <= 1.0


def exceeds_dense(budget: dict, dense_cost: float) -> bool:
    """Whether the budget asks for at least the dense model's cost (nothing has to be pruned):
    an absolute value >= ``dense_cost`` or the fraction 1. The caller decides what to say (the
    allocation then keeps the budget's targeted modules dense)."""
    return target_cost(budget, dense_cost) >= dense_cost


def describe(budget: dict) -> str:
    """``"flops 0.5"`` / ``"params 2.3e+07"`` (for logs and run directory names)."""
    return f"{budget['kind']} {float(budget['value']):g}"
