"""The latency table's token axis (issue 44, item 3; ``edgeprune latency-table --tokens N1,N2,...``, opt-in).

A merged model (``--tokens-merge``, :mod:`edgeprune.tokens`) runs its blocks at fewer tokens than the model's.
The table times the dense MLP sub-block and the dense attention sub-block (of the grid's block shape) at each
extra count n and keeps, per count, the time at n over the time at the full count N
(:attr:`~edgeprune.latency.table.LatencyTable.tokens`). A sub-block of any kept dims at n tokens is then
predicted as its full-count grid entry times that ratio of its kind
(:meth:`~edgeprune.latency.table.LatencyTable.token_factor`), linear in n between two counts: attention's n^2
term is followed as closely as the counts are spaced (a few counts between the smallest merged count and N keep
the chord's error small), and the ratio of the dense sub-block is assumed for every kept width (the coarse part:
only the dense point is timed at the extra counts).

Interleaved builds (the default) time each such entry side by side with the dense sub-block at N -- the very
reference of its kind -- so the ratio is measured on one load level; ``--no-interleave`` times the two one after the
other.
"""

from __future__ import annotations

import math
from typing import Any

from edgeprune.latency.measure import TimingSettings, Timer, attn_subblock, mlp_subblock
from edgeprune.latency.table import LatencyTable

#: the axis's entries: the dense MLP / attention sub-block at one more token count
TOKEN_KINDS = ("tokens_mlp", "tokens_attn")


def add_axis(t: LatencyTable, counts: list[int]) -> None:
    """Give the (fresh) table ``t`` an unmeasured token axis at ``counts`` (ascending, below ``key.tokens``);
    nothing for no counts (the table is then written exactly as without the axis)."""
    if not counts:
        return
    t.tokens = {"counts": [*counts, int(t.key["tokens"])],
                **{p: [math.nan] * len(counts) + [1.0] for p in ("mlp", "attn")}}
    t.measured.update(tokens_mlp=[], tokens_attn=[])


def counts_of(t: LatencyTable) -> list[int] | None:
    """The token axis's counts (None: no axis)."""
    return None if t.tokens is None else list(t.tokens["counts"])


def dense_module(anatomy: Any, key: dict, part: str) -> Any:
    """The dense ``part`` (``"mlp"`` / ``"attn"``) sub-block of block 0's shape."""
    tmpl, D = anatomy.blocks[0], key["embed_dim"]
    if part == "mlp":
        return mlp_subblock(tmpl, D, key["mlp_hidden"])
    return attn_subblock(tmpl, D, key["num_heads"], key["head_dim"], key["head_dim"])


def time_tokens(t: LatencyTable, kind: str, n: int, anatomy: Any, timer: Timer, s: TimingSettings, batch: int,
                refs: Any) -> Any:
    """Time the dense sub-block of ``kind`` at ``n`` tokens relative to it at the full count and record the ratio
    in ``t.tokens`` (module doc). Returns the entry's :class:`~edgeprune.latency.measure.Sample` (spread,
    attempts)."""
    part = kind[len("tokens_"):]
    D, N = t.key["embed_dim"], t.key["tokens"]
    module = dense_module(anatomy, t.key, part)
    if refs is not None:
        got = refs.measure(part, module, (batch, n, D))
        ratio = got.value
    else:
        got = timer.measure(module, (batch, n, D), s)
        ratio = got.value / timer.measure(dense_module(anatomy, t.key, part), (batch, N, D), s).value
    assert t.tokens is not None
    t.tokens[part][t.tokens["counts"].index(n)] = float(ratio)
    t.measured.setdefault(kind, []).append(n)
    return got


__all__ = ["TOKEN_KINDS", "add_axis", "counts_of", "dense_module", "time_tokens"]
