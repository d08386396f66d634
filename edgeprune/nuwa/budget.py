"""Budget: turn a FLOPs (or params) fraction into per-block dims (nuwa §3.3, suppl. §6, 9, 11).

Costs follow the core models exactly: FLOPs are :func:`edgeprune.flops.block_flops` (NuWa's suppl.
eq. 13, counted as 2 x MACs) plus patch embedding and head; params count every weight and bias.
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
import types

import torch.nn as nn

from edgeprune.anatomy import ViTAnatomy
from edgeprune.errors import UserError
from edgeprune.flops import block_flops, count_params, model_flops
from edgeprune.nuwa.ofp_mha import BlockFactors, layer_dims, retained_energy
from edgeprune.nuwa.ofp_mlp import uniform_mlp_dims

METRICS = ("flops", "params")
DEFAULT_NUM_RHO = 16


def rho_candidates(factors: list[BlockFactors], n: int = DEFAULT_NUM_RHO, round_to: int = 8) -> list[float]:
    """Adaptive rho grid: the retained-energy levels at which some layer's dim changes.

    Every layer's qk and vo spectrum has a retained energy at each multiple of ``round_to``; these
    levels are exactly the rho values where :func:`layer_dims` changes (and they crowd near 1 for
    trained attention, e.g. 0.995 at rank 8 of 64). ``n`` of them, evenly spaced in rank order,
    plus 1.0 (no attention pruning) and 0.0 (every dim at ``round_to``) form the grid.
    """
    from edgeprune.nuwa.ofp_mha import energy_ratios

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
        cost: the plan's cost in the budget's metric; energy_qk, energy_vo: per-layer mean
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


class CostModel:
    """Cost of the model in ``anatomy`` with per-block (qk, vo, mlp) dims replaced.

    Args:
        anatomy: the model whose fixed parts (embedding, norms, head -- after head slicing) count.
        metric: "flops" or "params".
    """

    def __init__(self, anatomy: ViTAnatomy, metric: str) -> None:
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}")
        self.anatomy, self.metric = anatomy, metric
        self.n = anatomy.num_tokens
        if metric == "flops":
            f = model_flops(anatomy)
            self.fixed = f["total"] - sum(b["total"] for b in f["blocks"])
        else:
            self.fixed = count_params(anatomy.model) - sum(self._block_params(i, b.qk_dim, b.v_dim, b.mlp_hidden)
                                                           for i, b in enumerate(anatomy.blocks))

    def _block_params(self, i: int, qk: int, vo: int, mlp: int) -> int:
        b = self.anatomy.blocks[i]
        D, H = b.qkv.in_features, b.num_heads
        qkv_out = H * (2 * qk + vo)
        p = D * qkv_out + (qkv_out if b.qkv.bias is not None else 0)
        p += H * vo * D + (D if b.proj.bias is not None else 0)
        p += D * mlp + (mlp if b.fc1.bias is not None else 0)
        p += mlp * b.fc2.out_features + (b.fc2.out_features if b.fc2.bias is not None else 0)
        return p

    def block(self, i: int, qk: int, vo: int, mlp: int) -> int:
        """Cost of block i with the given dims."""
        if self.metric == "params":
            return self._block_params(i, qk, vo, mlp)
        b = self.anatomy.blocks[i]
        ns = types.SimpleNamespace(qkv=types.SimpleNamespace(in_features=b.qkv.in_features),
                                   num_heads=b.num_heads, qk_dim=qk, v_dim=vo, mlp_hidden=mlp)
        return int(block_flops(ns, self.n)["total"])

    def total(self, qk: list[int], vo: list[int], mlp: list[int]) -> int:
        return self.fixed + sum(self.block(i, q, v, m) for i, (q, v, m) in enumerate(zip(qk, vo, mlp)))

    def per_neuron(self, i: int) -> int:
        """Cost of one more MLP channel in block i (the same in every block of a plain ViT)."""
        return self.block(i, 8, 8, 1) - self.block(i, 8, 8, 0)


def measure(model: nn.Module, metric: str) -> int:
    """The model's actual cost (edgeprune.flops / count_params)."""
    from edgeprune.anatomy import find_anatomy

    return int(model_flops(find_anatomy(model))["total"]) if metric == "flops" else count_params(model)


def mlp_caps(anchor_sizes: list[int], round_to: int = 8) -> list[int]:
    """Most channels OFP may keep per block: the anchor's size floored to ``round_to`` (min
    ``round_to``)."""
    return [max(round_to, (a // round_to) * round_to) for a in anchor_sizes]


def plan_for_dims(cost: CostModel, qk: list[int], vo: list[int], caps: list[int], budget: int,
                  round_to: int = 8) -> tuple[list[int], int] | None:
    """MLP dims that fill ``budget`` given attention dims, or None if infeasible."""
    attn_only = cost.total(qk, vo, [0] * len(qk))
    per = cost.per_neuron(0)
    if any(cost.per_neuron(i) != per for i in range(len(qk))):
        raise ValueError("blocks differ in the cost of an MLP neuron")  # not for plain ViTs
    rest = budget - attn_only
    if rest < 0:
        return None
    mlp = uniform_mlp_dims(caps, rest // per, round_to)
    if mlp is None:
        return None
    return mlp, cost.total(qk, vo, mlp)


def minimum_cost(cost: CostModel, round_to: int = 8) -> int:
    """Cost with every qk/v/mlp dim at ``round_to`` (the smallest model NuWa can derive)."""
    L = len(cost.anatomy.blocks)
    return cost.total([round_to] * L, [round_to] * L, [round_to] * L)


def check_feasible(cost: CostModel, budget: int, dense_cost: int, round_to: int = 8) -> None:
    """Raises UserError when even the smallest derivable model exceeds the budget."""
    low = minimum_cost(cost, round_to)
    if low > budget:
        raise UserError(
            f"the {cost.metric} budget {budget / dense_cost:.3g} of the base model cannot be met with dims "
            f"that are multiples of {round_to}: the smallest derivable model keeps "
            f"{low / dense_cost:.3f}; raise --{cost.metric}")


def plan_candidates(cost: CostModel, factors: list[BlockFactors], caps: list[int], budget: int,
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
            raise UserError(f"--rho {grid[0]:g} leaves too little of the {cost.metric} budget for the MLPs "
                            f"(each needs >= {round_to} channels); lower --rho or raise the budget")
        raise UserError(f"no retained-energy ratio in the grid ({len(grid)} values, {grid[0]:g} .. {grid[-1]:g}) "
                        f"meets the {cost.metric} budget; include lower values or raise the budget")
    return plans
