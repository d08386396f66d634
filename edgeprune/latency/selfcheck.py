"""The parts of a model a latency table times besides the grid, and its self-check (issue 40, item 1).

A table predicts a model as ``fixed_ms + sum over blocks (MLP + attention + block_overhead_ms)``. Its
parts are timed directly, not by subtraction:

* ``outside``: the model with its blocks removed (patch embedding, position embedding, final norm,
  head; :func:`outside_model`) -- ``fixed_ms``;
* ``block`` and ``chain``: one dense block, and ``depth`` of them in sequence (at least 2,
  :func:`chain_length`: the weights of as many blocks as the model has, so the caches see what they
  see in the model), each timed whole (:func:`dense_blocks`): a block inside a model costs
  ``per_block_ms = (chain - block) / (chain_blocks - 1)``
  -- what a call costs (a module timed alone pays it once; inside the model the blocks do not) cancels
  in the difference. ``block_overhead_ms`` = that minus the two dense sub-blocks timed apart (each
  paid a call; the LayerNorms and residual adds are inside them): a constant per block.

Then the self-check (:func:`allocations`, :func:`verdict`): a few allocations spread over the grid
-- the dense model, and about x0.7, x0.5 and x0.3 of it with heads, head dims (Q/K apart from V
where the rules allow) and MLP widths cut in a different mix per block -- are predicted by the table
and timed as whole models of that shape (:func:`pruned_model`: the structural rebuild of run loading,
``edgeprune.surgery.apply_structure``, random weights: only the time matters). A prediction more than
:data:`~edgeprune.latency.schema.ADD_UP_TOLERANCE` from its measurement fails the table, naming the
part that is off.
"""

from __future__ import annotations

import copy
import datetime as _dt
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from edgeprune.errors import RuntimeFault
from edgeprune.latency.schema import ADD_UP_TOLERANCE
from edgeprune.surgery import apply_structure, backbone_vit

#: the fractions of the dense block the self-check's pruned allocations aim at
FRACTIONS = (0.7, 0.5, 0.3)

#: per block, the exponents (heads, head dims, MLP width) of the fraction: the mix of cuts rotates over the blocks
_MIXES = ((1.0, 0.0, 1.0), (0.0, 1.0, 1.0), (0.5, 0.5, 1.0), (0.0, 0.0, 2.0), (1.0, 1.0, 0.0))


def outside_model(anatomy: Any) -> nn.Module:
    """A copy of the model with no blocks: (B, C, H, W) -> the model's output; patch and position embedding, final
    norm and head only (eval mode)."""
    m = copy.deepcopy(anatomy.model).eval()
    backbone_vit(m).blocks = nn.Sequential()
    return m


def chain_length(depth: int) -> int:
    """How many dense blocks the ``chain`` entry runs in sequence: the model's depth, at least 2."""
    return max(2, int(depth))


def dense_blocks(anatomy: Any, n: int = 1) -> nn.Module:
    """``n`` copies of the model's first (dense) block in sequence (one: the block itself, copied): (B, N, D) ->
    (B, N, D), eval mode."""
    block = anatomy.blocks[0].block
    if n == 1:
        return copy.deepcopy(block).eval()
    return nn.Sequential(*[copy.deepcopy(block) for _ in range(n)]).eval()


def pruned_model(anatomy: Any, blocks: list[dict[str, int]], seed: int = 0) -> nn.Module:
    """A copy of the (dense) model rebuilt with per-block kept dims ``blocks`` (``{"mlp", "heads", "qk", "v"}``;
    :func:`edgeprune.surgery.apply_structure`, seeded random weights in the resized modules), eval mode."""
    torch.manual_seed(seed)
    m = copy.deepcopy(anatomy.model)
    hd = anatomy.blocks[0].head_dim
    apply_structure(m, [{"num_heads": d["heads"], "head_dim": hd, "qk_dim": d["qk"], "v_dim": d["v"],
                         "mlp_hidden": d["mlp"]} for d in blocks])
    return m.eval()


def _snap(x: float, step: int, lo: int, hi: int) -> int:
    """``x`` rounded to a multiple of ``step``, within ``[lo, hi]``."""
    return int(min(hi, max(lo, step * round(x / step))))


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


