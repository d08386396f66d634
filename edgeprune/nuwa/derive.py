"""NuWa end to end: derive a class-specific model under a FLOPs/params budget (nuwa §3, Fig. 5).

    from edgeprune.nuwa import derive
    result = derive(base, classes=[0, 3, 7], images=x_train, labels=y_train, flops=0.6)
    result.model     # the derived edge ViT (physically smaller, plain modules)
    result.record    # run record for edgeprune.artifact.save_run

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
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from edgeprune.anatomy import find_anatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.errors import UserError
from edgeprune.flops import count_params, model_flops
from edgeprune.nuwa import budget as budget_mod
from edgeprune.nuwa.head import (HEAD_MODES, apply_head, head_record, num_classes, target_logits,
                                 target_predictions)
from edgeprune.nuwa.ofp_mha import KEY_BIAS_MODES, BlockFactors, truncate_attention
from edgeprune.nuwa.ofp_mlp import DEFAULT_RIDGE_ALPHA, prune_mlp
from edgeprune.nuwa.skp import Anchor, SKPConfig, run_skp
from edgeprune.nuwa.svd_cache import get_factors
from edgeprune.surgery import block_dims, shrink_mlp


@dataclasses.dataclass
class DeriveConfig:
    """Settings of a derivation (SKP settings in ``skp``).

    Attributes:
        skp: :class:`SKPConfig`; ``skp.steps = 0`` skips SKP (anchor = base model).
        head: "suppress" (default) or "slice".
        val_size: held-out target-class images (from the labeled data) for SKP checkpoints and rho.
        calib_size: calibration images drawn from the labeled data when none are given.
        rho: fixed retained-energy ratio (None = search ``rho_grid``).
        rho_grid: candidate ratios (None = adaptive, :func:`edgeprune.nuwa.budget.rho_candidates`).
        key_bias: "drop" (default) or "augment" -- see :mod:`edgeprune.nuwa.ofp_mha`.
        ridge_alpha: scale-free ridge of the fc2 least-squares re-fit.
        refit: False = plain removal of the low-activation channels (ablation).
        round_to: every pruned dim is a multiple of this.
        cache: use the on-disk SVD cache (the in-memory one is always used).
        batch_size: batch size of calibration and evaluation passes.
        seed: data split / sampling seed.
    """

    skp: SKPConfig = dataclasses.field(default_factory=SKPConfig)
    head: str = "suppress"
    val_size: int = 300
    calib_size: int = 128
    rho: float | None = None
    rho_grid: tuple[float, ...] | None = None
    key_bias: str = "drop"
    ridge_alpha: float = DEFAULT_RIDGE_ALPHA
    refit: bool = True
    round_to: int = 8
    cache: bool = True
    batch_size: int = 64
    seed: int = 0

    def validate(self) -> None:
        """Raises UserError for out-of-range settings."""
        if self.head not in HEAD_MODES:
            raise UserError(f"head mode must be one of {', '.join(HEAD_MODES)}, got {self.head!r}")
        if self.key_bias not in KEY_BIAS_MODES:
            raise UserError(f"key bias mode must be one of {', '.join(KEY_BIAS_MODES)}")
        if self.rho is not None and not 0.0 <= self.rho <= 1.0:
            raise UserError(f"--rho must be in [0, 1], got {self.rho}")
        if self.ridge_alpha < 0:
            raise UserError(f"ridge alpha must be >= 0, got {self.ridge_alpha}")
        if self.round_to < 1:
            raise UserError(f"round_to must be >= 1, got {self.round_to}")
        for name in ("val_size", "calib_size", "batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        s = self.skp
        if s.steps < 0 or s.batch_size < 1 or s.eval_every < 1:
            raise UserError("SKP steps must be >= 0, batch size and eval interval >= 1")
        if s.lr_beta < 0 or s.lr_mask < 0 or s.weight_decay < 0:
            raise UserError("SKP learning rates and weight decay must be >= 0")


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


# ---- inputs -------------------------------------------------------------------------------------
def resolve_classes(classes: str | Sequence[int | str], num_outputs: int,
                    class_names: Sequence[str] | None = None) -> list[int]:
    """Target classes as base-model indices, in the given order.

    Args:
        classes: "0,3,7", "T-shirt/top,Bag", or a sequence of ints / names.
        num_outputs: the base classifier's number of classes.
        class_names: names of the base classes (for names; case-insensitive).

    Raises:
        UserError: empty, unknown name, index out of range, duplicates.
    """
    items = [c.strip() for c in classes.split(",")] if isinstance(classes, str) else list(classes)
    if not items or any(isinstance(c, str) and not c for c in items):
        raise UserError("--classes needs a comma-separated list of class indices or names, e.g. 0,3,7")
    lower = {n.lower(): i for i, n in enumerate(class_names or [])}
    out: list[int] = []
    for c in items:
        if isinstance(c, str) and not c.lstrip("-").isdigit():
            if c.lower() not in lower:
                known = f" (known: {', '.join(class_names)})" if class_names and len(class_names) <= 20 else ""
                raise UserError(f"unknown class name {c!r}{known}")
            idx = lower[c.lower()]
        else:
            idx = int(c)
        if not 0 <= idx < num_outputs:
            raise UserError(f"class index {idx} out of range: the model has {num_outputs} classes (0..{num_outputs - 1})")
        if idx in out:
            raise UserError(f"class {idx} is listed twice in --classes")
        out.append(idx)
    return out


def resolve_budget(flops: float | None, params: float | None) -> tuple[str, float]:
    """(metric, fraction) from exactly one of flops / params in (0, 1].

    Raises:
        UserError: neither or both given, or a fraction outside (0, 1].
    """
    if (flops is None) == (params is None):
        raise UserError("give exactly one budget: --flops FRACTION or --params FRACTION (of the base model, to keep)")
    metric, frac = ("flops", flops) if flops is not None else ("params", params)
    if not 0.0 < float(frac) <= 1.0:
        raise UserError(f"--{metric} is the fraction of the base model's {metric} to keep, in (0, 1]; got {frac}")
    return metric, float(frac)


def split_labeled(images: torch.Tensor, labels: torch.Tensor, classes: Sequence[int], val_size: int,
                  seed: int, class_names: Sequence[str] | None = None):
    """Target-class images split into (train, val); val is a seeded random held-out slice.

    Raises:
        UserError: a target class without labeled images, or too few images to hold some out.
    """
    labels = torch.as_tensor(labels)
    if len(images) != len(labels):
        raise UserError(f"{len(images)} images but {len(labels)} labels")
    for c in classes:
        if not bool((labels == c).any()):
            name = f" ({class_names[c]})" if class_names and c < len(class_names) else ""
            raise UserError(f"no labeled images for class {c}{name}")
    sel = torch.isin(labels, torch.as_tensor(list(classes))).nonzero().flatten()
    if len(sel) < 2:
        raise UserError(f"need at least 2 labeled target-class images, got {len(sel)}")
    perm = sel[torch.randperm(len(sel), generator=torch.Generator().manual_seed(seed))]
    n_val = max(1, min(val_size, len(perm) // 5))
    v, t = perm[:n_val], perm[n_val:]
    return (images[t], labels[t]), (images[v], labels[v])


def _batches(images: torch.Tensor, batch_size: int) -> Iterable[torch.Tensor]:
    for i in range(0, len(images), batch_size):
        yield images[i:i + batch_size]


def _calibration_batches(calibration, batch_size: int):
    """(callable returning an iterable of image batches, description, count)."""
    if isinstance(calibration, torch.Tensor):
        return (lambda: _batches(calibration, batch_size)), f"tensor {tuple(calibration.shape)}", len(calibration)
    if hasattr(calibration, "batches"):
        desc = getattr(calibration, "description", type(calibration).__name__)
        return (lambda: (x for x, _ in calibration.batches(batch_size))), desc, len(calibration)
    raise UserError("calibration must be an image tensor or a data source with batches()")


@torch.no_grad()
def evaluate_targets(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, classes: Sequence[int],
                     sliced: bool = False, batch_size: int = 256) -> tuple[float, float]:
    """(top-1, mean cross-entropy) with the argmax / softmax over the target classes only.

    Args:
        labels: base-class indices (all in ``classes``).
        sliced: the model's outputs are the target classes in ``classes`` order.
    """
    model.eval()
    pos = {c: i for i, c in enumerate(classes)}
    tgt = torch.as_tensor([pos[int(y)] for y in labels], dtype=torch.long)
    correct, loss, n = 0, 0.0, 0
    for i in range(0, len(images), batch_size):
        logits = model(images[i:i + batch_size])
        correct += (target_predictions(logits, classes, sliced) == labels[i:i + batch_size]).sum().item()
        loss += F.cross_entropy(target_logits(logits, classes, sliced).float(), tgt[i:i + batch_size],
                                reduction="sum").item()
        n += len(logits)
    return correct / max(n, 1), loss / max(n, 1)


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


def check_budget(model: nn.Module, classes, metric: str, frac: float, config: DeriveConfig,
                 class_names: Sequence[str] | None = None) -> None:
    """Raises UserError when the budget is below the smallest derivable model (all dims at
    ``round_to``), before any training."""
    probe = copy.deepcopy(model).eval()
    cls = resolve_classes(classes, num_classes(probe), class_names)
    apply_head(probe, cls, config.head)
    dense_cost = budget_mod.measure(model, metric)
    budget_mod.check_feasible(budget_mod.CostModel(find_anatomy(probe), metric),
                              int(math.floor(frac * dense_cost)), dense_cost, config.round_to)


# ---- stages -------------------------------------------------------------------------------------
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
    """
    cfg = config or DeriveConfig()
    cfg.validate()
    t0 = time.perf_counter()
    base = copy.deepcopy(model).eval()
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
                return evaluate_targets(base, val[0], val[1], cls, False, cfg.batch_size * 4)
            anchor = run_skp(an, train[0], train[1], ev, cfg.skp, progress=progress)
        else:
            anchor = Anchor.full([b.mlp_hidden for b in an.blocks])
            anchor.val_accuracy = evaluate_targets(base, val[0], val[1], cls, False, cfg.batch_size * 4)[0]
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
                            mlp_second_order=cfg.refit, progress=progress)
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


