"""Budget: turn a FLOPs (or params) budget into per-block dims (nuwa §3.3, suppl. §6, 9, 11).

The budget is parsed as ``edgeprune prune`` parses it (a fraction of the base model or an absolute
count, :mod:`edgeprune.allocation.budget`) and priced by the same registered cost model
(:mod:`edgeprune.allocation.cost`, wrapped by :class:`PlanCost`): FLOPs are
:func:`edgeprune.flops.block_flops` (NuWa's suppl. eq. 13, counted as 2 x MACs) plus patch
embedding and head; params count every weight and bias (:func:`edgeprune.flops.block_params`).
Both are affine in each block's MLP width, which makes the MLP allowance a closed form:

1. For a retained-energy ratio rho, OFP-MHA fixes every layer's (qk_dim, v_dim)
   (:func:`edgeprune.nuwa.ofp_mha.layer_dims`).
2. Everything except the MLP neurons then has a known cost; the rest of the budget buys
   ``floor(rest / cost_per_neuron)`` MLP neurons, spread uniformly
   (:func:`edgeprune.nuwa.ofp_mlp.uniform_mlp_dims`).

:func:`plan_candidates` does this for a grid of rho values (by default adapted to the spectra:
:func:`rho_candidates`) and drops dominated ones (once the MLPs
reach their SKP-anchor caps, pruning attention further buys nothing). The derivation then picks the
candidate with the best held-out accuracy (``edgeprune.nuwa.derive``). A budget that cannot be met
even with every dim at ``round_to`` is a :class:`UserError`.
"""

from __future__ import annotations

import dataclasses
import math

import torch.nn as nn

from edgeprune.allocation.budget import is_fraction, target_cost
from edgeprune.allocation.cost import COST_MODELS, cost_model, dense_cost
from edgeprune.anatomy import ViTAnatomy, find_anatomy
from edgeprune.errors import UserError
from edgeprune.nuwa.ofp_mha import BlockFactors, energy_ratios, layer_dims, retained_energy
from edgeprune.nuwa.ofp_mlp import uniform_mlp_dims

DEFAULT_NUM_RHO = 16
#: derive refuses budget kinds priced by a measured table (issue 30): its MLP fill is a closed form
LATENCY_NOT_SUPPORTED = ("derive does not take latency budgets yet (NuWa's MLP fill assumes a cost linear in "
                         "the MLP width): use --flops or --params, or `edgeprune prune --latency`")


def rho_candidates(factors: list[BlockFactors], n: int = DEFAULT_NUM_RHO, round_to: int = 8) -> list[float]:
    """Adaptive rho grid: the retained-energy levels at which some layer's dim changes.

    Every layer's qk and vo spectrum has a retained energy at each multiple of ``round_to``; these
    levels are exactly the rho values where :func:`layer_dims` changes (and they crowd near 1 for
    trained attention, e.g. 0.995 at rank 8 of 64). ``n`` of them, evenly spaced in rank order,
    plus 1.0 (no attention pruning) and 0.0 (every dim at ``round_to``) form the grid.
    """
    levels = set()
    for f in factors:
        for s in (f.qk_s, f.vo_s):
            r = energy_ratios(s)
            for k in range(round_to, r.numel(), round_to):
                levels.add(round(float(r[k - 1]), 12))
    levels.discard(1.0)
    lv = sorted(levels, reverse=True)
    if len(lv) > n:
        lv = [lv[round(i * (len(lv) - 1) / (n - 1))] for i in range(n)] if n > 1 else lv[:1]
    return [1.0, *lv, 0.0]


@dataclasses.dataclass
class Plan:
    """Per-block dims for one rho.

    Attributes:
        rho: retained energy ratio; qk, vo, mlp: per-block dims;
        cost: the plan's cost in the budget's kind; energy_qk, energy_vo: per-layer mean
        retained energy.
    """

    rho: float
    qk: list[int]
    vo: list[int]
    mlp: list[int]
    cost: int
    energy_qk: list[float]
    energy_vo: list[float]

    def key(self) -> tuple:
        return tuple(self.qk), tuple(self.vo), tuple(self.mlp)

    def to_record(self) -> dict:
        return dataclasses.asdict(self)


def _exact(x: float) -> int | float:
    """A whole-number cost as an int (FLOPs and params: the plans' costs and the MLP arithmetic
    stay integers), any other cost as it is."""
    return int(x) if float(x).is_integer() else float(x)


class PlanCost:
    """NuWa's view of a registered budget cost model (:mod:`edgeprune.allocation.cost`, the one
    prune's allocator uses): the cost of the model in ``anatomy`` with per-block (qk, vo, mlp) dims
    replaced, every block keeping its heads.

    Args:
        anatomy: the model whose fixed parts (embedding, norms, head -- after head slicing) count.
        kind: a registered budget kind ("flops", "params", ...).

    Raises:
        UserError: unknown kind, or a kind priced by a measured table (latency: not supported yet).
    """

    def __init__(self, anatomy: ViTAnatomy, kind: str) -> None:
        if getattr(COST_MODELS.get(kind), "needs_table", False):
            raise UserError(LATENCY_NOT_SUPPORTED)
        self.anatomy, self.kind = anatomy, kind
        self.model = cost_model(kind, anatomy)
        self.fixed = _exact(self.model.fixed_cost())

    def block(self, i: int, qk: int, vo: int, mlp: int) -> int | float:
        """Cost of block i with the given dims."""
        b = self.anatomy.blocks[i]
        return _exact(self.model.block_cost(b, {"heads": b.num_heads, "qk": qk, "v": vo, "mlp": mlp}))

    def total(self, qk: list[int], vo: list[int], mlp: list[int]) -> int | float:
        return self.fixed + sum(self.block(i, q, v, m) for i, (q, v, m) in enumerate(zip(qk, vo, mlp)))

    def per_neuron(self, i: int) -> int | float:
        """Cost of one more MLP channel in block i (the same in every block of a plain ViT)."""
        return self.block(i, 8, 8, 1) - self.block(i, 8, 8, 0)


