"""The grid of block structures a latency table times (issue 30, item 1).

From the dense block's shape (:func:`shape_of`, read through :mod:`edgeprune.anatomy`) and the
profile's pruning rules (``devices.pruning_rules``):

* MLP widths: the multiples of ``mlp_round_to`` up to the dense width, plus the dense width,
  thinned to at most ``max_mlp`` evenly spaced points (always the smallest and the dense width);
* kept heads: 1..H (thinned to ``max_heads`` points for very wide models);
* Q/K and V head dims: the multiples of ``head_dim_round_to`` up to the dense head dim, plus it,
  thinned to ``max_dims`` points (``max_diag`` on the diagonal when ``qk_equals_v``: only
  ``qk == v`` is timed there, so it affords more points).

Token axis (``--tokens N1,N2,...``, opt-in, issue 44): the dense MLP sub-block and the dense attention sub-block
are also timed at each of those token counts (2 entries per count, whatever the grid); the table keeps each
one's time relative to the full count (:attr:`~edgeprune.latency.table.LatencyTable.tokens`).

Between points the table interpolates linearly (:mod:`edgeprune.latency.table`), so thinning trades
a little accuracy between points for a bounded build time: deit_small on the CPU profile has
16 MLP + 6 x 4 x 4 attention entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from devices.kernels import allowed_head_dims, keep_allowed
from edgeprune.errors import UserError

MAX_MLP_POINTS = 16
MAX_HEAD_POINTS = 12
MAX_DIM_POINTS = 4
MAX_DIAGONAL_POINTS = 8


def mlp_gated(anatomy: Any) -> bool:
    """Whether the model's MLPs are gated (``fc1_gate``, SwiGLU: three matmuls; issue 54): a table of a gated model
    times gated MLP sub-blocks and says so in its key (``key["mlp_gated"]``: true; absent in a plain model's
    table, as in every table before it).

    Raises:
        UserError: some blocks gated and others not (a table describes one block shape), naming the first.
    """
    gated = [getattr(b, "fc1_gate", None) is not None for b in anatomy.blocks]
    if any(gated) and not all(gated):
        i = gated.index(not gated[0])
        raise UserError(f"latency-table needs blocks of one shape: block {i} has a "
                        f"{'gated' if gated[i] else 'plain'} MLP, block 0 a {'gated' if gated[0] else 'plain'} one")
    return bool(gated and gated[0])


def check_gated(key: dict, anatomy: Any) -> None:
    """A table (its ``key``) times the kind of MLP the model has (:func:`mlp_gated`).

    Raises:
        UserError: one line, a table of plain MLPs for a gated model or the reverse.
    """
    gated, timed = mlp_gated(anatomy), bool(key.get("mlp_gated", False))
    if gated != timed:
        raise UserError(f"latency table times {'gated' if timed else 'plain'} MLPs, the model's are "
                        f"{'gated' if gated else 'plain'} (build a table for this model: edgeprune latency-table)")


def shape_of(anatomy: Any) -> dict[str, Any]:
    """The dense block shape of a ViT: ``embed_dim, depth, num_heads, head_dim, mlp_hidden, tokens`` (and
    ``mlp_gated: True`` for gated MLPs, :func:`mlp_gated`).

    Raises:
        UserError: the model is pruned (a block's dims differ from the dense ones), or its blocks
            differ in shape (a table describes one block shape).
    """
    gated = mlp_gated(anatomy)
    b0 = anatomy.blocks[0]
    for b in anatomy.blocks:
        dims = (b.num_heads, b.qk_dim, b.v_dim, b.mlp_hidden)
        if b.qk_dim != b.head_dim or b.v_dim != b.head_dim:
            raise UserError(f"latency-table needs the dense model: block {b.index} has qk/v dims "
                            f"{b.qk_dim}/{b.v_dim}, not {b.head_dim} (pass the unpruned model)")
        if dims != (b0.num_heads, b0.qk_dim, b0.v_dim, b0.mlp_hidden):
            raise UserError(f"latency-table needs blocks of one shape: block {b.index} has "
                            f"(heads, qk, v, mlp) = {dims}, block 0 "
                            f"{(b0.num_heads, b0.qk_dim, b0.v_dim, b0.mlp_hidden)} (pass the unpruned model)")
    return {"embed_dim": int(anatomy.embed_dim), "depth": len(anatomy.blocks), "num_heads": int(b0.num_heads),
            "head_dim": int(b0.head_dim), "mlp_hidden": int(b0.mlp_hidden), "tokens": int(anatomy.num_tokens),
            **({"mlp_gated": True} if gated else {})}


def thin(points: list[int], limit: int) -> list[int]:
    """At most ``limit`` (>= 2) evenly spaced elements of the ascending ``points``, always the
    first and the last."""
    n = len(points)
    if n <= limit:
        return list(points)
    idx = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})
    return [points[i] for i in idx]


def on_grid(dense: int, round_to: int) -> list[int]:
    """Multiples of ``round_to`` up to ``dense``, and ``dense`` itself, ascending (``[dense]``
    when ``round_to > dense``)."""
    return sorted(set(range(round_to, dense + 1, round_to)) | {dense})


@dataclasses.dataclass
class Grid:
    """The structures a table times.

    Attributes:
        mlp: kept MLP widths (ascending).
        heads, qk, v: kept heads and per-head Q/K and V dims (ascending).
        qk_equals_v: only ``qk == v`` is timed (``qk`` and ``v`` are then the same list).
        tokens: the token counts besides the model's at which the dense sub-blocks are timed (ascending; empty:
            no token axis).
        full_tokens: the model's own token count (the merge step is timed there too).
    """

    mlp: list[int]
    heads: list[int]
    qk: list[int]
    v: list[int]
    qk_equals_v: bool
    tokens: list[int] = dataclasses.field(default_factory=list)
    full_tokens: int = 0

    def attn_points(self) -> list[tuple[int, int, int]]:
        """Every timed (heads, qk, v), ascending, heads-major (only ``qk == v`` when
        ``qk_equals_v``)."""
        return [(h, q, v) for h in self.heads for q in self.qk for v in self.v
                if not self.qk_equals_v or q == v]

    def count(self) -> int:
        """Entries to time (without the whole dense model)."""
        return len(self.mlp) + len(self.attn_points()) + 3 * len(self.tokens) + (1 if self.tokens else 0)


def parse_token_counts(text: str | None) -> list[int]:
    """The token counts of ``--tokens N1,N2,...`` (None or empty: none), in the order given.

    Raises:
        UserError: a value that is not an integer.
    """
    if text is None or not str(text).strip():
        return []
    out = []
    for part in str(text).split(","):
        try:
            out.append(int(part.strip()))
        except ValueError:
            raise UserError(f"--tokens: {part.strip()!r} is not an integer (give token counts: --tokens 150,100,50)") \
                from None
    return out


def check_token_counts(counts: list[int], full: int, prefix: int) -> list[int]:
    """``counts`` ascending, without the model's own ``full`` count (a model of ``full`` tokens, ``prefix`` of
    them never merged: class / distillation / register tokens).

    Raises:
        UserError: a count <= ``prefix`` or > ``full``, or one given twice (one line naming it).
    """
    seen: set[int] = set()
    for n in counts:
        if n <= prefix or n > full:
            raise UserError(f"--tokens: {n} is outside {prefix + 1}..{full} (more than the model's {prefix} prefix "
                            f"token(s), at most its {full} tokens)")
        if n in seen:
            raise UserError(f"--tokens: {n} is given twice")
        seen.add(n)
    return sorted(seen - {full})


def make_grid(shape: dict[str, int], rules: dict[str, Any], *, max_mlp: int = MAX_MLP_POINTS,
              max_heads: int = MAX_HEAD_POINTS, max_dims: int = MAX_DIM_POINTS,
              max_diag: int = MAX_DIAGONAL_POINTS, tokens: list[int] | None = None) -> Grid:
    """The grid for a dense block ``shape`` (:func:`shape_of`) under the profile's ``rules``; with
    ``rules["head_dims"]`` (a GPU profile's fused-attention rule, :mod:`devices.kernels`) only those
    head dims (and the dense one) are timed. ``tokens``: the token axis's counts (checked by
    :func:`check_token_counts`).

    Raises:
        UserError: a limit below 2, a rule below 1 or a malformed ``head_dims``.
    """
    if min(max_mlp, max_heads, max_dims, max_diag) < 2:
        raise UserError("latency grid: every axis needs at least 2 points")
    if min(rules["mlp_round_to"], rules["head_dim_round_to"]) < 1:
        raise UserError("latency grid: round_to rules must be >= 1")
    mlp = thin(on_grid(shape["mlp_hidden"], rules["mlp_round_to"]), max_mlp)
    heads = thin(list(range(1, shape["num_heads"] + 1)), max_heads)
    diag = bool(rules["qk_equals_v"])
    dims = keep_allowed(on_grid(shape["head_dim"], rules["head_dim_round_to"]), shape["head_dim"],
                        allowed_head_dims(rules))
    dims = thin(dims, max_diag if diag else max_dims)
    return Grid(mlp=mlp, heads=heads, qk=dims, v=list(dims), qk_equals_v=diag, tokens=sorted(tokens or []),
                full_tokens=int(shape.get("tokens", 0)))


__all__ = ["Grid", "check_gated", "check_token_counts", "make_grid", "mlp_gated", "on_grid", "parse_token_counts",
           "shape_of", "thin"]
