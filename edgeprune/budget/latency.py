"""The ``latency`` budget kind (issue 30): a cost model read from a measured latency table.

``--latency 0.5 --latency-table t.json`` (a fraction of the table's dense latency) or
``--latency 12ms`` (absolute milliseconds per batch of the table's ``key["batch"]`` images) is a
budget ``{"kind": "latency", "value": v[, "unit": "ms"], "table": path}`` that goes through the same
parser, checks and allocator as ``--flops`` / ``--params`` (``edgeprune.budget.parse``,
``edgeprune.allocation.greedy``): only the prices differ.

* ``block_cost(b, dims)`` = ``table.block_total(dims)`` = ``block_scale x block_ms(dims) +
  block_overhead_ms``: the MLP sub-block at the kept width plus the attention sub-block at (kept
  heads, Q/K dim, V dim), interpolated between the measured grid points
  (:class:`edgeprune.latency.table.LatencyTable`), corrected by the measured per-block terms of what
  the sub-blocks timed apart miss (issue 40; 1 and 0 in tables built before it, which therefore
  price exactly as before), and, where the table measured it, ``x (1 + table.shape_change)`` for a pruned
  block after the first (issue 52, :mod:`edgeprune.latency.shape_change`: a block that changes shape costs more);
* ``fixed_cost()`` = ``table.fixed_ms`` (patch embedding, position embedding, final norm, head).

A table whose self-check missed and was kept with ``--force`` is *unverified*: the record says so
(``unverified``) and ``prune`` prints it (``edgeprune.budget.latency_check.latency_report``).

A block that computes only its first T tokens (the class-token last block,
``edgeprune.layers.class_token_block``) is not in the table (it times full blocks): its time is
estimated as the full block's times the ratio of its FLOPs with T query tokens to its FLOPs with
every token (:func:`edgeprune.flops.block_flops`; an estimate, said in the record).

Token merging (issue 44 item 3, ``--tokens-merge`` with ``--latency``): a block that receives n_i tokens and merges
r_i of them between its attention and its MLP is priced with its attention sub-block at n_i tokens and its MLP at
n_i - r_i (``LatencyTable.block_total(dims, tokens, mlp_tokens)``: the full-count entry times the table's token-axis
ratio, :mod:`edgeprune.latency.token_axis`); the counts come from the merged model's anatomy (``merge_r``) or, before
the merge, from the schedule the budget carries (``Budget.tokens_merge``,
:func:`edgeprune.tokens.schedule.plan_merges`).
A table without a token axis, or whose axis does not reach the smallest count, is refused in one line naming the
table and the counts. The merge step itself is not in the table (its cost is left to the measure-and-correct loop).

The table also carries the device profile's pruning rules (``rules``: ``mlp_round_to``,
``head_dim_round_to``, ``qk_equals_v``); the allocator reads them from :attr:`LatencyCost.rules`
(candidate sizes on those grids, Q/K tied to V) and the grid's smallest measured sizes from
:meth:`LatencyCost.bounds` (no candidate below them: the table does not extrapolate).
"""

from __future__ import annotations

import os
from typing import Any

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.budget.base import CostModel
from edgeprune.budget.registry import register_cost_model
from edgeprune.errors import UserError
from edgeprune.flops import block_flops, block_tokens, with_dims
from edgeprune.latency.table import LatencyTable
from edgeprune.backbone import is_vit
from edgeprune.tokens.schedule import plan_merges

#: the one-line error of a latency budget without a table
MISSING_TABLE = ("--latency needs a latency table of this model on the target device: make one with "
                 "`edgeprune latency-table --model MODEL --device PROFILE -o TABLE.json` (on the device) "
                 "and pass --latency-table TABLE.json")

_CACHE: dict[tuple[str, int], LatencyTable] = {}


def load_table(path: str) -> LatencyTable:
    """The table at ``path``, loaded once per file version (path, mtime).

    Raises:
        UserError: a missing, unreadable or malformed table (:meth:`LatencyTable.load`).
    """
    full = os.path.abspath(os.fspath(path))
    try:
        stamp = os.stat(full).st_mtime_ns
    except OSError:
        raise UserError(f"latency table {path} not found ({MISSING_TABLE[len('--latency needs '):]})") from None
    if (full, stamp) not in _CACHE:
        _CACHE[(full, stamp)] = LatencyTable.load(full)
    return _CACHE[(full, stamp)]