def measure(model: nn.Module, kind: str) -> int | float:
    """The model's actual cost in the units of budget kind ``kind`` (for flops and params:
    ``edgeprune.flops.model_flops`` / ``count_params``)."""
    return _exact(dense_cost(kind, find_anatomy(model)))


def budget_target(budget: dict, dense: int | float) -> int:
    """The absolute budget of a derivation: ``floor(value x dense)`` for a fraction, ``floor(value)``
    for a count (:func:`edgeprune.allocation.budget.target_cost`)."""
    return int(math.floor(target_cost(budget, dense)))


def keep_fraction(budget: dict, dense: int | float) -> float:
    """The budget as a fraction of the base model (the value itself when it is one)."""
    v = float(budget["value"])
    return v if is_fraction(budget) else v / dense


def mlp_caps(anchor_sizes: list[int], round_to: int = 8) -> list[int]:
    """Most channels OFP may keep per block: the anchor's size floored to ``round_to`` (min
    ``round_to``)."""
    return [max(round_to, (a // round_to) * round_to) for a in anchor_sizes]


def plan_for_dims(cost: PlanCost, qk: list[int], vo: list[int], caps: list[int], budget: int,
                  round_to: int = 8) -> tuple[list[int], int] | None:
    """MLP dims that fill ``budget`` given attention dims, or None if infeasible."""
    attn_only = cost.total(qk, vo, [0] * len(qk))
    per = cost.per_neuron(0)
    if any(cost.per_neuron(i) != per for i in range(len(qk))):
        raise ValueError("blocks differ in the cost of an MLP neuron")  # not for plain ViTs
    rest = budget - attn_only
    if rest < 0:
        return None
    mlp = uniform_mlp_dims(caps, int(rest // per), round_to)
    if mlp is None:
        return None
    return mlp, cost.total(qk, vo, mlp)


def minimum_cost(cost: PlanCost, round_to: int = 8) -> int:
    """Cost with every qk/v/mlp dim at ``round_to`` (the smallest model NuWa can derive)."""
    L = len(cost.anatomy.blocks)
    return cost.total([round_to] * L, [round_to] * L, [round_to] * L)


def check_feasible(cost: PlanCost, budget: int, dense_cost: int, round_to: int = 8) -> None:
    """Raises UserError when even the smallest derivable model exceeds the budget."""
    low = minimum_cost(cost, round_to)
    if low > budget:
        raise UserError(
            f"the {cost.kind} budget {budget / dense_cost:.3g} of the base model cannot be met with dims "
            f"that are multiples of {round_to}: the smallest derivable model keeps "
            f"{low / dense_cost:.3f}; raise --{cost.kind}")


def plan_candidates(cost: PlanCost, factors: list[BlockFactors], caps: list[int], budget: int,
                    rho_grid: tuple[float, ...] | list[float] | None = None,
                    round_to: int = 8) -> list[Plan]:
    """Feasible, distinct, non-dominated plans for the rho values of ``rho_grid`` (descending;
    None = :func:`rho_candidates`).

    Raises:
        UserError: no rho in the grid gives a feasible plan.
    """
    if rho_grid is None:
        rho_grid = rho_candidates(factors, round_to=round_to)
    plans: list[Plan] = []
    seen = set()
    for rho in sorted(set(float(r) for r in rho_grid), reverse=True):
        qk, vo = layer_dims(factors, rho, round_to)
        res = plan_for_dims(cost, qk, vo, caps, budget, round_to)
        if res is None:
            continue
        mlp, total = res
        plan = Plan(rho=rho, qk=qk, vo=vo, mlp=mlp, cost=total,
                    energy_qk=[retained_energy(f.qk_s, q) for f, q in zip(factors, qk)],
                    energy_vo=[retained_energy(f.vo_s, v) for f, v in zip(factors, vo)])
        if plan.key() in seen:
            continue
        seen.add(plan.key())
        plans.append(plan)
        if mlp == caps:
            break  # MLPs are at the anchor: lower rho would only prune attention for nothing
    if not plans:
        grid = sorted(set(float(r) for r in rho_grid), reverse=True)
        if len(grid) == 1:
            raise UserError(f"--rho {grid[0]:g} leaves too little of the {cost.kind} budget for the MLPs "
                            f"(each needs >= {round_to} channels); lower --rho or raise the budget")
        raise UserError(f"no retained-energy ratio in the grid ({len(grid)} values, {grid[0]:g} .. {grid[-1]:g}) "
                        f"meets the {cost.kind} budget; include lower values or raise the budget")
    return plans
