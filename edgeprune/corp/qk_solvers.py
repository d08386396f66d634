"""The Q/K solver registry: how one head's exact Q/K logit system is solved (corp-v1 eq. 29).

``CorpConfig.qk_solver`` names a registered solver. Each is a function
``f(system: QKHeadSystem, alpha: float) -> (M (d', d') float64, lam, info)`` registered with
``@register_qk_solver(name)``; built in: "direct" (float64 Cholesky of the d'^2 x d'^2 Kronecker
system, ``edgeprune.solve.qk_logit``), "cg" (matrix-free preconditioned conjugate gradients,
``edgeprune.solve.qk_logit_cg``, falling back to direct when it does not converge) and "auto" (the
cheaper of the two by ``edgeprune.solve.qk_choice.cg_is_cheaper``; direct if alpha = 0). Same
system, same answer to ~1e-8 relative either way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from edgeprune.plan import BlockPlan, pruned_indices
from edgeprune.registry import Registry
from edgeprune.solve import qk_logit, qk_logit_cg, qk_rope
from edgeprune.solve.qk_choice import cg_is_cheaper

# f(block, head) -> (M (d', d') float64, ridge lambda, solve info dict)
QKSolve = Callable[[int, int], "tuple[torch.Tensor, float, dict]"]


@dataclasses.dataclass
class QKHeadSystem:
    """One head's exact Q/K system, as per-image Grams.

    Attributes:
        gq, gk: per-image Q and K Grams of the head (N, d, d) float64.
        keep, prune: kept / removed Q/K dims (int64).
        rhs_fn: ``f(keep, prune) -> (d', d') float64`` replacing the system's right side (the
            two-stream system of ``edgeprune.solve.qk_logit_cross``); None = CORP's.
        rotary: the head rotates q and k (RoPE; the Grams are of the rotated q, k): the system is
            solved in the pair form (``edgeprune.solve.qk_rope``) whatever the registered solver.
    """

    gq: torch.Tensor
    gk: torch.Tensor
    keep: torch.Tensor
    prune: torch.Tensor
    rhs_fn: Callable | None = None
    rotary: bool = False


def _kronecker(system: QKHeadSystem) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's exact system (corp-v1 eq. 29) and its right side (``rhs_fn``'s where one is given)."""
    k_sys, rhs = qk_logit.kronecker_system(system.gq, system.gk, system.keep, system.prune)
    return k_sys, rhs if system.rhs_fn is None else system.rhs_fn(system.keep, system.prune)


def solve_rope(system: QKHeadSystem, alpha: float) -> tuple[torch.Tensor, float, dict]:
    """The pair-form solve of a rotary head (METHODS.md §6; ``qk_rope.solve_rope_pairs``)."""
    m, lam = qk_rope.solve_rope_pairs(*_kronecker(system), alpha)
    return m, lam, {"solver": "rope-pair"}


@dataclasses.dataclass(frozen=True)
class QKSolverEntry:
    """A registered solver: ``fn(system, alpha)``; ``needs_ridge``: refused for alpha = 0."""

    name: str
    fn: Callable[[QKHeadSystem, float], "tuple[torch.Tensor, float, dict]"]
    needs_ridge: bool = False


#: solver name -> its entry (registering a name again replaces it)
SOLVERS: Registry[QKSolverEntry] = Registry("Q/K solver")


def register_qk_solver(name: str, needs_ridge: bool = False) -> Callable:
    """Function decorator: register ``fn(system: QKHeadSystem, alpha) -> (M, lam, info)`` as the
    Q/K solver ``name`` (``needs_ridge``: the config check refuses it with ``qk_ridge_alpha = 0``);
    registering a name again replaces it."""

    def wrap(fn: Callable) -> Callable:
        SOLVERS.register(name, QKSolverEntry(name, fn, needs_ridge), replace=True)
        return fn

    return wrap


def unregister_qk_solver(name: str) -> None:
    """Remove the Q/K solver registered as ``name`` (no error if there is none)."""
    SOLVERS.unregister(name, missing_ok=True)


def list_qk_solvers() -> tuple[str, ...]:
    """Registered Q/K solver names, in registration order."""
    return SOLVERS.names()


def get_qk_solver(name: str) -> QKSolverEntry:
    """The solver registered as ``name``.

    Raises:
        UserError: unknown name; one line listing the known ones.
    """
    return SOLVERS.get(name)