@register_cost_model("latency")
class LatencyCost(CostModel):
    """Predicted latency (ms per batch of ``table.key["batch"]`` images) from a latency table.

    Args:
        anatomy: the dense model (checked against the table's key: one-line UserError if another shape).
        query_tokens: ``{block index: T}`` for blocks computing only their first T tokens (module doc).
        budget: the :class:`~edgeprune.budget.Budget`; ``budget.table`` is the table's path.

    Raises:
        UserError: no table (:data:`MISSING_TABLE`), a missing / malformed table, or a table of
            another model shape.
    """

    unit = "ms"            # absolute latency budgets are written 12ms (edgeprune.budget.parse)
    needs_table = True     # the budget carries the table's path
    missing_table = MISSING_TABLE
    allocates_heads = True  # whole heads are units beside head dims (edgeprune.allocation.rules)
    prices_sliced_models = False  # the table is measured at the dense embed dim
    verifiable = True      # the table's backend can bench the pruned model (edgeprune.prune.latency_check)

    def __init__(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None, *,
                 budget: Any = None) -> None:
        super().__init__(anatomy, query_tokens)
        if budget is None or not budget.table:
            raise UserError(MISSING_TABLE)
        self.path = str(budget.table)
        self.table = load_table(self.path)
        self.table.check_model(anatomy)
        self.n = anatomy.num_tokens
        self._rules = dict(self.table.rules)
        self.tokens = self._merged_tokens(anatomy, budget)

    @property
    def rules(self) -> dict[str, Any]:
        """The table's pruning rules (``mlp_round_to``, ``head_dim_round_to``, ``qk_equals_v``)."""
        return self._rules

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        """ms of block ``b`` at kept ``dims``: the table's sub-blocks plus its per-block overhead (a class-token
        block: that, times its FLOPs ratio; module doc). Remembered per block and dims (the greedy allocation asks
        for the same few hundred prices ~10^5 times per prune: issue 40's repeated work; :meth:`remembered`)."""
        return self.remembered(b, dims, lambda: self._block_cost(b, dims))

    def _block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        """:meth:`block_cost`, computed."""
        merged = getattr(self, "tokens", None)  # None: no merging, priced bit for bit as before
        if merged is None:
            ms = self.table.block_total(dims)  # issue 40; a table without its terms prices bit for bit as before
        else:
            ms = self.table.block_total(dims, *merged[b.index])
        ms *= self._shape_change(b, dims)
        t = self.query_tokens.get(b.index)
        if t is None:
            return ms
        n = self.n if merged is None else merged[b.index][0]
        full = with_dims(b, dims, None)
        return ms * float(block_flops(with_dims(b, dims, t), n)["total"]) / float(block_flops(full, n)["total"])

    def _shape_change(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        """``1 + table.shape_change`` for a pruned block after the first, else 1 (:mod:`edgeprune.latency.shape_change`:
        a block whose dims differ from the previous block's costs that much more). The allocator prices a block
        alone, without its neighbours, so a pruned block is taken to differ from the one before it -- what an
        allocation that cuts every block its own way does; a run of equally cut blocks (the uniform candidate) is
        priced up to that factor high, which the measured correction of ``prune --latency`` takes back."""
        factor = self.table.shape_change
        dense = self.table.dense_dims()
        if not factor or b.index == 0 or all(int(dims[k]) == dense[k] for k in dense):
            return 1.0
        return 1.0 + float(factor)

    def _merged_tokens(self, anatomy: ViTAnatomy, budget: Any) -> list[tuple[int, int]] | None:
        """Per block ``(tokens its attention sees, tokens its MLP sees)`` of a merging model (the anatomy's
        ``merge_r``, else the budget's schedule; a network with a ViT inside merges inside each block and unmerges:
        both at n - r, the merges' own time not in the table); None without merging.

        Raises:
            UserError: merging, and the table has no token axis or one that does not cover the counts (one line
                naming the table and the counts).
        """
        unmerge = not is_vit(anatomy.model)  # a network: merged inside each block, unmerged (tokens.unmerge)
        if any(b.merge_r for b in anatomy.blocks):
            n, r = block_tokens(anatomy), [b.merge_r for b in anatomy.blocks]
        elif getattr(budget, "tokens_merge", None) is not None:
            prefix = int(getattr(anatomy.vit, "num_prefix_tokens", 0))
            cls_last = anatomy.blocks[-1].index in self.query_tokens and not unmerge
            r, n = plan_merges(budget.tokens_merge, len(anatomy.blocks), self.n, prefix, cls_last, unmerge)
        else:
            return None
        if not any(r):
            return None
        # attention and MLP tokens: a classifier merge between them; an unmerging block runs both on n - r
        pairs = [(int(a - b) if unmerge else int(a), int(a - b)) for a, b in zip(n, r)]
        need = sorted({x for p in pairs for x in p} - {self.n})
        axis = self.table.tokens
        if axis is None or need[0] < axis["counts"][0]:
            have = "no token axis" if axis is None else f"a token axis from {axis['counts'][0]} tokens"
            raise UserError(f"--tokens-merge with a --latency budget: latency table {self.path} has {have}, the "
                            f"merged blocks run at {need[0]}..{need[-1]} tokens (rebuild it with edgeprune "
                            f"latency-table ... --tokens {_suggest(need[0], self.n)})")
        return pairs

    def fixed_cost(self) -> float:
        return float(self.table.fixed_ms)

    def bounds(self) -> dict[str, int]:
        """The smallest kept size the table measured per module (``mlp``, ``qk``, ``v``, ``heads``)."""
        a = self.table.attn
        return {"mlp": int(min(self.table.mlp["widths"])), "qk": int(min(a["qk"])), "v": int(min(a["v"])),
                "heads": int(min(a["heads"]))}

    def record(self) -> dict[str, Any]:
        """What the run record says about the table: path, key, rules, dense latencies (ms)."""
        return {"table": self.path, "key": dict(self.table.key), "rules": dict(self.rules),
                "dense_predicted_ms": self.table.dense_ms(), "dense_measured_ms": float(self.table.dense_model_ms),
                "unit": "ms per batch of key.batch images", "block_overhead_ms": float(self.table.block_overhead_ms),
                "block_scale": float(self.table.block_scale),
                "self_check": _check_summary(self.table), "unverified": self.table.unverified,
                **({"tokens": [list(p) for p in self.tokens]} if self.tokens is not None else {}),
                "class_token_blocks": ("estimated: full block x FLOPs ratio with the class token only"
                                       if self.query_tokens else None)}

    @classmethod
    def check_inputs(cls, budget: Any) -> None:
        """Loads the table (a missing or malformed one: one line, before the model is built)."""
        load_table(budget.table)

    @classmethod
    def check_tokens_merge(cls, budget: Any) -> None:
        """A ``--tokens-merge`` schedule goes with this budget only when its table has a token axis (which counts
        it must cover is checked with the model: :meth:`_merged_tokens`).

        Raises:
            UserError: a missing / malformed table, or one without a token axis (one line naming it).
        """
        cls.check_table_tokens_merge(budget.table)

    @staticmethod
    def check_table_tokens_merge(path: Any) -> None:
        """:meth:`check_tokens_merge` of the latency table at ``path`` (before a budget is built: ``deploy``).

        Raises:
            UserError: a missing / malformed table, or one without a token axis (one line naming it).
        """
        table = load_table(path)
        if table.tokens is None:
            raise UserError(f"--tokens-merge with a --latency budget: latency table {path} has no token axis "
                            f"(it timed blocks at {table.key['tokens']} tokens only), so it cannot price the merged "
                            "blocks: rebuild it with edgeprune latency-table ... --tokens N1,N2,... (docs/tokens.md)")

    @classmethod
    def config_defaults(cls, budget: Any) -> dict[str, Any]:
        """The fused layout (Q/K dims = V dims) when the table's profile rule ``qk_equals_v`` is set; ``{}``
        otherwise.

        Raises:
            UserError: a missing / malformed table.
        """
        return {"layout": "fused"} if load_table(budget.table).rules.get("qk_equals_v") else {}


def _suggest(low: int, full: int) -> str:
    """A ``--tokens`` value covering ``low..full``: four counts evenly spaced from ``low``."""
    return ",".join(str(low + (full - low) * i // 4) for i in range(4))


def _check_summary(table: LatencyTable) -> dict[str, Any] | None:
    """The table's self-check for the run record: passed / forced and each model's predicted / measured ms (None
    for a table built before the self-check)."""
    chk = table.meta.get("self_check")
    if not chk:
        return None
    return {"passed": bool(chk["passed"]), "forced": bool(chk.get("forced", False)), "tolerance": chk["tolerance"],
            "models": [{"name": m["name"], "predicted_ms": m["predicted_ms"], "measured_ms": m["measured_ms"]}
                       for m in chk["models"]]}
