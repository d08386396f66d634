"""Which kept sizes the budgeted allocation may choose: the candidate grid per module.

With ``--flops`` / ``--params`` every module's candidates are the multiples of ``--round-to`` (and
the dense size), whole heads are a unit only with ``--target heads``. A cost model may carry the
pruning rules of the device it prices (the ``latency`` kind: its table's profile, issue 30 item 3):

* ``rules = {"mlp_round_to": r_m, "head_dim_round_to": r_h, "qk_equals_v": bool}``: MLP widths on
  multiples of r_m, Q/K and V head dims on multiples of r_h (they replace ``--round-to``), Q/K tied
  to V (the fused layout, which ``edgeprune.allocation.latency_cost.config_defaults`` sets);
* ``bounds()``: the smallest measured size per module (no candidate below it: the table does not
  extrapolate);
* ``allocates_heads = True`` (class attribute): whole heads are one more unit per block beside the
  MLP width and head dims when the target is ``all`` or ``v`` (``CorpConfig.allocate_heads``:
  None = this default, True / False to force), so the allocator chooses among removing heads,
  shrinking head dims and shrinking MLP widths by their measured errors and the table's times
  (``--target heads`` keeps heads the only attention unit).
"""

from __future__ import annotations

import dataclasses

from edgeprune.allocation.cost import COST_MODELS, cost_model
from edgeprune.allocation.curves import Curve
from edgeprune.errors import UserError
from edgeprune.plan import target_modules

#: targets whose statistics (proj-input, V/O) let whole heads be allocated beside head dims
HEAD_TARGETS = ("all", "v")


def budget_cost(cfg, anatomy, query_tokens: dict[int, int] | None = None):
    """The cost model of ``cfg.budget`` (given the budget itself: a latency table's path)."""
    return cost_model(cfg.budget["kind"], anatomy, query_tokens, budget=cfg.budget)


def heads_allocated(cfg) -> bool:
    """Whether whole heads are an allocation unit beside the target's modules (module doc)."""
    budget = getattr(cfg, "budget", None)
    if budget is None or cfg.target == "heads":
        return False
    forced = getattr(cfg, "allocate_heads", None)
    if forced is not None:
        return bool(forced)
    return cfg.target in HEAD_TARGETS and bool(getattr(COST_MODELS.get(budget["kind"]), "allocates_heads", False))


def check_heads_setting(cfg) -> None:
    """``allocate_heads=True`` needs a budget and a target with V/O statistics.

    Raises:
        UserError: one line saying what is missing.
    """
    if getattr(cfg, "allocate_heads", None) and (cfg.budget is None or cfg.target not in HEAD_TARGETS + ("heads",)):
        raise UserError("allocating whole heads needs a budget and --target all or v (their V/O statistics "
                        f"rank the heads), got target {cfg.target!r}" + ("" if cfg.budget else " and no budget"))


@dataclasses.dataclass
class Grid:
    """Candidate grid of one allocation: rounding and smallest size per module key, the rules."""

    round_to: dict[str, int]
    lower: dict[str, int]
    rules: dict | None

    def sizes(self, key: str, dense: int) -> list[int]:
        """Candidate kept sizes of module ``key`` of dense size ``dense``: multiples of its
        rounding (and ``dense``), none below its lower bound."""
        r = self.round_to[key]
        ks = list(range(r, dense + 1, r))
        if not ks or ks[-1] != dense:
            ks.append(dense)
        return [k for k in ks if k >= self.lower.get(key, 0)] or [dense]

    def restrict(self, c: Curve) -> Curve:
        """``c`` without its candidates below the lower bound of its modules (the same object when none)."""
        lo = max(self.lower.get(k, 0) for k in c.keys)
        keep = [i for i, k in enumerate(c.ks) if k >= lo] or [len(c.ks) - 1]
        if len(keep) == len(c.ks):
            return c
        return dataclasses.replace(c, ks=[c.ks[i] for i in keep], raw=[c.raw[i] for i in keep])

    def describe(self) -> dict:
        """For the report: the rules applied and the resulting grid."""
        return {"rules": self.rules, "round_to": dict(self.round_to), "smallest": dict(self.lower)}


def unit_grid(cfg, anatomy, cost=None) -> Grid:
    """The candidate grid under ``cfg`` (``cost``: the budget's cost model, built when None)."""
    if cost is None and cfg.budget is not None and getattr(COST_MODELS.get(cfg.budget["kind"]), "needs_table", False):
        cost = budget_cost(cfg, anatomy)
    rules = getattr(cost, "rules", None)
    r = cfg.round_to
    round_to = {"mlp": r, "qk": r, "v": r, "heads": 1}
    if rules:
        round_to.update(mlp=int(rules.get("mlp_round_to", r)), qk=int(rules.get("head_dim_round_to", r)),
                        v=int(rules.get("head_dim_round_to", r)))
    lower = cost.bounds() if hasattr(cost, "bounds") else {}
    return Grid(round_to, dict(lower), dict(rules) if rules else None)


def check_rules(cfg, grid: Grid) -> None:
    """The config agrees with the rules: Q/K = V rules need the fused layout.

    Raises:
        UserError: one line naming the option.
    """
    attention = set(target_modules(cfg.target)) & {"qk", "v"}
    if grid.rules and grid.rules.get("qk_equals_v") and cfg.layout != "fused" and attention:
        raise UserError("this latency table's device needs Q/K dims = V dims (fused attention, its profile's "
                        "rule qk_equals_v): use --layout fused")
