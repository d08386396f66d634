"""NuWa end to end: derive a class-specific model under a FLOPs/params/latency budget (nuwa §3, Fig. 5).

    from edgeprune.nuwa import derive
    result = derive(base, classes=[0, 3, 7], images=x_train, labels=y_train, flops=0.6)
    # or latency=0.5, latency_table="t.json" (a measured table, docs/latency_budget.md)
    result.model     # the derived edge ViT (physically smaller, plain modules)
    result.record    # run record for edgeprune.artifact.save_run

Settings: :class:`~edgeprune.nuwa.config.DeriveConfig`; inputs (classes, budget, data split,
target-class metric): :mod:`edgeprune.nuwa.inputs`.

Pipeline (each stage documented in its module):

1. Data: the labeled images are filtered to the target classes; a seeded held-out slice of them
   (``val_size``; pass *train*-split images -- never the test split used for final evaluation)
   scores SKP checkpoints and rho candidates; calibration images default to ``calib_size`` random
   target-class images from the rest (the paper's 128 class-specific images).
2. SKP (:mod:`.skp`): learnable MLP masks on the frozen base -> the anchor (kept channels per MLP),
   materialised as a physically smaller model (exact: masked channels contribute nothing).
3. Statistics of the anchor's MLP hidden activations on the calibration images (one pass).
4. Head (:mod:`.head`): non-target suppression (-100 bias) or slicing.
5. OFP-MHA (:mod:`.ofp_mha`, cached by :mod:`.svd_cache`): SVD factors of the base attention.
6. Budget (:mod:`.budget`): for each rho of a grid, attention dims from the energy ratio, MLP dims
   filling the rest of the budget uniformly; every distinct plan is built (OFP-MLP, :mod:`.ofp_mlp`:
   mean-activation ranking *within the anchor's kept channels*, least-squares fc2 re-fit) and scored
   on the held-out images; the best (accuracy, then loss) is the derived model. ``rho=`` fixes it.

Combination of SKP and OFP-MLP (documented choice): OFP prunes the anchor, i.e. SKP's removed
channels are never restored, each block keeps at most its anchor size (floored to a multiple of 8),
and the ranking / least-squares target use the anchor's own activations (``W2 H`` of the anchor).

Devices (``DeriveConfig.device``: cpu, cuda, cuda:N; ``auto`` resolves to cuda when available):
the data passes run there -- SKP training (:func:`~edgeprune.nuwa.skp.run_skp`), the calibration
statistics (:func:`~edgeprune.calibration.collect.collect_statistics`: float32 products summed in
float64 on the device, TF32 off, returned in host memory) and every held-out / candidate
evaluation (models moved there and back, images batch by batch). Everything closed-form runs in
float64 on the CPU: the SVD factors (data-free, cached), the fc2 least-squares re-fits (Cholesky)
and the surgery that builds each candidate, so the base, anchor and derived models live on the CPU
and the result is returned there, ready to save. The resolved device is in ``record["device"]``
and ``record["config"]["device"]``.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Sequence

import torch
import torch.nn as nn

from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import new_record
from edgeprune.calibration.collect import collect_statistics
from edgeprune.budget import Budget
from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.errors import UserError
from edgeprune.flops import count_params, model_flops
from edgeprune.nuwa import budget as budget_mod
from edgeprune.nuwa.config import DeriveConfig
from edgeprune.nuwa.head import apply_head, head_record, num_classes
from edgeprune.nuwa.inputs import (_batches, _calibration_batches, evaluate_targets,  # noqa: F401
                                   resolve_budget, resolve_classes, split_labeled)
from edgeprune.nuwa.measured import measure_and_correct
from edgeprune.nuwa.ofp_mha import BlockFactors, truncate_attention
from edgeprune.nuwa.ofp_mlp import prune_mlp
from edgeprune.nuwa.skp import Anchor, SKPConfig, run_skp  # noqa: F401
from edgeprune.nuwa.svd_cache import get_factors
from edgeprune.plan import achieved_sparsity
from edgeprune.budget.correction_loop import Measurer
from edgeprune.surgery import block_dims, shrink_mlp


@dataclasses.dataclass
class Prepared:
    """Everything a derivation reuses across budgets: data splits, anchor, statistics, factors.

    Build with :func:`prepare`, then call :func:`derive_from` once per budget.
    """

    base: nn.Module
    classes: list[int]
    class_names: list[str] | None
    config: DeriveConfig
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    anchor: Anchor
    anchor_model: nn.Module  # head applied
    stats: list[MLPStatistics]
    factors: list[BlockFactors]
    info: dict[str, Any]
    spec: Any = None


@dataclasses.dataclass
class DeriveResult:
    """Outcome of :func:`derive` / :func:`derive_from`.

    Attributes:
        model: the derived model (eval mode). anchor_model: the SKP anchor with the same head.
        anchor: :class:`Anchor`. candidates: the evaluated plans. record: the run record.
    """

    model: nn.Module
    anchor_model: nn.Module
    anchor: Anchor
    candidates: list[dict]
    record: dict[str, Any]


# ---- stages -------------------------------------------------------------------------------------
@torch.no_grad()
def materialize_anchor(model: nn.Module, keep: Sequence[torch.Tensor]) -> nn.Module:
    """Physically remove the MLP channels outside ``keep``, in place (exact: W2[:, keep], b2)."""
    an = find_anatomy(model)
    for b, k in zip(an.blocks, keep):
        k = torch.as_tensor(k, dtype=torch.long).sort().values
        if len(k) < b.mlp_hidden:
            w = b.fc2.weight.detach()[:, k].clone()
            shrink_mlp(b, k, w, None if b.fc2.bias is None else b.fc2.bias.detach().clone())
    return model


def check_budget(model: nn.Module, classes, budget: Budget, config: DeriveConfig,
                 class_names: Sequence[str] | None = None) -> None:
    """Raises UserError when ``budget`` (:func:`~edgeprune.nuwa.inputs.resolve_budget`) is below
    the smallest derivable model (all dims at ``round_to``), before any training."""
    probe = copy.deepcopy(model).eval()
    cls = resolve_classes(classes, num_classes(probe), class_names)
    apply_head(probe, cls, config.head)
    dense_cost = budget_mod.measure(model, budget)
    budget_mod.check_feasible(budget_mod.PlanCost(find_anatomy(probe), budget, find_anatomy(model)),
                              budget_mod.budget_target(budget, dense_cost), dense_cost, config.round_to)


def prepare(model: nn.Module, classes: str | Sequence[int | str], images: torch.Tensor, labels: torch.Tensor, *,
            calibration=None, config: DeriveConfig | None = None, class_names: Sequence[str] | None = None,
            anchor: Anchor | None = None, spec=None, progress: bool = False) -> Prepared:
    """Stages 1-5 of the derivation (everything that does not depend on the budget).

    Args:
        model: the base classifier (not modified; copied).
        classes: target classes (indices or names, see :func:`resolve_classes`).
        images, labels: labeled images (train split), labels in base-class indices; only the
            target classes are used.
        calibration: unlabeled calibration images (tensor or source); default: ``calib_size``
            target-class images from the labeled training part.
        config: :class:`DeriveConfig`.
        class_names: base class names (for names in ``classes`` and the record).
        anchor: reuse a previous SKP anchor (same base model and classes) instead of running SKP.
        spec: the base model's ModelSpec (recorded).

    Device: ``config.device`` runs SKP, the statistics pass and the evaluations; the copies of
    the base and anchor models stay on the CPU between passes (module doc, "Devices").
    """
    cfg = config or DeriveConfig()
    cfg.validate()  # also resolves cfg.device ("auto" -> cuda / cpu)
    dev = cfg.device
    t0 = time.perf_counter()
    base = copy.deepcopy(model).eval().cpu()  # SVD, re-fits and surgery: float64 on the CPU
    an = find_anatomy(base)
    k = num_classes(base)
    cls = resolve_classes(classes, k, class_names)
    train, val = split_labeled(images, labels, cls, cfg.val_size, cfg.seed, class_names)
    sliced = cfg.head == "slice"
    timing: dict[str, float] = {}

    # 5 first: data-free, and it fails fast on an unsupported model
    t = time.perf_counter()
    factors, cache_info = get_factors(an, disk=cfg.cache, key_bias=cfg.key_bias)
    timing["svd_s"] = time.perf_counter() - t

    # 2. SKP
    t = time.perf_counter()
    if anchor is None:
        if cfg.skp.steps > 0:
            def ev() -> tuple[float, float]:
                return evaluate_targets(base, val[0], val[1], cls, False, cfg.batch_size * 4, device=dev)
            anchor = run_skp(an, train[0], train[1], ev, cfg.skp, progress=progress, device=dev)
        else:
            anchor = Anchor.full([b.mlp_hidden for b in an.blocks])
            anchor.val_accuracy = evaluate_targets(base, val[0], val[1], cls, False, cfg.batch_size * 4,
                                                   device=dev)[0]
    elif list(anchor.dims) != [b.mlp_hidden for b in an.blocks]:
        raise UserError("the given anchor was derived from a model with other MLP sizes")
    timing["skp_s"] = time.perf_counter() - t
    anchor_model = materialize_anchor(copy.deepcopy(base), anchor.keep)

    # 3. statistics of the anchor's hidden activations
    t = time.perf_counter()
    if calibration is None:
        g = torch.Generator().manual_seed(cfg.seed + 1)
        idx = torch.randperm(len(train[0]), generator=g)[:cfg.calib_size]
        calibration = train[0][idx]
        calib_desc = f"{len(idx)} random labeled target-class images (seed {cfg.seed + 1}), labels unused"
        batches = lambda: _batches(calibration, cfg.batch_size)  # noqa: E731
    else:
        batches, calib_desc, _ = _calibration_batches(calibration, cfg.batch_size)
    st = collect_statistics(find_anatomy(anchor_model), batches(), mlp=True, qk=False,
                            mlp_second_order=cfg.refit, progress=progress, device=dev)
    timing["stats_s"] = time.perf_counter() - t

    # 4. head
    apply_head(anchor_model, cls, cfg.head)
    names = [class_names[c] for c in cls] if class_names else None
    info = {"timing": timing, "svd_cache": cache_info,
            "calibration": {"source": calib_desc, "num_images": st.num_images},
            "data": {"train_images": len(train[0]), "val_images": len(val[0]),
                     "val_source": "held-out slice of the labeled (train-split) target-class images "
                                   f"(seed {cfg.seed})"},
            "prepare_s": time.perf_counter() - t0, "sliced": sliced}
    return Prepared(base=base, classes=cls, class_names=names, config=cfg, train=train, val=val,
                    anchor=anchor, anchor_model=anchor_model.eval(), stats=st.mlp, factors=factors,
                    info=info, spec=spec)


def build_plan(prep: Prepared, plan: budget_mod.Plan) -> nn.Module:
    """The anchor model pruned to ``plan``: SVD-truncated attention + re-fitted MLPs (a copy)."""
    cfg = prep.config
    model = copy.deepcopy(prep.anchor_model)
    an = find_anatomy(model)
    for b, f, q, v, k, st in zip(an.blocks, prep.factors, plan.qk, plan.vo, plan.mlp, prep.stats):
        if (q, v) != (f.qk_dim, f.v_dim):
            truncate_attention(b, f, q, v)
        prune_mlp(b, st, k, cfg.ridge_alpha, cfg.refit)
    return model.eval()


def derive_from(prep: Prepared, *, flops: float | str | None = None, params: float | str | None = None,
                latency: float | str | None = None, latency_table: str | None = None,
                budget: Budget | dict | None = None, progress: bool = False,
                measurer: Measurer | None = None) -> DeriveResult:
    """Stage 6: pick dims for the budget, build and score the candidates, return the best.

    The budget is one of ``flops=`` / ``params=`` (a fraction of the base model or a count such as
    ``"2.3G"``, parsed as ``edgeprune prune`` parses them), ``latency=`` (a fraction of the dense
    latency on ``latency_table``, or ``"12ms"``; :mod:`edgeprune.nuwa.budget`, "Measured costs") or
    ``budget={"kind": K, "value": v}`` for any registered budget kind
    (:func:`~edgeprune.nuwa.inputs.resolve_budget`).
    Candidates are built on the CPU (float64 re-fits) and scored on ``prep.config.device``.
    A latency budget is then measured and corrected (:mod:`edgeprune.nuwa.measured`: re-plans from ``prep``,
    ``measurer(base, derived)`` or the table's backend, ``prep.config.verify_budget`` / ``correction_*``).
    """
    budget = resolve_budget(flops, params, budget=budget, latency=latency, table=latency_table)
    first = _plan(prep, budget)
    return measure_and_correct(lambda b: _plan(prep, b), prep.base, first, budget, prep.config, measurer)


def _plan(prep: Prepared, budget: Budget) -> DeriveResult:
    """Stage 6 for one resolved budget (:func:`derive_from` without the measurement)."""
    cfg = prep.config
    metric = budget.kind
    t0 = time.perf_counter()
    dense_cost = budget_mod.measure(prep.base, budget)
    target = budget_mod.budget_target(budget, dense_cost)
    frac = budget_mod.keep_fraction(budget, dense_cost)
    an_anchor = find_anatomy(prep.anchor_model)
    cost = budget_mod.PlanCost(an_anchor, budget, find_anatomy(prep.base))
    budget_mod.check_feasible(cost, target, dense_cost, cfg.round_to)
    grid = budget_mod.dim_grid(cost, cfg.round_to)
    caps = budget_mod.mlp_caps([len(k) for k in prep.anchor.keep], grid.mlp)
    rhos = (cfg.rho,) if cfg.rho is not None else cfg.rho_grid  # None = adaptive
    plans = budget_mod.plan_candidates(cost, prep.factors, caps, target, rhos, cfg.round_to)
    candidates, plan, model = _score_plans(prep, plans)
    if cost.linear:
        achieved = budget_mod.measure(model, budget)
    else:  # the table's prediction at the derived model's own dims
        blocks = find_anatomy(model).blocks
        achieved = cost.total([b.qk_dim for b in blocks], [b.v_dim for b in blocks], [b.mlp_hidden for b in blocks])
    if achieved > target:  # the cost model and edgeprune.flops disagree: a bug, never a user error
        raise RuntimeError(f"derived model costs {achieved} {metric}, budget {target}")
    search_s = time.perf_counter() - t0
    budget_rec = {"metric": metric, "value": budget.value, "keep_fraction": frac, "target": target,
                  "achieved": achieved, "achieved_fraction": achieved / dense_cost}
    if cost.linear:
        budget_rec["rounding_step"] = cfg.round_to * cost.per_neuron(0)
    else:
        budget_rec.update(unit=budget.unit, table=budget.table)
        budget_rec[metric] = budget_mod.measured_record(cost, grid, achieved, target, dense_cost)
    record = _derive_record(prep, plan, model, candidates, budget_rec, caps, search_s)
    return DeriveResult(model=model, anchor_model=prep.anchor_model, anchor=prep.anchor,
                        candidates=candidates, record=record)


def _score_plans(prep: Prepared, plans: list[budget_mod.Plan]) -> tuple[list[dict], budget_mod.Plan, nn.Module]:
    """Build every plan and score it on the held-out images: (candidate records, best plan, its
    model); best = highest accuracy, then lowest loss, the earlier plan on a tie."""
    cfg = prep.config
    candidates = []
    best = None
    for plan in plans:
        model = build_plan(prep, plan)
        acc, loss = evaluate_targets(model, prep.val[0], prep.val[1], prep.classes, prep.info["sliced"],
                                     cfg.batch_size * 4, device=cfg.device)
        candidates.append({**plan.to_record(), "val_accuracy": acc, "val_loss": loss})
        if best is None or (acc, -loss) > best[0]:
            best = ((acc, -loss), plan, model)
    assert best is not None
    return candidates, best[1], best[2]


def _derive_record(prep: Prepared, plan: budget_mod.Plan, model: nn.Module, candidates: list[dict],
                   budget_rec: dict, caps: list[int], search_s: float) -> dict[str, Any]:
    """The run record of a derivation (``edgeprune.artifact.new_record``, method ``nuwa``)."""
    cfg = prep.config
    base_an, an = find_anatomy(prep.base), find_anatomy(model)
    dense_blocks, blocks = block_dims(base_an), block_dims(an)
    dense_flops, dense_params = model_flops(base_an)["total"], count_params(prep.base)
    flops_now, params_now = model_flops(an)["total"], count_params(model)
    anchor_an = find_anatomy(prep.anchor_model)
    timing = {**prep.info["timing"], "search_s": search_s}
    timing["total_s"] = sum(timing.values())
    spec = prep.spec
    base_rec = spec.to_record() if spec is not None else {"name": type(prep.base).__name__,
                                                         "num_classes": num_classes(prep.base)}
    head = head_record(model, prep.classes, cfg.head, prep.class_names, num_classes(prep.base))
    a = achieved_sparsity(dense_blocks, blocks)
    vo_dense = sum(b["v_dim"] * b["num_heads"] for b in dense_blocks)
    a["vo"] = 1.0 - sum(b["v_dim"] * b["num_heads"] for b in blocks) / vo_dense
    return new_record(
        "nuwa", base_rec, cfg,
        {"blocks": dense_blocks, "params": dense_params, "flops": dense_flops},
        {"blocks": blocks, "params": params_now, "flops": flops_now},
        calibration=prep.info["calibration"], timing=timing, device=cfg.device,
        targets="both",
        sparsity={"budget": budget_rec["metric"], "keep_fraction": budget_rec["keep_fraction"]},
        achieved_sparsity=a,
        settings={"head": cfg.head, "rho": plan.rho, "rho_fixed": cfg.rho is not None,
                  "key_bias": cfg.key_bias, "ridge_alpha": cfg.ridge_alpha, "refit": cfg.refit,
                  "round_to": cfg.round_to, "energy": "squared singular values (Frobenius)",
                  "mlp_ranking": "mean activation, within the SKP anchor",
                  "mlp_dims": "uniform (water-filling, capped at the anchor)",
                  "skp": dataclasses.asdict(cfg.skp), "val_size": len(prep.val[0]),
                  "calib_size": prep.info["calibration"]["num_images"], "seed": cfg.seed},
        head=head,
        derivation={
            "classes": prep.classes, "class_names": prep.class_names, "head": cfg.head,
            "budget": budget_rec,
            "rho": plan.rho,
            "anchor": {**prep.anchor.to_record(), "flops": model_flops(anchor_an)["total"],
                       "params": count_params(prep.anchor_model), "blocks": block_dims(anchor_an)},
            "ofp_mha": {"qk": plan.qk, "vo": plan.vo, "energy_qk": plan.energy_qk, "energy_vo": plan.energy_vo,
                        "svd_cache": prep.info["svd_cache"]},
            "ofp_mlp": {"mlp": plan.mlp, "caps": caps},
            "candidates": candidates,
            "data": prep.info["data"],
        },
    )


def derive(model: nn.Module, classes: str | Sequence[int | str], images: torch.Tensor, labels: torch.Tensor, *,
           flops: float | str | None = None, params: float | str | None = None,
           latency: float | str | None = None, latency_table: str | None = None, budget: Budget | dict | None = None,
           calibration=None,
           config: DeriveConfig | None = None, class_names: Sequence[str] | None = None,
           anchor: Anchor | None = None, spec=None, progress: bool = False,
           measurer: Measurer | None = None) -> DeriveResult:
    """Derive a class-specific model from ``model`` under a FLOPs, params or latency budget (NuWa).

    Args:
        model: base classifier (timm ViT family), not modified.
        classes: target classes, indices or names (with ``class_names``).
        images, labels: labeled *train-split* images; only target classes are used.
        flops, params: the budget, exactly one: a fraction of the base model's FLOPs (or params)
            to keep, in (0, 1], or an absolute count (a number > 1 or a string such as ``"2.3G"``);
            or ``budget={"kind": K, "value": v}`` for any registered budget kind.
        latency, latency_table: a latency budget instead (issue 30): a fraction of the dense
            model's predicted latency on the table at ``latency_table`` (``0.5``) or ``"12ms"`` per
            batch of the table's batch size (:mod:`edgeprune.nuwa.budget`, "Measured costs").
        calibration: unlabeled calibration images (tensor or data source) or None (see
            :func:`prepare`).
        config: :class:`DeriveConfig` (SKP steps etc.; ``device`` = where the data passes run,
            module doc "Devices").
        class_names: base class names.
        anchor: reuse an SKP anchor; spec: ModelSpec for the record.
        measurer: ``(base, derived) -> {"dense_ms", "pruned_ms", "ratio"}`` for a latency budget's
            measure-and-correct loop (default: the table's backend where it runs here; :func:`derive_from`).

    Returns:
        :class:`DeriveResult` (models on the CPU).

    Raises:
        UserError: bad classes, budget, data or settings, an unknown device or CUDA not
            available (one line).
    """
    budget = resolve_budget(flops, params, budget=budget, latency=latency, table=latency_table)
    cfg = config or DeriveConfig()
    cfg.validate()
    check_budget(model, classes, budget, cfg, class_names)  # fail before SKP
    prep = prepare(model, classes, images, labels, calibration=calibration, config=cfg,
                   class_names=class_names, anchor=anchor, spec=spec, progress=progress)
    return derive_from(prep, budget=budget, progress=progress, measurer=measurer)
