"""Which head dims a device's fused attention kernels take (issue 40 item 6).

TensorRT fuses a multi-head-attention graph (``MatMul -> Softmax -> MatMul``) into one kernel only
when, among other conditions, the head size ``H`` satisfies ``16 <= H <= 256`` and ``H % 8 == 0``
for FP16 / BF16, and ``H`` is 16, 32 or 64 (sequence lengths <= 512) for INT8; FP32 inputs are
never fused, and the GPU must be SM 7.5 or newer (TensorRT developer guide, "Multi-Head Attention
Fusion"; quoted in NVIDIA/TensorRT issues #2981 and #4167, the latter on Orin with TensorRT 10.3).
Outside these sets TensorRT runs the two batched matmuls and a softmax as separate kernels, so a
pruned head dim of e.g. 48 in INT8 is slower than 64.

A profile states the rule per precision in ``[pruning.head_dims]``::

    [pruning.head_dims]
    fp16 = { min = 16, max = 256, step = 8 }   # the range form: min, min + step, ..., <= max
    int8 = [16, 32, 64]                        # the set form

:func:`parse_head_dims` validates that table (one-line :class:`~devices.fields.ProfileError`), and
:func:`allowed_head_dims` reads the resolved list a latency table carries in ``rules["head_dims"]``
(the rule of the table's precision, ``devices.pruning_rules``). The allocator
(``edgeprune.allocation.rules``), the latency grid (``edgeprune.latency.grid``), NuWa
(``edgeprune.nuwa.budget``) and the build's fusion forecast (``exporters.tensorrt_attention``)
read the rule through these functions.
"""

from __future__ import annotations

from typing import Any, Mapping

from devices.fields import ProfileError
from edgeprune.errors import UserError

#: the source every message cites
SOURCE = "TensorRT developer guide, MHA fusion; NVIDIA/TensorRT #2981, #4167"

#: TensorRT's documented fused-MHA head sizes per build precision (module doc); fp32 is never fused
TENSORRT_HEAD_DIMS: dict[str, tuple[int, ...]] = {"fp16": tuple(range(16, 257, 8)), "int8": (16, 32, 64)}
#: INT8 fused MHA also needs sequence lengths <= this (same source)
TENSORRT_INT8_MAX_TOKENS = 512
#: fused MHA needs SM >= 7.5 (same source)
TENSORRT_MIN_SM = (7, 5)

#: the precisions a ``[pruning.head_dims]`` table may name
HEAD_DIM_PRECISIONS = ("fp16", "fp32", "int8")


def _int(v: Any, lo: int = 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _one_rule(label: str, field: str, v: Any) -> tuple[int, ...]:
    """One precision's rule: a list of head dims or ``{min, max, step}`` -> the ascending tuple."""
    if isinstance(v, list):
        if not v or not all(_int(x) for x in v):
            raise ProfileError(f"{label}: {field} must be a non-empty list of integers >= 1 (got {v!r})")
        if len(set(v)) != len(v):
            raise ProfileError(f"{label}: {field} lists a head dim twice (got {v!r})")
        return tuple(sorted(v))
    if isinstance(v, dict):
        if set(v) != {"min", "max", "step"}:
            raise ProfileError(f"{label}: {field} must have exactly the keys min, max, step (got {sorted(v)})")
        if not all(_int(v[k]) for k in ("min", "max", "step")):
            raise ProfileError(f"{label}: {field}.min, .max and .step must be integers >= 1 (got {v!r})")
        if v["min"] > v["max"]:
            raise ProfileError(f"{label}: {field} must have min <= max (got min={v['min']}, max={v['max']})")
        return tuple(range(v["min"], v["max"] + 1, v["step"]))
    raise ProfileError(f"{label}: {field} must be a list of head dims or a table {{min, max, step}} (got {v!r})")


def parse_head_dims(label: str, table: Any, head_dim_round_to: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Validate ``[pruning.head_dims]`` (module doc): per precision, the allowed head dims.

    Every rule must allow at least one multiple of ``head_dim_round_to`` (else no pruned head dim
    could be kept at all).

    Returns:
        ``((precision, ascending dims), ...)`` sorted by precision (``()`` for an empty table).

    Raises:
        ProfileError: not a table, an unknown precision, a bad list or range, a rule without a
            multiple of ``head_dim_round_to``.
    """
    field = "pruning.head_dims"
    if not isinstance(table, dict):
        raise ProfileError(f"{label}: {field} must be a table of precision = rule (got {table!r})")
    out = []
    for prec in sorted(table):
        if prec not in HEAD_DIM_PRECISIONS:
            raise ProfileError(f"{label}: unknown key {field}.{prec} (known here: {', '.join(HEAD_DIM_PRECISIONS)})")
        dims = _one_rule(label, f"{field}.{prec}", table[prec])
        if not any(d % head_dim_round_to == 0 for d in dims):
            raise ProfileError(f"{label}: {field}.{prec} allows no multiple of pruning.head_dim_round_to = "
                               f"{head_dim_round_to} (got {list(dims)})")
        out.append((prec, dims))
    return tuple(out)


def allowed_head_dims(rules: Mapping[str, Any] | None) -> tuple[int, ...] | None:
    """The head dims a latency table's (or cost model's) ``rules`` allow, ascending; None: any.

    Raises:
        UserError: ``rules["head_dims"]`` is present but not a non-empty list of positive integers
            (a hand-edited table).
    """
    if not rules or rules.get("head_dims") is None:
        return None
    dims = rules["head_dims"]
    if not isinstance(dims, (list, tuple)) or not dims or not all(_int(d) for d in dims):
        raise UserError(f"the latency table's rules.head_dims must be a non-empty list of integers >= 1 "
                        f"(got {dims!r}; a damaged or hand-edited table: rebuild it)")
    return tuple(sorted(set(int(d) for d in dims)))


def keep_allowed(sizes: list[int], dense: int, allowed: tuple[int, ...] | None) -> list[int]:
    """``sizes`` without the head dims the rule does not allow; the dense dim always stays (not pruning
    a head dim cannot break a kernel that the dense model did not already break)."""
    if allowed is None:
        return list(sizes)
    ok = set(allowed)
    return [k for k in sizes if k in ok or k == dense]


def describe_allowed(allowed: tuple[int, ...] | None) -> str:
    """``"16, 32, 64"`` or ``"16..256 step 8"`` for messages; ``"any"`` without a rule."""
    if allowed is None:
        return "any"
    steps = {b - a for a, b in zip(allowed, allowed[1:])}
    if len(allowed) > 4 and len(steps) == 1:
        return f"{allowed[0]}..{allowed[-1]} step {steps.pop()}"
    return ", ".join(str(d) for d in allowed)


__all__ = ["HEAD_DIM_PRECISIONS", "SOURCE", "TENSORRT_HEAD_DIMS", "TENSORRT_INT8_MAX_TOKENS", "TENSORRT_MIN_SM",
           "allowed_head_dims", "describe_allowed", "keep_allowed", "parse_head_dims"]
