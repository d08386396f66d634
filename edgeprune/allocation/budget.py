"""Budget parsing: ``--flops 0.5`` (a fraction of the dense model) or ``--flops 2.3G`` (absolute).

A budget is ``{"kind": "flops" | "params", "value": v}``: ``0 < v <= 1`` is a fraction of the dense
(unpruned input) model, ``v > 1`` an absolute count (FLOPs per image, = 2 x MACs, or parameters).
Suffixes k / M / G / T multiply by 1e3 / 1e6 / 1e9 / 1e12 (case-insensitive; an optional trailing
"FLOPs" / "params" word is not accepted -- numbers only).
"""

from __future__ import annotations

import math
import re

from edgeprune.errors import UserError

KINDS = ("flops", "params")
_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)\s*$")


def parse_budget_value(text, kind: str = "flops") -> float:
    """``"0.5"`` -> 0.5, ``"2.3G"`` -> 2.3e9, ``"20M"`` -> 2e7, a number -> itself.

    Args:
        text: a str (CLI) or a number (Python API).
        kind: "flops" or "params" (for the message).

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


def make_budget(flops=None, params=None) -> dict | None:
    """The ``CorpConfig.budget`` dict from ``flops=`` / ``params=`` (CLI or API), or None.

    Raises:
        UserError: both given, or a bad value (:func:`parse_budget_value`).
    """
    if flops is not None and params is not None:
        raise UserError("give either --flops or --params, not both")
    if flops is not None:
        return {"kind": "flops", "value": parse_budget_value(flops, "flops")}
    if params is not None:
        return {"kind": "params", "value": parse_budget_value(params, "params")}
    return None


def target_cost(budget: dict, dense_cost: float) -> float:
    """Absolute budget: ``value * dense_cost`` for a fraction (value <= 1), else ``value``."""
    v = float(budget["value"])
    return v * dense_cost if v <= 1.0 else v


def describe(budget: dict) -> str:
    """``"flops 0.5"`` / ``"params 2.3e+07"`` (for logs and run directory names)."""
    return f"{budget['kind']} {float(budget['value']):g}"