def derive_from(prep: Prepared, *, flops: float | None = None, params: float | None = None,
                progress: bool = False) -> DeriveResult:
    """Stage 6: pick dims for the budget, build and score the candidates, return the best."""
    from edgeprune.api import _version, achieved_sparsity

    cfg = prep.config
    metric, frac = resolve_budget(flops, params)
    t0 = time.perf_counter()
    dense_cost = budget_mod.measure(prep.base, metric)
    target = int(math.floor(frac * dense_cost))
    an_anchor = find_anatomy(prep.anchor_model)
    cost = budget_mod.CostModel(an_anchor, metric)
    budget_mod.check_feasible(cost, target, dense_cost, cfg.round_to)
    caps = budget_mod.mlp_caps([len(k) for k in prep.anchor.keep], cfg.round_to)
    grid = (cfg.rho,) if cfg.rho is not None else cfg.rho_grid  # None = adaptive
    plans = budget_mod.plan_candidates(cost, prep.factors, caps, target, grid, cfg.round_to)
    sliced = prep.info["sliced"]
    candidates = []
    best = None
    for plan in plans:
        model = build_plan(prep, plan)
        acc, loss = evaluate_targets(model, prep.val[0], prep.val[1], prep.classes, sliced, cfg.batch_size * 4)
        candidates.append({**plan.to_record(), "val_accuracy": acc, "val_loss": loss})
        if best is None or (acc, -loss) > best[0]:
            best = ((acc, -loss), plan, model)
    assert best is not None
    _, plan, model = best
    achieved = budget_mod.measure(model, metric)
    if achieved > target:  # the cost model and edgeprune.flops disagree: a bug, never a user error
        raise RuntimeError(f"derived model costs {achieved} {metric}, budget {target}")
    search_s = time.perf_counter() - t0

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
    a["vo"] = 1.0 - sum(b["v_dim"] * b["num_heads"] for b in blocks) / sum(b["v_dim"] * b["num_heads"] for b in dense_blocks)
    record = {
        "edgeprune_version": _version(),
        "base_model": base_rec,
        "method": "nuwa",
        "targets": "both",
        "sparsity": {"budget": metric, "keep_fraction": frac},
        "achieved_sparsity": a,
        "settings": {"head": cfg.head, "rho": plan.rho, "rho_fixed": cfg.rho is not None,
                     "key_bias": cfg.key_bias, "ridge_alpha": cfg.ridge_alpha, "refit": cfg.refit,
                     "round_to": cfg.round_to, "energy": "squared singular values (Frobenius)",
                     "mlp_ranking": "mean activation, within the SKP anchor",
                     "mlp_dims": "uniform (water-filling, capped at the anchor)",
                     "skp": dataclasses.asdict(cfg.skp), "val_size": len(prep.val[0]),
                     "calib_size": prep.info["calibration"]["num_images"], "seed": cfg.seed},
        "calibration": prep.info["calibration"],
        "blocks": blocks,
        "dense_blocks": dense_blocks,
        "params": params_now, "dense_params": dense_params,
        "flops": flops_now, "dense_flops": dense_flops,
        "head": head,
        "derivation": {
            "classes": prep.classes, "class_names": prep.class_names, "head": cfg.head,
            "budget": {"metric": metric, "keep_fraction": frac, "target": target, "achieved": achieved,
                       "achieved_fraction": achieved / dense_cost,
                       "rounding_step": cfg.round_to * cost.per_neuron(0)},
            "rho": plan.rho,
            "anchor": {**prep.anchor.to_record(), "flops": model_flops(anchor_an)["total"],
                       "params": count_params(prep.anchor_model), "blocks": block_dims(anchor_an)},
            "ofp_mha": {"qk": plan.qk, "vo": plan.vo, "energy_qk": plan.energy_qk, "energy_vo": plan.energy_vo,
                        "svd_cache": prep.info["svd_cache"]},
            "ofp_mlp": {"mlp": plan.mlp, "caps": caps},
            "candidates": candidates,
            "data": prep.info["data"],
        },
        "timing": timing,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return DeriveResult(model=model, anchor_model=prep.anchor_model, anchor=prep.anchor,
                        candidates=candidates, record=record)


def derive(model: nn.Module, classes: str | Sequence[int | str], images: torch.Tensor, labels: torch.Tensor, *,
           flops: float | None = None, params: float | None = None, calibration=None,
           config: DeriveConfig | None = None, class_names: Sequence[str] | None = None,
           anchor: Anchor | None = None, spec=None, progress: bool = False) -> DeriveResult:
    """Derive a class-specific model from ``model`` under a FLOPs or params budget (NuWa).

    Args:
        model: base classifier (timm ViT family), not modified.
        classes: target classes, indices or names (with ``class_names``).
        images, labels: labeled *train-split* images; only target classes are used.
        flops, params: fraction of the base model's FLOPs (or params) to keep; exactly one.
        calibration: unlabeled calibration images (tensor or data source) or None (see
            :func:`prepare`).
        config: :class:`DeriveConfig` (SKP steps etc.).
        class_names: base class names.
        anchor: reuse an SKP anchor; spec: ModelSpec for the record.

    Returns:
        :class:`DeriveResult`.

    Raises:
        UserError: bad classes, budget, data or settings (one line).
    """
    metric, frac = resolve_budget(flops, params)
    cfg = config or DeriveConfig()
    cfg.validate()
    check_budget(model, classes, metric, frac, cfg, class_names)  # fail before SKP
    prep = prepare(model, classes, images, labels, calibration=calibration, config=cfg,
                   class_names=class_names, anchor=anchor, spec=spec, progress=progress)
    return derive_from(prep, flops=flops, params=params, progress=progress)
