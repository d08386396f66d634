"""A measured per-block latency table of one model shape on one device (issue 30, items 1 and 7).

The table holds the time of one transformer block's two sub-blocks, measured on a grid of kept
structures:

* MLP sub-block ``x + ls2(fc2(act(fc1(norm2(x)))))`` at each kept MLP width;
* attention sub-block ``x + ls1(proj(attn(norm1(x))))`` at each (kept heads, per-head Q/K dim,
  per-head V dim); with the profile rule ``qk_equals_v`` only the diagonal ``qk == v`` is measured
  (off-diagonal entries are NaN, stored as ``null``),

plus ``fixed_ms`` (patch embedding, position embedding, final norm, head: the model with its blocks
removed, timed directly; tables built before issue 40: the dense model whole minus ``depth`` dense
blocks) and ``block_overhead_ms`` (issue 40: the dense block timed whole minus its two timed
sub-blocks -- the per-call overhead the sub-blocks pay apart and the block does not; a constant per
block, independent of the kept dims; 0 in older tables), so that ``fixed_ms + depth x (attention +
MLP + block_overhead_ms)`` predicts the dense model whole (:meth:`LatencyTable.dense_ms`).
Between grid points the time is interpolated piecewise-linearly along each axis (multilinearly in
(heads, qk, v)), so a prediction equals the measured value at a measured point. Units:
milliseconds per batch of ``key["batch"]`` images.

The JSON written by :meth:`LatencyTable.save` is the dataclass as a dict plus ``"format"``; it is what
``edgeprune latency-table`` writes and ``prune --latency-table`` reads (tables may be built on another machine).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
import os
from typing import Any, Sequence

from edgeprune.atomic import atomic_write_text
from edgeprune.errors import UserError
from edgeprune.latency import shape_change, surface
from edgeprune.latency.grid import check_gated
from edgeprune.latency.schema import DAMAGED_HINT, check_adds_up, check_table
from edgeprune.schema import SchemaError

FORMAT = "edgeprune-latency-table/1"

#: ``key`` fields that describe the model's shape (checked against a model by ``check_model``).
SHAPE_KEYS = ("embed_dim", "depth", "num_heads", "head_dim", "mlp_hidden", "tokens")


def _bracket(grid: Sequence[int], x: float, axis: str) -> tuple[int, int, float]:
    """``(lo, hi, t)`` with ``x = (1 - t) * grid[lo] + t * grid[hi]``; ``lo == hi, t = 0`` at a
    grid point.

    Raises:
        UserError: ``x`` outside ``[grid[0], grid[-1]]``.
    """
    if not grid or x < grid[0] or x > grid[-1]:
        lo_hi = f"{grid[0]}..{grid[-1]}" if grid else "empty"
        raise UserError(f"latency table: {axis} = {x:g} is outside the table's measured range "
                        f"({lo_hi}) (build a table for this model: edgeprune latency-table)")
    i = bisect.bisect_left(grid, x)
    if grid[i] == x:
        return i, i, 0.0
    lo, hi = i - 1, i
    return lo, hi, (x - grid[lo]) / (grid[hi] - grid[lo])


def _multilinear(brackets: Sequence[tuple[int, int, float]], value) -> float:
    """Sum of ``value(*corner)`` over the 2^n corners weighted by the product of the per-axis
    linear weights; corners of weight 0 are skipped (so a NaN there is never read)."""
    total = 0.0
    for choice in itertools.product((0, 1), repeat=len(brackets)):
        w = 1.0
        idx = []
        for (lo, hi, t), c in zip(brackets, choice):
            w *= t if c else 1.0 - t
            idx.append(hi if c else lo)
        if w == 0.0:
            continue
        v = value(*idx)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            raise UserError("latency table: the prediction needs an entry that was not measured "
                            f"(grid index {tuple(idx)}) (rebuild the table: edgeprune latency-table)")
        total += w * float(v)
    return total


@dataclasses.dataclass
class LatencyTable:
    """Measured sub-block latencies of one model shape on one device, backend, batch and precision.

    Attributes:
        key: what the timings depend on: ``embed_dim, depth, num_heads, head_dim, mlp_hidden,
            tokens, batch, precision, backend, backend_version, device_name, profile, threads``.
        rules: the profile's pruning rules ``{"mlp_round_to", "head_dim_round_to", "qk_equals_v"}``.
        mlp: ``{"widths": [int ascending], "ms": [float]}``: MLP sub-block ms per kept width.
        attn: ``{"heads": [...], "qk": [...], "v": [...], "ms": [heads][qk][v]}`` attention
            sub-block ms (NaN / None where not measured: off the diagonal under ``qk_equals_v``).
        fixed_ms: everything outside the blocks: the model with its blocks removed, timed (older
            tables: ``dense_model_ms - depth * (attn + mlp dense)``, clamped at >= 0).
        dense_model_ms: the dense model timed whole on the same backend.
        measured: which grid points were timed: ``{"mlp": [widths], "attn": [[h, qk, v], ...],
            "model": bool, "outside": bool, "block": bool, "chain": bool}``.
        meta: created (ISO time), edgeprune version, settings (warmup, iterations, statistic, interleave, clock,
            repeats, spread, retries), ``parts`` (the whole entries' times), ``self_check`` (predicted vs measured
            whole models, :mod:`edgeprune.latency.selfcheck`).
        block_overhead_ms, block_scale: a block inside a model costs ``block_scale x`` its two sub-blocks' sum ``+
            block_overhead_ms`` (the line through the dense and the half-dims block; the overhead may be negative: a
            sub-block timed alone pays a call the block does not); 0 and 1 for tables without them.
        block_points: ``[[sub-block sum ms, per-block ms inside a model], ...]`` ascending, measured at
            a quarter, half and all of the dense dims (:mod:`edgeprune.latency.selfcheck`); where
            present, :meth:`block_total` is piecewise-linear through them (extended by the end
            segments) instead of the one line of ``block_scale`` / ``block_overhead_ms``.
        block_surface: the in-model block cost over the MLP's and the attention's sub-block times apart
            (:mod:`edgeprune.latency.surface`: nine chains, the uniform ones and six mixed); where present,
            :meth:`block_total` reads it instead of ``block_points`` (None: a table built before it).
        tokens: the token axis (``latency-table --tokens``; None: none, the blocks timed at ``key["tokens"]`` only):
            ``{"counts": [N_1 < ... < key.tokens], "mlp": [f], "attn": [f], "merge": [g]}``, f the time of the
            dense MLP (attention) sub-block at that count over its time at ``key["tokens"]`` (1 at the last count);
            a sub-block of any kept dims at n tokens costs its full-count time x f(n), f linear in n between counts
            (:meth:`token_factor`); g the merging attention sub-block's time at that count over the dense
            attention's at ``key["tokens"]`` (:meth:`merge_extra_ms`; absent in tables built before it).
        shape_change: a block whose dims differ from the previous block's costs ``1 + shape_change`` times its
            in-model cost (:mod:`edgeprune.latency.shape_change`, fitted on two whole models that change shape at
            every block; None: a table built before it, priced as before).
    """

    key: dict
    rules: dict
    mlp: dict
    attn: dict
    fixed_ms: float
    dense_model_ms: float
    measured: dict = dataclasses.field(default_factory=dict)
    meta: dict = dataclasses.field(default_factory=dict)
    block_overhead_ms: float = 0.0
    block_scale: float = 1.0
    block_points: list | None = None
    tokens: dict | None = None
    block_surface: dict | None = None
    shape_change: float | None = None

    # -- prediction -------------------------------------------------------------------------
    def mlp_ms(self, width: int) -> float:
        """Predicted MLP sub-block ms at kept width ``width`` (piecewise-linear in the width).

        Raises:
            UserError: ``width`` outside the table's widths.
        """
        widths = self.mlp["widths"]
        b = _bracket(widths, width, "mlp width")
        return _multilinear([b], lambda i: self.mlp["ms"][i])

    def attn_ms(self, heads: int, qk: int, v: int) -> float:
        """Predicted attention sub-block ms at (kept heads, per-head Q/K dim, per-head V dim).

        Multilinear in (heads, qk, v) between the grid points; with ``rules["qk_equals_v"]``
        (only ``qk == v`` measured) bilinear in (heads, d) along the diagonal.

        Raises:
            UserError: a dim outside the grid, or ``qk != v`` on a table that measured only
                ``qk == v``.
        """
        ms = self.attn["ms"]
        bh = _bracket(self.attn["heads"], heads, "kept heads")
        if self.rules.get("qk_equals_v"):
            if qk != v:
                raise UserError(f"latency table: qk dim {qk} != v dim {v}, but this table measured only "
                                "qk == v (its device profile's rule qk_equals_v)")
            bd = _bracket(self.attn["qk"], qk, "qk/v head dim")
            return _multilinear([bh, bd], lambda i, j: ms[i][j][j])
        bq = _bracket(self.attn["qk"], qk, "qk head dim")
        bv = _bracket(self.attn["v"], v, "v head dim")
        return _multilinear([bh, bq, bv], lambda i, j, k: ms[i][j][k])

    def block_ms(self, dims: dict[str, int], tokens: int | None = None, mlp_tokens: int | None = None) -> float:
        """Predicted ms of one block with kept dims ``{"mlp", "qk", "v", "heads"}``.

        The MLP part plus the attention part (:meth:`mlp_ms`, :meth:`attn_ms`); equals the
        measured sum at a measured point. Missing keys default to the dense dims of ``key``.
        ``tokens`` / ``mlp_tokens``: the tokens the attention / the MLP sub-block sees (a merging block's MLP sees
        fewer); None: ``key["tokens"]``, the grid's own time; else that time x :meth:`token_factor`.

        Raises:
            UserError: a dim outside the grid's range (or qk != v where only qk == v was measured), a token count
                outside the token axis (or no axis).
        """
        mlp, attn, extra = self._parts(dims, tokens, mlp_tokens)
        return mlp + attn + extra

    def _parts(self, dims: dict[str, int], tokens: int | None, mlp_tokens: int | None) -> tuple[float, float, float]:
        """(MLP ms, attention ms, merge extra ms) of one block as :meth:`block_ms` adds them."""
        k = self.key
        mlp = self.mlp_ms(dims.get("mlp", k["mlp_hidden"]))
        attn = self.attn_ms(dims.get("heads", k["num_heads"]), dims.get("qk", k["head_dim"]),
                            dims.get("v", k["head_dim"]))
        if tokens is None and mlp_tokens is None:
            return mlp, attn, 0.0
        n = k["tokens"] if tokens is None else tokens
        nm = n if mlp_tokens is None else mlp_tokens
        return (mlp * self.token_factor("mlp", nm), attn * self.token_factor("attn", n),
                self.merge_extra_ms(n) if nm < n else 0.0)

    def merge_extra_ms(self, n: int) -> float:
        """What a block that merges tokens at ``n`` tokens costs beyond a plain one (proportional attention and the
        merge step; :mod:`edgeprune.latency.token_axis`): ``attn_ms(dense) x (merge(n) - attn(n))``, at least 0,
        ``merge`` linear in n between the axis's counts; 0 for a table without the entry (built before it).

        Raises:
            UserError: ``n`` outside the token axis.
        """
        if not self.tokens or "merge" not in self.tokens:
            return 0.0
        k = self.key
        b = _bracket(self.tokens["counts"], n, "tokens")
        merge = _multilinear([b], lambda i: self.tokens["merge"][i])  # type: ignore[index]
        dense = self.attn_ms(k["num_heads"], k["head_dim"], k["head_dim"])
        return max(0.0, dense * (merge - self.token_factor("attn", n)))

    def token_factor(self, part: str, n: int) -> float:
        """The ``part`` (``"mlp"`` / ``"attn"``) sub-block's time at ``n`` tokens over its time at ``key["tokens"]``:
        1 at the full count, the measured ratio of the dense sub-block at a count of the axis, linear in n between
        two counts (attention's n^2 term is followed only as closely as the counts are spaced: docs/latency.md).

        Raises:
            UserError: no token axis and ``n`` is not the full count, or ``n`` outside the axis.
        """
        full = int(self.key["tokens"])
        if n == full:
            return 1.0
        if not self.tokens:
            raise UserError(f"latency table: a block at {n} tokens, but the table has no token axis (it timed blocks "
                            f"at {full} tokens only; rebuild it with edgeprune latency-table ... --tokens N1,N2,...)")
        b = _bracket(self.tokens["counts"], n, "tokens")
        return _multilinear([b], lambda i: self.tokens[part][i])  # type: ignore[index]

    def dense_dims(self) -> dict[str, int]:
        """The dense block's dims ``{"mlp", "qk", "v", "heads"}`` (from ``key``)."""
        k = self.key
        return {"mlp": k["mlp_hidden"], "qk": k["head_dim"], "v": k["head_dim"], "heads": k["num_heads"]}

    def block_total(self, dims: dict[str, int], tokens: int | None = None, mlp_tokens: int | None = None) -> float:
        """Predicted ms of one block of ``dims`` inside a model: piecewise-linear in ``block_ms(dims)`` through
        ``block_points`` where the table has them, else ``block_scale x block_ms(dims) + block_overhead_ms``
        (``block_ms`` itself for a table without those terms); ``tokens`` / ``mlp_tokens`` as :meth:`block_ms`
        (the in-model terms are applied to the sub-blocks' sum at those counts); ``block_surface`` first where the
        table has it (:func:`edgeprune.latency.surface.cost_at` of the MLP and the attention with its merge extra)."""
        if self.block_surface:
            mlp, attn, extra = self._parts(dims, tokens, mlp_tokens)
            return surface.cost_at(self.block_surface, mlp, attn + extra)
        ms = self.block_ms(dims, tokens, mlp_tokens)
        if self.block_points:
            return surface.through(self.block_points, ms)
        scale, over = float(self.block_scale), float(self.block_overhead_ms)
        return ms if scale == 1.0 and over == 0.0 else scale * ms + over

    def dense_ms(self) -> float:
        """Predicted dense model ms: ``fixed_ms + depth * block_total(dense dims)``."""
        return float(self.fixed_ms) + int(self.key["depth"]) * self.block_total(self.dense_dims())

    def model_ms(self, blocks: Sequence[dict[str, int]], tokens: Sequence[Sequence[int]] | None = None) -> float:
        """Predicted ms of a whole model whose blocks keep ``blocks`` (one dims dict per block,
        :meth:`block_ms`): ``fixed_ms + sum(block_total)`` + the cost of changing shape between blocks
        (:func:`edgeprune.latency.shape_change.extra_ms`); ``tokens``: per block (tokens its attention sees,
        tokens its MLP sees) of a merging model (None: every block at ``key["tokens"]``).

        Raises:
            UserError: a dim outside the grid (or a token count outside the token axis).
        """
        extra = shape_change.extra_ms(self, blocks, tokens)
        if tokens is None:
            return float(self.fixed_ms) + sum(self.block_total(d) for d in blocks) + extra
        return (float(self.fixed_ms) + sum(self.block_total(d, int(n), int(nm)) for d, (n, nm) in zip(blocks, tokens))
                + extra)

    @property
    def unverified(self) -> str | None:
        """Why this table's predictions are not verified (its self-check missed and ``--force`` kept it), else
        None (passed, or a table built before the self-check: nothing to say)."""
        chk = self.meta.get("self_check")
        if not chk or chk.get("passed", True):
            return None
        return str(chk.get("failure") or "its self-check missed")

    # -- checks and files --------------------------------------------------------------------
    def check_model(self, anatomy: Any) -> None:
        """Check that ``anatomy`` (an :class:`~edgeprune.anatomy.ViTAnatomy` of the *dense* model)
        has the shape this table was measured for.

        Raises:
            UserError: one line naming the first field that differs, or a table of plain MLPs for a gated model
                and the reverse (:func:`edgeprune.latency.grid.check_gated`).
        """
        check_gated(self.key, anatomy)
        b0 = anatomy.blocks[0]
        have = {"embed_dim": anatomy.embed_dim, "depth": len(anatomy.blocks), "num_heads": b0.num_heads,
                "head_dim": b0.head_dim, "mlp_hidden": b0.mlp_hidden, "tokens": anatomy.num_tokens}
        for name in SHAPE_KEYS:
            if int(self.key.get(name, -1)) != int(have[name]):
                raise UserError(f"latency table is for {name} = {self.key.get(name)}, the model has "
                                f"{have[name]} (build a table for this model: edgeprune latency-table)")

    @property
    def complete(self) -> bool:
        """Whether every entry was measured and the self-check passed or was overridden (a partial table is what
        an interrupted build, or a failed self-check, left)."""
        return bool(self.meta.get("complete", True))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (NaN as ``None``) with ``"format"``."""
        d = dataclasses.asdict(self)
        d["attn"]["ms"] = [[[_num_out(x) for x in row] for row in plane] for plane in self.attn["ms"]]
        d["mlp"]["ms"] = [_num_out(x) for x in self.mlp["ms"]]
        d["fixed_ms"], d["dense_model_ms"] = _num_out(self.fixed_ms), _num_out(self.dense_model_ms)
        d["block_overhead_ms"] = _num_out(self.block_overhead_ms)  # None: not measured yet (a build in progress)
        d["block_scale"] = _num_out(self.block_scale)
        if self.block_surface is None:
            del d["block_surface"]  # a table without the surface is written as before
        if self.shape_change is None:
            del d["shape_change"]  # nor one without the shape-change factor
        if self.tokens is None:
            del d["tokens"]  # a table without the token axis is written as before
        else:
            d["tokens"] = {"counts": list(self.tokens["counts"]),
                           **{p: [_num_out(x) for x in self.tokens[p]] for p in ("mlp", "attn", "merge")
                              if p in self.tokens}}
        return {"format": FORMAT, **d}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table as JSON atomically (``edgeprune.atomic``)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n", fsync=True)

    @classmethod
    def from_dict(cls, d: Any, label: str = "latency table") -> "LatencyTable":
        """Validate a parsed JSON document (:func:`edgeprune.latency.schema.check_table`: every
        field, one schema check) and build the table.

        Raises:
            UserError: wrong format or a missing / malformed field, or a complete table whose parts do not
                add up to its whole dense model (one line naming the field:
                :func:`edgeprune.latency.schema.check_adds_up`).
        """
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise UserError(f"{label} is not an edgeprune latency table (expected \"format\": \"{FORMAT}\")")
        check_table(d, label)
        t = cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
        t.attn["ms"] = [[[_num_in(x) for x in row] for row in plane] for plane in t.attn["ms"]]
        t.mlp["ms"] = [_num_in(x) for x in t.mlp["ms"]]
        t.fixed_ms, t.dense_model_ms = _num_in(t.fixed_ms), _num_in(t.dense_model_ms)
        t.block_overhead_ms, t.block_scale = _num_in(t.block_overhead_ms), _num_in(t.block_scale)
        if t.tokens is not None:
            t.tokens = {"counts": list(t.tokens["counts"]),
                        **{p: [_num_in(x) for x in t.tokens[p]] for p in ("mlp", "attn", "merge") if p in t.tokens}}
        try:
            check_adds_up(t)
        except SchemaError as err:
            raise UserError(f"{label}: field {err.field!r} {err.problem} ({DAMAGED_HINT})") from None
        return t

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, allow_partial: bool = False) -> "LatencyTable":
        """Read a table written by :meth:`save`.

        Args:
            allow_partial: accept a table whose build was interrupted (``edgeprune latency-table``
                resumes it); by default such a table is refused.

        Raises:
            UserError: missing file, not JSON, not a latency table, or incomplete (one line).
        """
        label = f"latency table {str(path)!r}"
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise UserError(f"{label} not found (make one with: edgeprune latency-table)") from None
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{label} cannot be read: {err}") from None
        except json.JSONDecodeError as err:
            raise UserError(f"{label} is not JSON ({err.msg} at line {err.lineno})") from None
        table = cls.from_dict(data, label)
        chk = table.meta.get("self_check") or {}
        if not allow_partial and not table.complete and chk.get("passed") is False:
            raise UserError(f"{label} failed its self-check ({chk.get('failure')}): rerun the same edgeprune "
                            "latency-table command to time the check again, or add --force to keep it unverified")
        if not allow_partial and not table.complete:
            raise UserError(f"{label} is incomplete: its build was interrupted (rerun the same "
                            "edgeprune latency-table command to resume it)")
        return table


def _num_out(x: Any) -> float | None:
    """A time for JSON: NaN / None (not measured) -> None."""
    return None if x is None or math.isnan(float(x)) else float(x)


def _num_in(x: Any) -> float:
    """A time from JSON: None -> NaN."""
    return math.nan if x is None else float(x)


__all__ = ["FORMAT", "LatencyTable", "SHAPE_KEYS"]
