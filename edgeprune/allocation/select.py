"""Choose among candidate allocations by their measured output error on calibration images.

The allocator's proxy (``edgeprune.allocation.curves``) ranks allocations well on the model its
normalisation was measured on (fmnist-vit, Spearman 0.76-0.95 with the final-logit error) but not
on every model: on the pretrained DINOv2 ViT-S/14 of ``dinov2-s14-fmnist`` the proxy-optimal
allocation at FLOPs x0.6 lost 5 top-1 points *more* than uniform pruning (71.2% vs 76.4%,
docs/accuracy.md). So the budgeted path does not trust one proxy: it builds a few candidates that
meet the same budget -- the uniform allocation and greedy allocations for several weights of the
Q/K curves against the MLP ones (:data:`QK_WEIGHTS`) -- prunes each with the same statistics
(closed-form solves and surgery on a copy; no new calibration pass) and keeps the one whose final
output on ``CorpConfig.allocation_check_images`` calibration images is closest to the dense
model's (relative squared error). Since the uniform allocation is always a candidate, the chosen
allocation is never worse than uniform on that measured error.

Measured sensitivities (``CorpConfig.allocation_sensitivity``, on by default): the proxy's
*shape* along one unit's kept sizes (its closed-form error curve) is trustworthy, its *scale*
across blocks and module types (the residual-stream normalisation and the Q/K weight, fitted on
fmnist-vit) is what failed on DINOv2. So every allocation unit (block x module) is pruned alone,
at its size in the uniform candidate (one step below dense if uniform keeps it dense), and the
model's output error on the check images is measured; each curve is rescaled so that its error
at that size equals the measurement (``E_u(k) = m_u * raw_u(k) / raw_u(k_ref)``: first order,
errors of different units add). The greedy allocation on these curves is one more candidate,
judged by the same measured error as the others. Cost: one solve + one forward pass of the check
images per unit (2 x depth units for ``both``), from the unit's block on (the dense stream before
it is cached once, :mod:`edgeprune.allocation.suffix`): about half a pass per unit on average.

Cost: per candidate one solve + surgery and one forward pass over the check images (the dense
output once), e.g. a few seconds per candidate for DINOv2-S with 32 images.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Callable, Iterable

import torch

from edgeprune.allocation.curves import Curve
from edgeprune.allocation.greedy import allocate, build_curves
from edgeprune.allocation.outputs import (detached_cpu, output_error, output_tensor,  # noqa: F401 (handed on)
                                          outputs_equal, take_rows)
from edgeprune.allocation.suffix import BlockInputs
from edgeprune.allocation.trial import PLAN_FIELD, touched_blocks, trial_copy
from edgeprune.anatomy import find_anatomy
from edgeprune.corp.qk_solvers import qk_solver_from_grams
from edgeprune.corp.steps import apply_corp, plan_corp
from edgeprune.plan import BlockPlan, pruned_modules

#: Q/K weights of the greedy candidates (``errors.QK_WEIGHT`` = 0.2 is the fmnist-vit fit)
QK_WEIGHTS = (0.2, 1.0, 5.0)


def check_images(batches: Callable[[], Iterable[torch.Tensor]], n: int) -> torch.Tensor | None:
    """The first ``n`` calibration images, (n', C, H, W) with n' <= n; None if n < 1."""
    if n < 1:
        return None
    taken, count = [], 0
    for x in batches():
        taken.append(x[: n - count])
        count += taken[-1].shape[0]
        if count >= n:
            break
    return torch.cat(taken) if taken else None


def candidates(anatomy, stats, cfg, x: torch.Tensor | None = None, dense_out: torch.Tensor | None = None,
               sensitivity: dict | None = None) -> dict[str, tuple[list[dict], dict]]:
    """The distinct candidate allocations ``{name: (dims, report)}``: uniform and greedy at each
    of :data:`QK_WEIGHTS` (greedy ones equal to an earlier candidate are dropped), and, given the
    check images ``x`` and ``dense_out`` with ``cfg.allocation_sensitivity``, the greedy
    allocation on the measured curves (:func:`measured_curves`; its per-unit measurements are
    put in ``sensitivity`` when a dict is passed)."""
    out: dict[str, tuple[list[dict], dict]] = {}
    try:
        out["uniform"] = allocate(anatomy, stats, cfg, only="uniform")
    except Exception:  # noqa: BLE001 -- no uniform allocation reaches this budget
        pass
    for w in QK_WEIGHTS:
        dims, rep = allocate(anatomy, stats, cfg, qk_weight=w, only="greedy")
        if all(dims != d for d, _ in out.values()):
            out[f"greedy(qk_weight={w:g})"] = (dims, rep)
    if x is not None and dense_out is not None and cfg.allocation_sensitivity:
        t0 = time.perf_counter()
        x, dense_out = _sensitivity_images(cfg, x), _sensitivity_images(cfg, dense_out)
        key = _measured_key(cfg, x)
        known, fresh = stats.derived.get(key), key not in stats.derived
        if fresh:
            known = stats.derived[key] = _measure(anatomy, stats, cfg, out, x, dense_out)
        for name, (curves, units, got) in known.items():
            dims, rep = got if fresh else allocate(anatomy, stats, cfg, only="greedy", curves=copy.deepcopy(curves))
            if all(dims != d for d, _ in out.values()):
                out[name] = (dims, rep)
        if sensitivity is not None:
            sensitivity.update(units=known[list(known)[-1]][1], seconds=time.perf_counter() - t0,
                               images=int(x.shape[0]),
                               **({} if fresh else {"reused": "the measured curves of an earlier round"}))
    return out


def _sensitivity_images(cfg, t: torch.Tensor) -> torch.Tensor:
    """The first ``cfg.allocation_sensitivity_images`` rows of ``t`` (the check images or their dense outputs): the
    per-unit measurements run on fewer images than the candidates' check (CorpConfig)."""
    n = cfg.allocation_sensitivity_images
    rows = (t[0] if isinstance(t, tuple) else t).shape[0]
    return take_rows(t, n) if n is not None and n < rows else t


def _round_key(cfg) -> tuple[str, str]:
    """The CORP settings and the budget but its value, as text: what stays the same between the rounds of a
    latency correction (issue 40), which ask the same statistics for another budget value."""
    settings = dataclasses.replace(cfg, budget=None, dims=None)
    b = cfg.budget
    budget = None if b is None else {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if f.name != "value"}
    return repr(settings), repr(budget)


def _measured_key(cfg, x: torch.Tensor) -> tuple:
    """``stats.derived`` key of the measured curves: the CORP settings but the budget's value (a latency
    correction round asks the same statistics for another value: issue 40, no repeated sensitivity pass)."""
    return ("allocation.measured", *_round_key(cfg), tuple(x.shape))


def _rule_key(cfg) -> tuple:
    """``stats.derived`` key of the candidate kept by the first round on these statistics
    (:func:`select_allocation`)."""
    return ("allocation.chosen", *_round_key(cfg))


def _same_rule(anatomy, stats, cfg, rule: tuple[str, tuple | None],
               sensitivity: dict) -> dict[str, tuple[list[dict], dict]] | None:
    """``{name: (dims, report)}`` of the candidate rule ``name`` that an earlier round on the same statistics kept,
    at this round's budget value: the uniform allocation, the greedy one at its Q/K weight, or the greedy one on the
    earlier round's measured curves (key ``measured``). None where it cannot be rebuilt (no uniform allocation
    reaches this value, the curves are gone): the caller then offers every candidate."""
    name, measured = rule
    try:
        if name == "uniform":
            return {name: allocate(anatomy, stats, cfg, only="uniform")}
        if name.startswith("greedy(qk_weight="):
            return {name: allocate(anatomy, stats, cfg, qk_weight=float(name[17:-1]), only="greedy")}
    except Exception:  # noqa: BLE001 -- e.g. no uniform allocation reaches this value: all candidates again
        return None
    known = stats.derived.get(measured) if measured is not None else None
    if not known or name not in known:
        return None
    curves, units, _ = known[name]
    sensitivity.update(units=units, seconds=0.0, images=int(measured[-1][0]),
                       reused="the measured curves of an earlier round")
    return {name: allocate(anatomy, stats, cfg, only="greedy", curves=copy.deepcopy(curves))}


def _measure(anatomy, stats, cfg, out: dict, x: torch.Tensor, dense_out: torch.Tensor) -> dict[str, tuple]:
    """``{"greedy(measured)": (curves, units, (dims, report))[, "greedy(measured x2)": ...]}``: the curves rescaled
    to single-unit measurements at the uniform candidate's sizes, and again where the first greedy allocation put
    each unit (``cfg.allocation_anchors`` >= 2; :func:`measured_curves`), with the greedy allocation on each."""
    ref = out["uniform"][0] if "uniform" in out else next(iter(out.values()))[0]
    cache = BlockInputs(anatomy.model, [a.block for a in anatomy.blocks], x, output_tensor)
    curves, units = measured_curves(anatomy, stats, cfg, ref, x, dense_out, cache=cache)
    kept = copy.deepcopy(curves)  # as measured (allocate may touch the curves it is given)
    dims, rep = allocate(anatomy, stats, cfg, only="greedy", curves=curves)
    got = {"greedy(measured)": (kept, units, (dims, rep))}
    if cfg.allocation_anchors >= 2:  # measure again where that allocation put each unit
        curves, units = measured_curves(anatomy, stats, cfg, ref, x, dense_out, also_at=dims, known=units,
                                        cache=cache)
        kept = copy.deepcopy(curves)
        got["greedy(measured x2)"] = (kept, units, allocate(anatomy, stats, cfg, only="greedy", curves=curves))
    return got


def _fold_and_measure(model, plans, cfg, stats, x: torch.Tensor, dense_out: torch.Tensor,
                      cache: BlockInputs | None = None) -> float:
    """Relative output error vs dense of a copy of ``model`` pruned by ``plans`` (same statistics).

    With ``cache`` (the dense block inputs on ``x``) only the blocks from the first pruned one on
    are run (:mod:`edgeprune.allocation.suffix`; bitwise the full forward's output)."""
    trial = trial_copy(model, plans)
    an = find_anatomy(trial)
    qk_solve = None
    if cfg.compensation and any(p.qk_keep is not None for p in plans):
        qk_solve = qk_solver_from_grams(stats.qk, plans, cfg)
    apply_corp(an, plans, cfg, stats.mlp, qk_solve, stats.vo)
    if cache is None:
        return output_error(output_tensor(trial(x)), dense_out)
    first = min(touched_blocks(plans), default=0)
    return output_error(cache.forward_from(trial, [a.block for a in an.blocks], first), dense_out)


def _position(c: Curve, dims: list[dict], step_down: bool) -> int | None:
    """Index in ``c.ks`` of the unit's kept size in ``dims``; a dense size is moved one step
    down (``step_down``) or gives None."""
    k = dims[c.block][c.keys[0]]
    p = c.ks.index(k) if k in c.ks else len(c.ks) - 1
    if p == len(c.ks) - 1:
        if not step_down or p == 0:
            return None
        p -= 1
    return p


def _anchor(c: Curve, anchors: list[tuple[int, float]]) -> None:
    """Rescale curve ``c`` in place to measured errors at one or more sizes (module doc).

    One anchor ``(p, m)``: ``errors = raw * m / raw[p]`` (``scale = raw[p] / m``). Several: the
    log of the factor ``m / raw[p]`` is interpolated linearly in the size index between anchors
    and held constant beyond them; the result is made non-increasing in the kept size (more kept
    dims never cost more) and stored as ``raw`` with ``scale = 1``.
    """
    anchors = [(p, m) for p, m in anchors if p is not None and m is not None and m > 0 and c.raw[p] > 0]
    if not anchors:
        return
    if len(anchors) == 1:
        p, m = anchors[0]
        c.scale = c.raw[p] / m  # errors[p] = raw[p] / scale = m
        return
    pts = sorted((p, math.log(m / c.raw[p])) for p, m in anchors)
    out = []
    for i, r in enumerate(c.raw):
        if i <= pts[0][0]:
            lf = pts[0][1]
        elif i >= pts[-1][0]:
            lf = pts[-1][1]
        else:
            j = next(j for j in range(1, len(pts)) if i <= pts[j][0])
            (p0, f0), (p1, f1) = pts[j - 1], pts[j]
            lf = f0 + (f1 - f0) * (i - p0) / (p1 - p0)
        out.append(max(r, 0.0) * math.exp(lf))
    for i in range(len(out) - 2, -1, -1):
        out[i] = max(out[i], out[i + 1])
    c.raw, c.scale = out, 1.0


def _measure_units(anatomy, stats, cfg, curves: list[Curve], positions: list[int | None], x: torch.Tensor,
                   dense_out: torch.Tensor, cache: BlockInputs | None) -> list[float | None]:
    """Output error of each unit pruned alone at ``c.ks[position]`` (None where no position)."""
    dims = [{} for _ in anatomy.blocks]
    for c, p in zip(curves, positions):
        for key in c.keys:
            dims[c.block][key] = c.ks[p if p is not None else len(c.ks) - 1]
    ref_plans = plan_corp(anatomy, stats, dataclasses.replace(cfg, dims=dims, budget=None))
    plain = dataclasses.replace(cfg, dims=None, budget=None)
    out: list[float | None] = []
    for c, p in zip(curves, positions):
        if p is None:
            out.append(None)
            continue
        plans = [BlockPlan(index=b.index) for b in anatomy.blocks]
        src = ref_plans[c.block]
        plans[c.block] = BlockPlan(index=c.block, **{PLAN_FIELD[k]: getattr(src, PLAN_FIELD[k]) for k in c.keys})
        out.append(_fold_and_measure(anatomy.model, plans, plain, stats, x, dense_out, cache))
    return out


@torch.no_grad()
def measured_curves(anatomy, stats, cfg, ref_dims: list[dict], x: torch.Tensor,
                    dense_out: torch.Tensor, also_at: list[dict] | None = None,
                    known: list[dict] | None = None, cache: BlockInputs | None = None
                    ) -> tuple[list[Curve], list[dict]]:
    """The allocator's curves rescaled to measured single-unit output errors (module doc).

    Args:
        anatomy: the dense model's anatomy (not modified: each unit is folded on a copy).
        stats, cfg: as for :func:`~edgeprune.allocation.greedy.allocate` (``cfg.budget`` set).
        ref_dims: per block the kept dims of a reference allocation (the uniform candidate);
            each unit is measured there, or one candidate size lower where that is dense.
        x: (n, C, H, W) check images; dense_out: the dense model's output on them.
        also_at: a second allocation (the greedy one on the once-measured curves): each unit is
            measured at its size there too (where it differs from the first size and is not
            dense) and the curve goes through both measurements (:func:`_anchor`).
        known: the ``info`` of an earlier call with the same ``ref_dims`` (its measurements are
            reused instead of measured again).
        cache: the dense block inputs on ``x`` (:class:`~edgeprune.allocation.suffix.BlockInputs`);
            built here when None.

    Returns:
        (curves, info): the curves of :func:`~edgeprune.allocation.greedy.build_curves` rescaled
        so that their errors equal the measurements at the measured sizes (unit-free: relative
        squared output error, :func:`output_error`); ``info`` one dict per unit (block, unit,
        kept, measured, proxy at that size; ``kept_2`` / ``measured_2`` for the second size).
    """
    curves = build_curves(anatomy, stats, cfg)
    if cache is None:
        cache = BlockInputs(anatomy.model, [a.block for a in anatomy.blocks], x, output_tensor)
    pos = [_position(c, ref_dims, step_down=True) for c in curves]
    chosen = [None if p is None else c.ks[p] for c, p in zip(curves, pos)]
    if known is not None and [u["kept"] for u in known] == chosen:
        first = [u["measured_output_error"] for u in known]
    else:
        first = _measure_units(anatomy, stats, cfg, curves, pos, x, dense_out, cache)
    second: list = [None] * len(curves)
    pos2: list = [None] * len(curves)
    if also_at is not None:
        pos2 = [None if (q := _position(c, also_at, step_down=False)) == p else q for c, p in zip(curves, pos)]
        second = _measure_units(anatomy, stats, cfg, curves, pos2, x, dense_out, cache)
    info = []
    for c, p, m, q, m2 in zip(curves, pos, first, pos2, second):
        proxy = None if p is None else c.errors[p]
        _anchor(c, [(p, m), (q, m2)])
        u = {"block": c.block, "unit": "+".join(c.keys), "kept": None if p is None else c.ks[p],
             "measured_output_error": m, "proxy_error": proxy}
        if q is not None:
            u.update(kept_2=c.ks[q], measured_output_error_2=m2)
        info.append(u)
    return curves, info


@torch.no_grad()
def select_allocation(anatomy, stats, cfg, batches: Callable[[], Iterable[torch.Tensor]]) -> tuple[list[dict], dict]:
    """Kept dims per block meeting ``cfg.budget``: the candidate (:func:`candidates`) with the
    lowest measured output error on the first ``cfg.allocation_check_images`` calibration images.

    Falls back to :func:`~edgeprune.allocation.greedy.allocate` (proxy only) when the check is
    off (``allocation_check_images`` = 0), without compensation, when the Q/K Grams were not kept
    (the memory-limited two-pass route) or when the model output is not a tensor.

    Args:
        anatomy: the dense model's anatomy (not modified).
        stats: the calibration statistics (as for ``allocate``).
        cfg: :class:`~edgeprune.corp.CorpConfig` with a budget.
        batches: the calibration batches callable (only the first images are read again).

    Returns:
        (dims, report): the chosen allocation's report with ``selection`` added (every
        candidate's measured error and proxy error, the chosen name, images, seconds).

    Raises:
        UserError: as ``allocate``.
    """
    n = int(cfg.allocation_check_images)
    qk = "qk" in pruned_modules(cfg)
    grams_kept = not qk or all(s is None or getattr(s, "keep_grams", False) for s in (stats.qk or []))
    if n < 1 or not cfg.compensation or not grams_kept:
        return allocate(anatomy, stats, cfg)
    t0 = time.perf_counter()
    x = check_images(batches, n)
    model = anatomy.model
    dense_out = output_tensor(model(x)) if x is not None else None
    if dense_out is None:
        return allocate(anatomy, stats, cfg)
    sensitivity: dict = {}
    rule = stats.derived.get(_rule_key(cfg))
    cands = None if rule is None else _same_rule(anatomy, stats, cfg, rule, sensitivity)
    if cands is None:
        rule = None
        cands = candidates(anatomy, stats, cfg, x, dense_out, sensitivity)
        if len(cands) < 2:
            return allocate(anatomy, stats, cfg)
    measured: dict[str, float] = {}
    t_check = time.perf_counter()
    for name, (dims, _rep) in cands.items():
        c = dataclasses.replace(cfg, dims=dims, budget=None)
        measured[name] = _fold_and_measure(model, plan_corp(anatomy, stats, c), c, stats, x, dense_out)
    check_seconds = time.perf_counter() - t_check
    chosen = min(measured, key=lambda k: (measured[k], k != "uniform"))
    if rule is None:  # a later round on these statistics (a latency correction) keeps this rule (issue 40 item 4)
        mkey = _measured_key(cfg, _sensitivity_images(cfg, x))  # as candidates() keyed them
        stats.derived.setdefault(_rule_key(cfg), (chosen, mkey if mkey in stats.derived else None))
    dims, report = cands[chosen]
    report = dict(report)
    report["selection"] = {
        "chosen": chosen, "images": int(x.shape[0]),
        **({} if rule is None else {"rule_reused": "the candidate rule an earlier round on these statistics kept "
                                                   "(a latency correction: only the budget value changed)"}),
        "measured_output_error": measured,
        "proxy_error": {k: float(sum(r["proxy_error"].values())) for k, (_d, r) in cands.items()},
        "seconds": time.perf_counter() - t0, "check_seconds": check_seconds,
        "sensitivity": sensitivity or None,
        "rule": "lowest relative squared error of the model output vs dense on calibration images "
                "(edgeprune.allocation.select)",
    }
    return dims, report
