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

The merge step (``tokens.merge``, at every count of the axis and at N): what a merging block does beyond a plain
one -- proportional attention (the ``log s`` logit bias) and the merge itself (the keys' cosine similarities, TopK,
the one-hot MatMul of ``merge_wavg``) -- is timed as the *merging* attention sub-block (:class:`MergeAttnSubBlock`,
dense dims, r = ``max(1, (n - prefix) // 8)`` merges: its cost hardly depends on r), relative to the dense attention
sub-block at N. A block that merges at n tokens then pays ``attn_ms(dense) x (merge(n) - attn(n))`` more
(:meth:`~edgeprune.latency.table.LatencyTable.merge_extra_ms`): without this term, a merging model of fmnist-vit ran
+49% slower than its table predicted (docs/tokens.md). Blocks after a merge that merge nothing (a class-token last
block, the tail of a ``decreasing`` schedule) are priced as plain ones. Tables without the entry price the merge at
0 (as before).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from edgeprune.latency.measure import TimingSettings, Timer, attn_subblock, mlp_subblock
from edgeprune.latency.table import LatencyTable
from edgeprune.tokens.attention import proportional_attention
from edgeprune.tokens.merge import bipartite_soft_matching, merge_wavg, split_sizes

#: the axis's entries: the dense MLP / attention sub-block at one more token count; the merging attention sub-block
#: at every count (module doc)
TOKEN_KINDS = ("tokens_mlp", "tokens_attn", "tokens_merge")


def add_axis(t: LatencyTable, counts: list[int]) -> None:
    """Give the (fresh) table ``t`` an unmeasured token axis at ``counts`` (ascending, below ``key.tokens``);
    nothing for no counts (the table is then written exactly as without the axis)."""
    if not counts:
        return
    t.tokens = {"counts": [*counts, int(t.key["tokens"])],
                **{p: [math.nan] * len(counts) + [1.0] for p in ("mlp", "attn")},
                "merge": [math.nan] * (len(counts) + 1)}
    t.measured.update(tokens_mlp=[], tokens_attn=[], tokens_merge=[])


def merge_r(n: int, prefix: int) -> int:
    """The merges of the timed merge step at ``n`` tokens: ``max(1, (n - prefix) // 8)``, at most what n allows."""
    return max(0, min(split_sizes(n, prefix)[1], max(1, (n - prefix) // 8)))


class MergeAttnSubBlock(nn.Module):
    """A merging block's attention half: ``x + ls1(attn_prop(norm1(x), s))``, then ``merge_r`` of the result on the
    keys (ToMe; :mod:`edgeprune.tokens`): (B, n, D) -> (B, n - r, D). The sizes ``s`` are fixed (1, 2, 3, 1, 2, 3,
    ...), as after an earlier merge."""

    def __init__(self, sub: nn.Module, n: int, prefix: int) -> None:
        super().__init__()
        self.norm, self.attn, self.ls = sub.norm, sub.attn, sub.ls
        self.n, self.prefix, self.r = int(n), int(prefix), merge_r(n, prefix)
        self.register_buffer("size", (1.0 + torch.arange(self.n) % 3).reshape(1, self.n, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.size.expand(x.shape[0], -1, -1)
        out, metric = proportional_attention(self.attn, self.norm(x), size, None, self.n)
        x = x + self.ls(out)
        x, _size = merge_wavg(x, size, bipartite_soft_matching(metric, self.r, self.prefix, self.n))
        return x


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
    ref = "attn" if part == "merge" else part  # the merge step is timed against the dense attention at N
    module = dense_module(anatomy, t.key, ref)
    if part == "merge":
        module = MergeAttnSubBlock(module, n, int(getattr(anatomy.vit, "num_prefix_tokens", 0))).eval()
    if refs is not None:
        got = refs.measure(ref, module, (batch, n, D))
        ratio = got.value
    else:
        got = timer.measure(module, (batch, n, D), s)
        ratio = got.value / timer.measure(dense_module(anatomy, t.key, ref), (batch, N, D), s).value
    assert t.tokens is not None
    if part == "merge" and "merge" not in t.tokens:  # a partial table of an older build: the entry added
        t.tokens["merge"] = [math.nan] * len(t.tokens["counts"])
    t.tokens[part][t.tokens["counts"].index(n)] = float(ratio)
    t.measured.setdefault(kind, []).append(n)
    return got


__all__ = ["TOKEN_KINDS", "MergeAttnSubBlock", "add_axis", "counts_of", "dense_module", "merge_r", "time_tokens"]