@register_qk_solver("auto")
def solve_auto(system: QKHeadSystem, alpha: float) -> tuple[torch.Tensor, float, dict]:
    """CG where :func:`cg_is_cheaper` says so (alpha > 0), else the Cholesky route."""
    if alpha > 0 and cg_is_cheaper(system.gq.shape[0], len(system.keep)):
        return solve_cg(system, alpha)
    return solve_direct(system, alpha)


@register_qk_solver("direct")
def solve_direct(system: QKHeadSystem, alpha: float) -> tuple[torch.Tensor, float, dict]:
    """Float64 Cholesky of the d'^2 x d'^2 Kronecker system (``qk_logit``)."""
    m, lam = qk_logit.solve_logit_compensation(*_kronecker(system), alpha)
    return m, lam, {"solver": "direct"}


@register_qk_solver("cg", needs_ridge=True)
def solve_cg(system: QKHeadSystem, alpha: float) -> tuple[torch.Tensor, float, dict]:
    """Matrix-free preconditioned CG (``qk_logit_cg``); the Cholesky route if it does not converge."""
    gq_ss, gk_ss, rhs = qk_logit.kept_blocks(system.gq, system.gk, system.keep, system.prune)
    if system.rhs_fn is not None:
        rhs = system.rhs_fn(system.keep, system.prune)
    res = qk_logit_cg.solve_logit_compensation_cg(gq_ss, gk_ss, rhs, alpha)
    if res.converged:
        return res.m, res.lam, {"solver": f"cg:{res.iterations}"}
    return solve_direct(system, alpha)


def _solutions(stats) -> dict | None:
    """The Q/K solutions kept on one block's statistics object (None where it takes no attribute)."""
    memo = getattr(stats, "_qk_solutions", None)
    if memo is None:
        try:
            memo = stats._qk_solutions = {}
        except AttributeError:
            return None
    return memo


def qk_solver_from_grams(qk_stats, plans, cfg, rhs_fn: Callable | None = None) -> QKSolve:
    """Per-head solver of the exact Q/K system from the stored per-image Grams.

    Args:
        qk_stats: per-block :class:`~edgeprune.calibration.qk_stats.QKStatistics` with Grams
            (anything indexable by block index).
        plans: kept Q/K dims per block (:class:`BlockPlan` ``qk_keep``, (H, d')), indexable by block index.
        cfg: ``qk_solver`` (a registered name) and ``qk_ridge_alpha``.
        rhs_fn: ``f(block, head, keep, prune) -> (d', d') float64`` replacing the system's right
            side (the two-stream system of ``edgeprune.solve.qk_logit_cross``); None = CORP's.

    Returns:
        ``f(block, head) -> (M (d', d') float64, lam, {"solver": "direct" | "cg:<iters>"})``.

    Raises:
        UserError: unknown solver name.
    """
    entry = get_qk_solver(cfg.qk_solver)
    grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def solve(i: int, h: int) -> tuple[torch.Tensor, float, dict]:
        plan: BlockPlan = plans[i]
        keep = plan.qk_keep[h]
        # the same statistics, head, kept dims and solver give the same M: a budgeted prune solves
        # its candidates' blocks and the chosen one again, so solutions are kept on the statistics
        memo = _solutions(qk_stats[i]) if rhs_fn is None else None
        key = (h, tuple(keep.tolist()), cfg.qk_solver, float(cfg.qk_ridge_alpha),
               torch.get_num_threads())  # "auto" picks its route by the thread count
        if memo is not None and key in memo:
            m, lam, info = memo[key]
            return m.clone(), lam, dict(info)
        if i not in grams:
            grams.clear()  # blocks are solved in order: hold one block's Grams at a time
            grams[i] = qk_stats[i].grams()
        gq, gk = grams[i]
        prune = pruned_indices(keep, gq.shape[-1])
        rhs = None if rhs_fn is None else (lambda k, p: rhs_fn(i, h, k, p))
        rotary = bool(getattr(qk_stats[i], "rotary", False))
        system = QKHeadSystem(gq[:, h], gk[:, h], keep, prune, rhs, rotary)
        out = (solve_rope if rotary else entry.fn)(system, cfg.qk_ridge_alpha)
        if memo is not None:
            memo[key] = (out[0].clone(), out[1], dict(out[2]))
        return out

    return solve
