"""Which kept sizes the budgeted allocation may choose: the candidate grid per module.

With ``--flops`` / ``--params`` every module's candidates are the multiples of ``--round-to`` (and
the dense size), whole heads are a unit only with ``--target heads``. A cost model may carry the
pruning rules of the device it prices (the ``latency`` kind: its table's profile, issue 30 item 3):

* ``rules = {"mlp_round_to": r_m, "head_dim_round_to": r_h, "qk_equals_v": bool}``: MLP widths on
  multiples of r_m, Q/K and V head dims on multiples of r_h (they replace ``--round-to``), Q/K tied
  to V (the fused layout, which ``LatencyCost.config_defaults`` sets, ``edgeprune.budget.latency``);
* ``rules["head_dims"]`` (GPU profiles, issue 40 item 6): the head dims the device's fused attention kernels
  take at the table's precision (TensorRT: multiples of 8 in [16, 256] in fp16, 16 / 32 / 64 in int8;
  :mod:`devices.kernels`): Q/K and V candidates are the multiples of r_h in that set (and the dense dim), so the
  fused tie (one dim for Q/K and V) lands in it too;
* ``bounds()``: the smallest measured size per module (no candidate below it: the table does not
  extrapolate);
* ``allocates_heads = True`` (class attribute of the cost model, ``edgeprune.budget.base.CostModel``): whole heads
  are one more unit per block beside the
  MLP width and head dims when the target is ``all`` or ``v`` (``CorpConfig.allocate_heads``:
  None = this default, True / False to force), so the allocator chooses among removing heads,
  shrinking head dims and shrinking MLP widths by their measured errors and the table's times
  (``--target heads`` keeps heads the only attention unit).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from devices.kernels import allowed_head_dims, describe_allowed, keep_allowed
from edgeprune.allocation.curves import Curve
from edgeprune.layers.class_token_block import class_token_plan
from edgeprune.errors import UserError
from edgeprune.plan import target_modules

if TYPE_CHECKING:
    from edgeprune.corp.config import CorpConfig

#: targets whose statistics (proj-input, V/O) let whole heads be allocated beside head dims
HEAD_TARGETS = ("all", "v")


def heads_allocated(cfg: "CorpConfig") -> bool:
    """Whether whole heads are an allocation unit beside the target's modules (module doc)."""
    if cfg.budget is None or cfg.target == "heads":
        return False
    if cfg.allocate_heads is not None:
        return bool(cfg.allocate_heads)
    return cfg.target in HEAD_TARGETS and bool(cfg.budget.model_class.allocates_heads)


def check_heads_setting(cfg: "CorpConfig") -> None:
    """``allocate_heads=True`` needs a budget and a target with V/O statistics.

    Raises:
        UserError: one line saying what is missing.
    """
    if cfg.allocate_heads and (cfg.budget is None or cfg.target not in HEAD_TARGETS + ("heads",)):
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
        rounding (and ``dense``), none below its lower bound; for ``"qk"`` / ``"v"`` only the head
        dims the rules allow (:attr:`head_dims`; the dense dim always stays)."""
        r = self.round_to[key]
        ks = list(range(r, dense + 1, r))
        if not ks or ks[-1] != dense:
            ks.append(dense)
        if key in ("qk", "v"):
            ks = keep_allowed(ks, dense, self.head_dims)
        return [k for k in ks if k >= self.lower.get(key, 0)] or [dense]

    @property
    def head_dims(self) -> tuple[int, ...] | None:
        """The head dims the rules allow (``rules["head_dims"]``), None: any multiple of the rounding."""
        return allowed_head_dims(self.rules)

    def where(self) -> str:
        """For messages: ``"on the latency table's grid {...}"`` plus the allowed head dims, if any."""
        allowed = self.head_dims
        extra = f" with head dims in {{{describe_allowed(allowed)}}} (fused attention)" if allowed else ""
        return f"on the latency table's grid {self.round_to}{extra}"

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


def unit_grid(cfg: "CorpConfig", anatomy, cost=None) -> Grid:
    """The candidate grid under ``cfg`` (``cost``: the budget's cost model, ``cfg.budget``'s when None -- built with
    the config's class-token plan, as the allocation prices the model: a merging budget's last block then merges
    nothing, as in the pruned model; without a budget the config's rounding alone)."""
    if cost is None and cfg.budget is not None:
        cost = cfg.budget.cost_model(anatomy, class_token_plan(cfg, anatomy))
    rules = cost.rules if cost is not None else None
    r = cfg.round_to
    round_to = {"mlp": r, "qk": r, "v": r, "heads": 1}
    if rules:
        round_to.update(mlp=int(rules.get("mlp_round_to", r)), qk=int(rules.get("head_dim_round_to", r)),
                        v=int(rules.get("head_dim_round_to", r)))
    lower = cost.bounds() if cost is not None else {}
    allowed_head_dims(rules)  # a malformed rules.head_dims: one line here, before any work
    return Grid(round_to, dict(lower), dict(rules) if rules else None)


def check_rules(cfg: "CorpConfig", grid: Grid) -> None:
    """The config agrees with the rules: Q/K = V rules need the fused layout.

    Raises:
        UserError: one line naming the option.
    """
    attention = set(target_modules(cfg.target)) & {"qk", "v"}
    if grid.rules and grid.rules.get("qk_equals_v") and cfg.layout != "fused" and attention:
        raise UserError("this latency table's device needs Q/K dims = V dims (fused attention, its profile's "
                        "rule qk_equals_v): use --layout fused")
