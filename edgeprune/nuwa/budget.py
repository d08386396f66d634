"""Budget: turn a FLOPs (or params) budget into per-block dims (nuwa §3.3, suppl. §6, 9, 11).

The budget is parsed as ``edgeprune prune`` parses it (a fraction of the base model or an absolute
count, :mod:`edgeprune.budget.parse`) and priced by the same registered cost model
(:mod:`edgeprune.budget`, wrapped by :class:`PlanCost`): FLOPs are
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

**Measured costs (latency, issue 30).** A cost model that ``needs_table`` (``latency``: a measured,
interpolated table, :mod:`edgeprune.budget.latency`) is not affine in the MLP width, so
step 2 has no closed form. :func:`search_mlp_dims` fills by search instead: it tries every level of
the same water-filling shape (:func:`~edgeprune.nuwa.ofp_mlp.uniform_mlp_dims` of ``u x round_to``
neurons for u = depth .. sum of the caps' units) and keeps the largest level whose total cost is <=
the budget -- a linear scan, with no assumption that the cost grows with the level. Block costs are
memoised per (block, width), so one plan costs at most ``sum(caps) / round_to`` table look-ups.
The table's rules (:func:`dim_grid`) set the grids: MLP widths on ``mlp_round_to``, Q/K and V dims
on ``head_dim_round_to`` (both replace ``round_to``), none below the smallest measured size; with
``qk_equals_v`` a layer's Q/K and V dims are both the larger of its two OFP dims (the smaller is
raised rather than the larger cut: more retained energy, and the table's budget decides). Every
block keeps all its heads (NuWa truncates head dims; whole heads are not derive's units). FLOPs and
params keep the closed form, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import torch.nn as nn

from devices.kernels import allowed_head_dims
from edgeprune.budget import Budget
from edgeprune.anatomy import ViTAnatomy, find_anatomy
from edgeprune.errors import UserError
from edgeprune.nuwa.ofp_mha import BlockFactors, energy_ratios, layer_dims, retained_energy
from edgeprune.nuwa.ofp_mlp import uniform_mlp_dims

DEFAULT_NUM_RHO = 16


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
    """NuWa's view of a registered budget cost model (:mod:`edgeprune.budget`, the one
    prune's allocator uses): the cost of the model in ``anatomy`` with per-block (qk, vo, mlp) dims
    replaced, every block keeping its heads.

    Args:
        anatomy: the model whose fixed parts (embedding, norms, head -- after head slicing) count.
        budget: the :class:`~edgeprune.budget.Budget` (its kind's cost model prices the plans).
        table_anatomy: for a kind that ``needs_table``: the dense model the table was measured for
            (checked against the table's key; default ``anatomy``). ``anatomy`` may then be the
            SKP anchor, whose MLPs are narrower than the table's key.

    Attributes:
        linear: whether the cost is affine in each block's MLP width (flops, params: the closed-form
            MLP fill of :func:`plan_for_dims`); False for measured kinds (search fill).
        rules: the table's pruning rules (``mlp_round_to``, ``head_dim_round_to``, ``qk_equals_v``)
            or None; lower: the smallest measured size per module (``{}`` without a table).

    Raises:
        UserError: unknown kind; for latency: no table, a missing / malformed table or one of
            another model shape.
    """

    def __init__(self, anatomy: ViTAnatomy, budget: Budget, table_anatomy: ViTAnatomy | None = None) -> None:
        self.anatomy, self.kind = anatomy, budget.kind
        measured = bool(budget.model_class.needs_table)
        self.model = budget.cost_model((table_anatomy or anatomy) if measured else anatomy)
        self.fixed = _exact(self.model.fixed_cost())
        self.linear = not measured
        rules = self.model.rules
        self.rules = dict(rules) if rules else None
        self.lower = dict(self.model.bounds())

    def block(self, i: int, qk: int, vo: int, mlp: int) -> int | float:
        """Cost of block i with the given dims."""
        b = self.anatomy.blocks[i]
        return _exact(self.model.block_cost(b, {"heads": b.num_heads, "qk": qk, "v": vo, "mlp": mlp}))

    def total(self, qk: list[int], vo: list[int], mlp: list[int]) -> int | float:
        return self.fixed + sum(self.block(i, q, v, m) for i, (q, v, m) in enumerate(zip(qk, vo, mlp)))

    def per_neuron(self, i: int) -> int | float:
        """Cost of one more MLP channel in block i (the same in every block of a plain ViT; only
        meaningful when :attr:`linear`)."""
        return self.block(i, 8, 8, 1) - self.block(i, 8, 8, 0)


@dataclasses.dataclass(frozen=True)
class DimGrid:
    """Where a derivation's dims live: MLP widths on multiples of ``mlp``, Q/K and V dims on
    multiples of ``head_dim``, none below ``mlp_min`` / ``qk_min`` / ``v_min`` (a head dim never
    above the block's own); ``qk_equals_v``: a layer's Q/K dim equals its V dim. ``rules``: the
    latency table's rules these came from (None: ``round_to`` everywhere, nothing else applied);
    ``head_dims``: the head dims the rules allow (a GPU's fused attention, ``devices.kernels``; None: any)."""

    mlp: int
    head_dim: int
    qk_equals_v: bool
    mlp_min: int
    qk_min: int
    v_min: int
    rules: dict | None = None
    head_dims: tuple[int, ...] | None = None

    def allowed(self, k: int, dense: int) -> int:
        """``k`` raised to the next head dim the rules allow (``dense`` when none is between)."""
        if self.head_dims is None or k >= dense:
            return min(k, dense)
        return min([d for d in self.head_dims if k <= d < dense and d % self.head_dim == 0] or [dense])

    def describe(self) -> dict:
        """For the record: the rules applied and the resulting grid."""
        return {"rules": self.rules, "round_to": {"mlp": self.mlp, "qk": self.head_dim, "v": self.head_dim},
                "smallest": {"mlp": self.mlp_min, "qk": self.qk_min, "v": self.v_min},
                "qk_equals_v": ("both the larger of the two OFP dims" if self.qk_equals_v else False),
                "heads": "every block keeps all its heads (not a unit of derive)"}


def _up(x: int, r: int) -> int:
    return -(-int(x) // r) * r


def dim_grid(cost: PlanCost, round_to: int = 8) -> DimGrid:
    """The dims' grid under ``cost``: ``round_to`` everywhere, or its table's rules and smallest
    measured sizes (rounded up onto the rules' grid) when it has them."""
    r = cost.rules
    if not r:
        return DimGrid(round_to, round_to, False, round_to, round_to, round_to)
    rm, rh = int(r.get("mlp_round_to", round_to)), int(r.get("head_dim_round_to", round_to))
    lo, allowed = cost.lower, allowed_head_dims(r)
    qk_min, v_min = _up(max(rh, lo.get("qk", 0)), rh), _up(max(rh, lo.get("v", 0)), rh)
    if allowed is not None:  # the smallest allowed multiple of rh at or above each (issue 40 item 6)
        qk_min, v_min = (min([d for d in allowed if d >= m and d % rh == 0] or [m]) for m in (qk_min, v_min))
    if r.get("qk_equals_v"):
        qk_min = v_min = max(qk_min, v_min)
    return DimGrid(rm, rh, bool(r.get("qk_equals_v")), _up(max(rm, lo.get("mlp", 0)), rm), qk_min, v_min, dict(r),
                   allowed)


def attention_dims(factors: list[BlockFactors], rho: float, grid: DimGrid) -> tuple[list[int], list[int]]:
    """Per-layer (qk, v) dims for ``rho`` on ``grid``: :func:`layer_dims` at ``grid.head_dim``;
    with table rules, raised to the grid's smallest sizes (at most the layer's own dim) and, with
    ``qk_equals_v``, both set to the larger of the two (module doc)."""
    qk, vo = layer_dims(factors, rho, grid.head_dim)
    if grid.rules is None:
        return qk, vo
    qk = [grid.allowed(max(q, grid.qk_min), f.qk_dim) for f, q in zip(factors, qk)]
    vo = [grid.allowed(max(v, grid.v_min), f.v_dim) for f, v in zip(factors, vo)]
    if grid.qk_equals_v:
        qk = vo = [max(q, v) for q, v in zip(qk, vo)]
    return list(qk), list(vo)


def measure(model: nn.Module, budget: Budget) -> int | float:
    """The model's actual cost in the units of ``budget``'s kind (for flops and params:
    ``edgeprune.flops.model_flops`` / ``count_params``; for latency: the table's prediction of the
    model at its own dims, which needs a model of the table's shape)."""
    an = find_anatomy(model)
    if not budget.model_class.needs_table:
        return _exact(budget.dense_cost(an))
    return float(budget.dense_cost(an))


def budget_target(budget: Budget, dense: int | float) -> int | float:
    """The absolute budget of a derivation: ``floor(value x dense)`` for a fraction, ``floor(value)``
    for a count (:meth:`edgeprune.budget.Budget.target`); a kind with a unit (latency, ms)
    is not a count: its target is not floored."""
    if budget.model_class.unit is not None:
        return float(budget.target(dense))
    return int(math.floor(budget.target(dense)))


def keep_fraction(budget: Budget, dense: int | float) -> float:
    """The budget as a fraction of the base model (the value itself when it is one)."""
    return budget.value if budget.is_fraction else budget.value / dense


def mlp_caps(anchor_sizes: list[int], round_to: int = 8) -> list[int]:
    """Most channels OFP may keep per block: the anchor's size floored to ``round_to`` (min
    ``round_to``)."""
    return [max(round_to, (a // round_to) * round_to) for a in anchor_sizes]


def plan_for_dims(cost: PlanCost, qk: list[int], vo: list[int], caps: list[int], budget: int | float,
                  round_to: int = 8) -> tuple[list[int], int | float] | None:
    """MLP dims that fill ``budget`` given attention dims, or None if infeasible: the closed form
    for a cost affine in the MLP width (:attr:`PlanCost.linear`), else :func:`search_mlp_dims`."""
    if not cost.linear:
        return search_mlp_dims(cost, qk, vo, caps, budget, round_to, lowest=dim_grid(cost, round_to).mlp_min)
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


def search_mlp_dims(cost: PlanCost, qk: list[int], vo: list[int], caps: list[int], budget: int | float,
                    round_to: int = 8, lowest: int = 0) -> tuple[list[int], int | float] | None:
    """The largest water-filling level of MLP dims whose total cost is <= ``budget`` (any cost
    model; no monotonicity assumed).

    Levels: :func:`~edgeprune.nuwa.ofp_mlp.uniform_mlp_dims` ``(caps, u x round_to, round_to)`` for
    every u from one unit per block to every block at its cap; levels with a block below ``lowest``
    (the table's smallest measured width) are skipped. Every level is priced
    (``fixed + sum_i block(i, qk_i, vo_i, mlp_i)``, the sum :meth:`PlanCost.total` forms; block costs
    memoised per (block, width)) and the feasible one with the most neurons is returned.

    Returns:
        ``(mlp dims, total cost)`` or None when no level fits.
    """
    memo: dict[tuple[int, int], int | float] = {}

    def block(i: int, m: int) -> int | float:
        if (i, m) not in memo:
            memo[(i, m)] = cost.block(i, qk[i], vo[i], m)
        return memo[(i, m)]

    best = None
    for units in range(len(caps), sum(max(1, c // round_to) for c in caps) + 1):
        mlp = uniform_mlp_dims(caps, units * round_to, round_to)
        if mlp is None or min(mlp) < lowest:
            continue
        total = cost.fixed + sum(block(i, m) for i, m in enumerate(mlp))
        if total <= budget:
            best = (mlp, total)
    return best


def smallest_dims(cost: PlanCost, round_to: int = 8) -> tuple[list[int], list[int], list[int]]:
    """(qk, vo, mlp) of the smallest model NuWa can derive: every dim at ``round_to`` (FLOPs,
    params), or at the smallest sizes of the table's grid (:func:`dim_grid`)."""
    L = len(cost.anatomy.blocks)
    g = dim_grid(cost, round_to)
    if g.rules is None:
        return [round_to] * L, [round_to] * L, [round_to] * L
    blocks = cost.anatomy.blocks
    qk = [min(b.qk_dim, g.qk_min) for b in blocks]
    vo = [min(b.v_dim, g.v_min) for b in blocks]
    if g.qk_equals_v:
        qk = vo = [max(q, v) for q, v in zip(qk, vo)]
    return qk, vo, [g.mlp_min] * L


def measured_record(cost: PlanCost, grid: DimGrid, predicted: float, target: float, dense: float) -> dict:
    """What a derivation under a measured budget (latency) records, as ``prune`` does in its
    allocation report: the cost model's own record (table path, key, rules, dense predicted and
    measured ms), the grid and rules applied (:meth:`DimGrid.describe`), how the MLPs were filled,
    and the chosen plan's ``predicted`` cost beside ``target`` and ``dense`` (ms for latency)."""
    own = cost.model.record()
    return {**own, **grid.describe(), "heads_allocated": False,
            "mlp_fill": "search: the largest uniform water-filling level within the budget",
            "predicted": predicted, "target": target, "dense": dense}


def minimum_cost(cost: PlanCost, round_to: int = 8) -> int | float:
    """Cost of :func:`smallest_dims` (every qk/v/mlp dim at ``round_to`` for FLOPs and params)."""
    return cost.total(*smallest_dims(cost, round_to))


def check_feasible(cost: PlanCost, budget: int | float, dense_cost: int | float, round_to: int = 8) -> None:
    """Raises UserError when even the smallest derivable model exceeds the budget."""
    low = minimum_cost(cost, round_to)
    if low > budget:
        g = dim_grid(cost, round_to)
        how = (f"dims that are multiples of {round_to}" if g.rules is None else
               f"the latency table's grid (MLP widths x{g.mlp}, head dims x{g.head_dim}, every head kept)")
        raise UserError(
            f"the {cost.kind} budget {budget / dense_cost:.3g} of the base model cannot be met with {how}: "
            f"the smallest derivable model keeps {low / dense_cost:.3f}; raise --{cost.kind}")


def plan_candidates(cost: PlanCost, factors: list[BlockFactors], caps: list[int], budget: int | float,
                    rho_grid: tuple[float, ...] | list[float] | None = None,
                    round_to: int = 8) -> list[Plan]:
    """Feasible, distinct, non-dominated plans for the rho values of ``rho_grid`` (descending;
    None = :func:`rho_candidates`). Dims are on :func:`dim_grid` (``round_to``, or the latency
    table's rules; ``caps`` must be on its MLP grid, :func:`mlp_caps`).

    Raises:
        UserError: no rho in the grid gives a feasible plan.
    """
    grid = dim_grid(cost, round_to)
    if rho_grid is None:
        rho_grid = rho_candidates(factors, round_to=grid.head_dim)
    plans: list[Plan] = []
    seen = set()
    for rho in sorted(set(float(r) for r in rho_grid), reverse=True):
        qk, vo = attention_dims(factors, rho, grid)
        res = plan_for_dims(cost, qk, vo, caps, budget, grid.mlp)
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
        grid_ = sorted(set(float(r) for r in rho_grid), reverse=True)
        if len(grid_) == 1:
            raise UserError(f"--rho {grid_[0]:g} leaves too little of the {cost.kind} budget for the MLPs "
                            f"(each needs >= {grid.mlp_min} channels); lower --rho or raise the budget")
        raise UserError(f"no retained-energy ratio in the grid ({len(grid_)} values, {grid_[0]:g} .. {grid_[-1]:g}) "
                        f"meets the {cost.kind} budget; include lower values or raise the budget")
    return plans