def run_check(t: Any, anatomy: Any, measure: Callable[[nn.Module], float]) -> dict[str, Any]:
    """Predict and time every :func:`allocations` model (the dense one is ``t.dense_model_ms``, already timed);
    ``measure(model) -> ms``. Returns the table's ``meta["self_check"]`` (:func:`verdict`)."""
    models = []
    for name, blocks in allocations(t):
        ms = float(t.dense_model_ms) if name == "dense" else float(measure(pruned_model(anatomy, blocks)))
        pred = t.model_ms(blocks)
        models.append({"name": name, "predicted_ms": pred, "measured_ms": ms, "error": pred / ms - 1.0,
                       "blocks": blocks})
    return verdict(t, models)


def verdict(t: Any, models: list[dict[str, Any]], tolerance: float = ADD_UP_TOLERANCE) -> dict[str, Any]:
    """``{"passed", "tolerance", "failure", "models"}``: failed when a model's ``error`` (predicted / measured
    - 1) exceeds ``tolerance``; ``failure`` names the worst model and the part that is off (the dense model: the
    parts outside / per block do not add up to the whole; a pruned one: the grid's entries at its dims)."""
    bad = [m for m in models if abs(m["error"]) > tolerance]
    failure = None
    if bad:
        m = max(bad, key=lambda m: abs(m["error"]))
        say = (f"predicted {m['predicted_ms']:.4g} ms, measured {m['measured_ms']:.4g} ms whole "
               f"({100 * m['error']:+.1f}%, more than {100 * tolerance:.0f}%)")
        if m["name"] == "dense":
            block = t.block_ms(t.dense_dims()) + float(t.block_overhead_ms)
            failure = (f"the parts do not add up to the dense model: outside the blocks {t.fixed_ms:.4g} ms + "
                       f"{t.key['depth']} x block {block:.4g} ms {say}")
        else:
            failure = (f"the sub-block entries (mlp.ms / attn.ms) are off at the pruned dims of allocation "
                       f"{m['name']} ({_span(m['blocks'])}): {say}")
    return {"passed": not bad, "tolerance": tolerance, "failure": failure, "models": models}


class SelfCheckFailed(RuntimeFault):
    """The table's prediction of whole models missed their measurement (exit 1; ``--force`` keeps the table)."""


def finish(t: Any) -> Any:
    """Fill ``fixed_ms`` (the model without its blocks, timed) and ``block_overhead_ms`` (a block's cost inside a
    chain, ``per_block_ms``, minus its two sub-blocks; module doc); ``meta["fixed_by_subtraction_ms"]`` keeps what
    the subtraction of earlier tables gave (dense model - depth x sub-blocks), for comparison. Not yet complete
    (the self-check decides)."""
    k, parts = t.key, t.meta["parts"]
    sub = t.mlp_ms(k["mlp_hidden"]) + t.attn_ms(k["num_heads"], k["head_dim"], k["head_dim"])
    n = chain_length(k["depth"])
    parts["sub_blocks_ms"], parts["chain_blocks"] = sub, n
    per_block = (float(parts["chain_ms"]) - float(parts["block_ms"])) / (n - 1)
    if per_block <= 0:  # time both again on a rerun
        t.measured["block"] = t.measured["chain"] = False
        raise RuntimeFault(f"latency table: {n} dense blocks in sequence timed {parts['chain_ms']:.4g} ms, one "
                           f"alone {parts['block_ms']:.4g} ms: the machine's load changed too much between them "
                           "(rerun the command: it times the rest again)")
    parts["per_block_ms"] = per_block
    t.fixed_ms = float(parts["outside_ms"])
    t.block_overhead_ms = per_block - sub
    t.meta["fixed_by_subtraction_ms"] = float(t.dense_model_ms) - k["depth"] * sub
    return t


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
        raise SelfCheckFailed(f"latency table self-check failed: {check['failure']} ({out} is left incomplete: "
                              "rerun the command to time the check again, or add --force to keep it unverified)")
    return t


__all__ = ["SelfCheckFailed", "conclude", "finish", "FRACTIONS", "allocations",
           "chain_length", "dense_blocks", "outside_model", "pruned_model", "run_check", "verdict"]
