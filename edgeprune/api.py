"""Python API: load a model, prune it with CORP, evaluate, save.

    import edgeprune
    spec = edgeprune.get_model_spec("fmnist-vit")
    model = spec.create()
    calib = spec.calibration_source(512)
    result = edgeprune.prune(model, calib, target="both", sparsity=0.5)
    edgeprune.save_run("runs/fmnist-50", result.model, result.record)
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.anatomy import find_anatomy
from edgeprune.corp import CorpConfig, corp_prune
from edgeprune.data.sources import TensorSource
from edgeprune.errors import UserError
from edgeprune.flops import count_params, model_flops
from edgeprune.plan import resolve_sparsities
from edgeprune.surgery import block_dims


@dataclasses.dataclass
class PruneResult:
    """Outcome of :func:`prune`.

    Attributes:
        model: the pruned model (eval mode).
        record: the run record (see ``edgeprune.artifact``), JSON-serialisable.
    """

    model: nn.Module
    record: dict[str, Any]


def _version() -> str:
    from edgeprune import __version__

    return __version__


def structure_summary(model: nn.Module) -> dict[str, Any]:
    """Params, FLOPs (per image) and per-block dims of a model."""
    anatomy = find_anatomy(model)
    flops = model_flops(anatomy)
    return {"params": count_params(model), "flops": flops["total"], "blocks": block_dims(anatomy),
            "block_flops": [b["total"] for b in flops["blocks"]]}


def achieved_sparsity(dense_blocks: list[dict], pruned_blocks: list[dict]) -> dict[str, float]:
    """Fraction of MLP hidden channels and of Q/K head dims removed over the whole model."""
    def frac(key: str, weight: str | None) -> float:
        d = sum(b[key] * (b[weight] if weight else 1) for b in dense_blocks)
        p = sum(b[key] * (b[weight] if weight else 1) for b in pruned_blocks)
        return 1.0 - p / d

    return {"mlp": frac("mlp_hidden", None), "attn": frac("qk_dim", "num_heads")}


def prune(model: nn.Module, calibration: torch.Tensor | Any | Callable[[], Iterable[torch.Tensor]], *,
          target: str = "both", sparsity: float | None = 0.5, mlp_sparsity: float | None = None,
          attn_sparsity: float | None = None, compensation: bool = True, criterion: str = "combined",
          ridge_alpha: float | None = None, qk_ridge_alpha: float | None = None, round_to: int = 8,
          batch_size: int = 32, gram_dtype: str = "float32", qk_solver: str = "auto",
          progress: bool = False,
          inplace: bool = False, spec=None, calibration_info: dict | None = None) -> PruneResult:
    """One-shot structured pruning with CORP (corp-v1 Alg. 1).

    Args:
        model: a timm ViT (or ``dinov2-s14``), eval mode. Copied unless ``inplace``.
        calibration: unlabeled images -- a tensor (N, C, H, W), a data source with
            ``batches(batch_size)``, or a callable returning an iterable of (B, C, H, W) batches.
        target: "mlp", "attn" (Q/K head dims) or "both".
        sparsity: fraction of each targeted module's dims removed, in [0, 1).
        mlp_sparsity, attn_sparsity: per-target overrides.
        compensation: fold CORP's closed-form compensation (False = uncompensated baseline with
            the same ranking).
        criterion: MLP ranking criterion: combined, energy, magnitude, active.
        ridge_alpha, qk_ridge_alpha: scale-free ridge strengths (None = defaults).
        round_to: kept dims are multiples of this.
        batch_size: calibration batch size (tensor input).
        gram_dtype: "float32" (default) or "float64" for the per-batch Gram products.
        qk_solver: "auto" (default), "direct" or "cg": how the exact Q/K system is solved (same
            system, same answer to ~1e-9; see :class:`~edgeprune.corp.CorpConfig`).
        progress: progress bars.
        spec: the model's :class:`ModelSpec`, recorded in the run record when given.
        calibration_info: extra calibration description for the record.

    Returns:
        :class:`PruneResult` with the pruned model and its run record.

    Raises:
        UserError: bad settings, unsupported model, empty or mis-shaped calibration data.
    """
    sp = resolve_sparsities(target, sparsity, mlp_sparsity, attn_sparsity)
    cfg = CorpConfig(mlp_sparsity=sp["mlp"], attn_sparsity=sp["attn"], compensation=compensation,
                     mlp_criterion=criterion, round_to=round_to, gram_dtype=gram_dtype,
                     qk_solver=qk_solver)
    if ridge_alpha is not None:
        cfg.ridge_alpha = ridge_alpha
    if qk_ridge_alpha is not None:
        cfg.qk_ridge_alpha = qk_ridge_alpha
    cfg.validate()
    if not inplace:
        model = copy.deepcopy(model)
    model.eval()
    anatomy = find_anatomy(model)
    dense = structure_summary(model)

    num_images = None
    if isinstance(calibration, torch.Tensor):
        calibration = TensorSource(calibration, None, f"tensor {tuple(calibration.shape)}")
    if hasattr(calibration, "batches"):
        source = calibration
        num_images = len(source)
        if num_images == 0:
            raise UserError("the calibration set is empty")
        batches = lambda: (x for x, _ in source.batches(batch_size))  # noqa: E731
        description = getattr(source, "description", type(source).__name__)
    elif callable(calibration):
        batches = calibration
        description = "custom iterable"
    else:
        raise UserError("calibration must be a tensor, a data source or a callable returning batches")

    t0 = time.perf_counter()
    info = corp_prune(anatomy, batches, cfg, num_images=num_images, progress=progress)
    seconds = time.perf_counter() - t0
    pruned = structure_summary(model)
    record = {
        "edgeprune_version": _version(),
        "base_model": spec.to_record() if spec is not None else {"name": type(model).__name__},
        "method": "corp" if compensation else "uncompensated",
        "targets": target,
        "sparsity": sp,
        "achieved_sparsity": achieved_sparsity(dense["blocks"], pruned["blocks"]),
        "settings": {"mlp_criterion": criterion, "qk_criterion": "logit",
                     "ridge_alpha": cfg.ridge_alpha, "qk_ridge_alpha": cfg.qk_ridge_alpha,
                     "ridge_lambda_rule": "lam = alpha * mean diag of the normal matrix (scale-free)",
                     "round_to": round_to, "gram_dtype": gram_dtype, "qk_solver": qk_solver,
                     "compensation": compensation},
        "calibration": {"source": description, "num_images": info["num_images"], "passes": info["passes"],
                        **(calibration_info or {})},
        "blocks": pruned["blocks"],
        "dense_blocks": dense["blocks"],
        "params": pruned["params"], "dense_params": dense["params"],
        "flops": pruned["flops"], "dense_flops": dense["flops"],
        "timing": {"total_s": seconds, "calibration_s": info["calibration_seconds"],
                   "solve_s": info["solve_seconds"]},
        "solve": info["blocks"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return PruneResult(model=model.eval(), record=record)
