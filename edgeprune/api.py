"""Python API: load a model, prune it with CORP, evaluate, save.

    import edgeprune
    spec = edgeprune.get_model_spec("fmnist-vit")
    model = spec.create()
    calib = spec.calibration_source(512)
    config = edgeprune.CorpConfig.from_target("both", 0.5)   # or: target="both", sparsity=0.5
    result = edgeprune.prune(model, calib, config, spec=spec)
    edgeprune.save_run("runs/fmnist-50", result.model, result.record)
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.allocation.budget import budget_kinds, make_budget
from edgeprune.allocation.latency_cost import config_defaults
from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import new_record
from edgeprune.calibration.collect import calibration_device
from edgeprune.corp.config import CorpConfig, bias_correction_used
from edgeprune.pipeline import check_prunable, corp_prune
from edgeprune.data.sources import TensorSource
from edgeprune.embed.auto import choose_embed, is_auto
from edgeprune.embed.step import embed_budget, embed_stage, slices_first
from edgeprune.distributed import all_reduce_sum, distributed_info, is_distributed, shard_calibration
from edgeprune.errors import UserError
from edgeprune.flops import count_params, model_flops
from edgeprune.layers.class_token_block import class_token_plan, to_class_token_block
from edgeprune.option_checks import refuse_sparsities_with_budget
from edgeprune.plan import achieved_sparsity  # noqa: F401  (re-exported: nuwa, tools)
from edgeprune.solve.head_refit import fit_head, refit_note, refit_statistics
from edgeprune.solve.output_bias import classifier_head, fold_output_bias, output_sums
from edgeprune.surgery import block_dims
from edgeprune.torch_device import resolve_device
from edgeprune.zoo.registry import get_model_spec


@dataclasses.dataclass
class PruneResult:
    """Outcome of :func:`prune`.

    Attributes:
        model: the pruned model (eval mode).
        record: the run record (see ``edgeprune.artifact``), JSON-serialisable.
    """

    model: nn.Module
    record: dict[str, Any]


def structure_summary(model: nn.Module) -> dict[str, Any]:
    """Params, FLOPs (per image) and per-block dims of a model."""
    anatomy = find_anatomy(model)
    flops = model_flops(anatomy)
    return {"params": count_params(model), "flops": flops["total"], "blocks": block_dims(anatomy),
            "block_flops": [b["total"] for b in flops["blocks"]]}


_UNSET: Any = object()
_LEGACY = {"criterion": "mlp_criterion"}  # old keyword -> CorpConfig field
#: CorpConfig field -> key of the record's ``sparsity`` entry (mlp and attn always; others when > 0)
_SPARSITY_KEYS = {"mlp_sparsity": "mlp", "attn_sparsity": "attn", "v_sparsity": "v", "head_sparsity": "heads"}

#: record ``settings`` key -> CorpConfig field (in the record's order); None values are "auto"
_SETTINGS_FIELDS = {"mlp_criterion": "mlp_criterion", "qk_criterion": None, "ridge_alpha": "ridge_alpha",
                    "qk_ridge_alpha": "qk_ridge_alpha", "ridge_lambda_rule": None, "round_to": "round_to",
                    "gram_dtype": "gram_dtype", "qk_solver": "qk_solver", "compensation": "compensation",
                    "gram_tokens": "gram_tokens", "gram_tokens_used": None,
                    "bias_correction": "bias_correction_images", "head_refit": "head_refit",
                    "last_block": "last_block"}
#: settings that are not config fields: constants of the method
_SETTINGS_CONSTANTS = {"qk_criterion": "logit",
                       "ridge_lambda_rule": "lam = alpha * mean diag of the normal matrix (scale-free)"}


def requested_sparsity(config: CorpConfig) -> dict[str, float]:
    """The record's ``sparsity``: mlp and attn always, v and heads when > 0 (from ``asdict(config)``)."""
    fields = dataclasses.asdict(config)
    return {key: float(fields[name]) for name, key in _SPARSITY_KEYS.items()
            if name in fields and (key in ("mlp", "attn") or fields[name])}


def record_settings(config: CorpConfig, info: dict, last_block: dict[int, int]) -> dict[str, Any]:
    """The record's ``settings``, read from ``asdict(config)`` (``None`` fields recorded as "auto"),
    the method's constants, the MLP tokens used (``info``) and the class-token blocks."""
    fields = dataclasses.asdict(config)
    out: dict[str, Any] = {}
    for key, name in _SETTINGS_FIELDS.items():
        if name is None:
            out[key] = _SETTINGS_CONSTANTS[key] if key in _SETTINGS_CONSTANTS else info.get(key, 0)
        else:
            out[key] = "auto" if fields[name] is None else fields[name]
    out["class_token_blocks"] = {str(i): t for i, t in last_block.items()}
    return out


#: Target when none is given: with ``--sparsity`` the MLP and Q/K dims (CORP's setting); with a
#: budget also the V dims, so the allocator can spend it on every prunable dim (on the pretrained
#: DINOv2 of ``dinov2-s14-fmnist``: +1.5 points top-1 at FLOPs x0.5, +6.1 at x0.4; docs/accuracy.md).
DEFAULT_TARGET = "both"
DEFAULT_BUDGET_TARGET = "all"


def corp_config(target: str | None = None, sparsity: float | None = 0.5, **settings: Any) -> CorpConfig:
    """A :class:`CorpConfig` from the Python API's keyword arguments (``target=``, ``sparsity=``,
    ``mlp_sparsity=``, ``criterion=``, ``ridge_alpha=`` ...). ``None`` values mean "default".

    ``flops=`` / ``params=`` / ``<kind>=`` for any kind registered with
    ``edgeprune.allocation.cost.register_cost_model`` (a fraction of the dense model in (0, 1], or an
    absolute count; a number or a string such as ``"2.3G"``; ``latency=0.5`` or ``"12ms"`` with
    ``latency_table="t.json"``, docs/latency_budget.md) set a budget (``CorpConfig.budget``) that replaces
    ``sparsity``: the allocator chooses the kept dims of the target's modules
    (``edgeprune.allocation``, METHODS.md §5 "Budgeted allocation").

    ``target=None`` means ``"both"`` (MLP + Q/K) with a sparsity and ``"all"`` (MLP + Q/K + V)
    with a budget (:data:`DEFAULT_BUDGET_TARGET`).

    Raises:
        UserError: unknown setting, bad target or sparsity, invalid settings, both ``flops`` and
            ``params``, a bad budget value.
    """
    budget = make_budget(table=settings.pop("latency_table", None),
                         **{kind: settings.pop(kind) for kind in budget_kinds() if kind in settings})
    refuse_sparsities_with_budget(budget and f"{budget['kind']}=",
                                  {f"{k}=": settings.get(k) for k in _SPARSITY_KEYS})  # issue 32
    if budget is not None:
        settings["budget"] = budget
        sparsity = None  # the budget replaces the sparsity
        for key, value in config_defaults(budget).items():  # a latency table's rules (fused layout)
            settings[key] = value if settings.get(key) is None else settings[key]
    if target is None:
        target = DEFAULT_TARGET if budget is None else DEFAULT_BUDGET_TARGET
    kw: dict[str, Any] = {}
    for key, value in settings.items():
        if value is None:
            continue
        kw[_LEGACY.get(key, key)] = value
    return CorpConfig.from_target(target, sparsity, **kw)


def calibration_batches(calibration: Any, batch_size: int) -> tuple[Callable[[], Iterable[torch.Tensor]], str,
                                                                   int | None]:
    """(callable returning fresh (B, C, H, W) batches, description, number of images or None).

    Under torch.distributed (torchrun) the callable yields this rank's share of the batches
    (:func:`edgeprune.distributed.shard_calibration`); the number of images is the whole set's.

    Raises:
        UserError: an empty set, or something that is not a tensor / data source / callable.
    """
    if isinstance(calibration, torch.Tensor):
        calibration = TensorSource(calibration, None, f"tensor {tuple(calibration.shape)}")
    if hasattr(calibration, "batches"):
        source = calibration
        num_images = len(source)
        if num_images == 0:
            raise UserError("the calibration set is empty")
        return (shard_calibration(lambda: (x for x, _ in source.batches(batch_size)), num_images, batch_size,
                                  source), getattr(source, "description", type(source).__name__), num_images)
    if callable(calibration):
        return shard_calibration(calibration, None, batch_size), "custom iterable", None
    raise UserError("calibration must be a tensor, a data source or a callable returning batches")


def base_model_record(model: nn.Module, spec=None) -> dict[str, Any]:
    """The ``base_model`` entry of a run record.

    ``spec.to_record()`` when a spec is given. Without one, a timm model is recognised by its
    ``pretrained_cfg["architecture"]`` when rebuilding that name (with the model's number of
    classes) gives exactly the same parameter names and shapes -- so ``load_run`` can rebuild
    it; anything else is recorded by its class name only (then pass ``spec=``).
    """
    if spec is not None:
        return spec.to_record()
    arch = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    if arch:
        try:
            guess = get_model_spec(arch, num_classes=getattr(model, "num_classes", None))
            built = guess.create(pretrained=False)
        except (UserError, RuntimeError, TypeError, ValueError):
            built = None
        if built is not None:
            mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            theirs = {k: tuple(v.shape) for k, v in built.state_dict().items()}
            if mine == theirs:
                return guess.to_record()
    return {"name": type(model).__name__}


def work_device(config: CorpConfig, device: str) -> str:
    """The device a prune with ``config`` runs on, given the resolved ``device``: "cpu" for
    ``sequential`` calibration (it keeps its token streams in host memory and runs every pass on
    the CPU; the record says where the work ran), ``device`` otherwise."""
    return "cpu" if config.sequential else device


def require_cpu(device: str, what: str) -> None:
    """Raises UserError unless ``device`` is "cpu": ``what`` runs on the CPU for now."""
    if str(device) != "cpu":
        raise UserError(f"{what} runs on the CPU for now, got device {device!r} (use --device cpu)")


def prune(model: nn.Module, calibration: torch.Tensor | Any | Callable[[], Iterable[torch.Tensor]],
          config: CorpConfig | None = None, *, spec=None, progress: bool = False, inplace: bool = False,
          batch_size: int = 32, device: str = "cpu", calibration_info: dict | None = None,
          target: str = _UNSET, sparsity: float | None = _UNSET, **settings: Any) -> PruneResult:
    """One-shot structured pruning with CORP (corp-v1 Alg. 1).

    Either pass a :class:`~edgeprune.corp.CorpConfig` (what the CLI builds), or the same settings
    as keywords (``target="both", sparsity=0.5, mlp_sparsity=..., attn_sparsity=...,
    compensation=, criterion=, ridge_alpha=, qk_ridge_alpha=, round_to=, gram_dtype=,
    qk_solver=`` and any other CorpConfig field, or ``flops=`` / ``params=`` / ``latency=`` (with
    ``latency_table=``) for a budget instead of a sparsity, see :func:`corp_config`), which build one with
    :meth:`CorpConfig.from_target`; not both.

    Args:
        model: a timm ViT (or ``dinov2-s14``), eval mode. Copied unless ``inplace``.
        calibration: unlabeled images -- a tensor (N, C, H, W), a data source with
            ``batches(batch_size)``, or a callable returning an iterable of (B, C, H, W) batches.
        config: the CORP settings (sparsity per module, compensation, ridge alphas, ...).
        spec: the model's :class:`ModelSpec`, recorded in the run record (without it, see
            :func:`base_model_record`).
        progress: progress display (:mod:`edgeprune.progress`: bars on a terminal).
        inplace: prune ``model`` itself.
        batch_size: calibration batch size (tensor or source input).
        device: torch device of the calibration pass: "cpu", "cuda", "cuda:N" or "auto" (cuda if available, else
            cpu). The statistics are accumulated on it (float32 products summed in float64); the closed-form
            solves run in float64 on the CPU and the model is returned on the CPU (``edgeprune.calibration.collect``).
            Recorded in the run record. ``sequential`` calibration runs on the CPU whatever the device (recorded "cpu").
        calibration_info: extra calibration description for the record (seed, size requested).
        target, sparsity, **settings: the keyword form of ``config`` (see above).

    Under an initialised torch.distributed group (torchrun) every rank calls this with the same
    arguments; each streams its share of the calibration batches, the statistics are combined
    (:mod:`edgeprune.distributed`, METHODS.md §5) and every rank returns the same pruned model;
    the record's ``calibration`` says ``world_size`` and ``backend``.

    Returns:
        :class:`PruneResult` with the pruned model and its run record
        (:func:`edgeprune.artifact.new_record`; ``config`` holds ``asdict(config)``).

    Raises:
        UserError: bad settings, unsupported model, empty or mis-shaped calibration data, both
            ``config`` and keyword settings given, an unknown device or CUDA not available.
    """
    config = _config_argument(config, target, sparsity, settings)
    if is_auto(config):  # issue 33: embed_sparsity="auto", one whole prune per candidate D' (edgeprune.embed.auto)
        return choose_embed(prune, model, calibration, config, calibration_batches(calibration, batch_size)[0], inplace=inplace,
                            spec=spec, progress=progress, batch_size=batch_size, device=device, calibration_info=calibration_info)
    device = work_device(config, resolve_device(device))
    if not inplace:
        model = copy.deepcopy(model)
    model.eval()
    anatomy = find_anatomy(model)
    last_block = class_token_plan(config, anatomy)  # raises for --last-block cls on another model
    check_prunable(anatomy, config)  # rounding, dims and an unreachable budget: before any pass
    base_record = base_model_record(model, spec)
    dense = structure_summary(model)
    batches, description, num_images = calibration_batches(calibration, batch_size)

    t0 = time.perf_counter()
    asked, config = config, embed_budget(config, anatomy)  # issue 33: a fraction of the unsliced model
    correction = _BiasCorrection(model, batches, bias_correction_used(config), config.sequential or slices_first(config),
                                 refit=config.head_refit is not False)
    with calibration_device(device):
        anatomy, config, embed = embed_stage(anatomy, batches, config, "first")
        info = corp_prune(anatomy, batches, config, num_images=num_images, progress=progress, checked=True)
        anatomy, config, embed = embed_stage(anatomy, batches, config, "last", embed)
    info["embed"] = embed
    if last_block:  # exact: the output's tokens are computed as before, the others not at all
        to_class_token_block(anatomy.vit, next(iter(last_block.values())))
    bias_record = correction.fold(model, info.get("output_sums"), info.get("output_rows"))
    seconds = time.perf_counter() - t0
    record = _prune_record(asked, base_record, dense, structure_summary(model), info, last_block, bias_record,
                           source=description, batch_size=batch_size, calibration_info=calibration_info,
                           seconds=seconds, device=device)
    return PruneResult(model=model.eval(), record=record)


def _config_argument(config: CorpConfig | None, target: Any, sparsity: Any, settings: dict) -> CorpConfig:
    """:func:`prune`'s ``config``, or the one its keyword settings build; validated (once).

    Raises:
        UserError: both a config and keyword settings, or invalid settings.
    """
    if config is None:
        config = corp_config(None if target is _UNSET else target,
                             0.5 if sparsity is _UNSET else sparsity, **settings)
    elif target is not _UNSET or sparsity is not _UNSET or settings:
        raise UserError("give either a CorpConfig or keyword settings (target=, sparsity=, ...), not both")
    config.ensure_valid()
    return config


def _prune_record(config: CorpConfig, base_record: dict, dense: dict, pruned: dict, info: dict, last_block: Any,
                  bias_record: dict | None, *, source: str, batch_size: int, calibration_info: dict | None,
                  seconds: float, device: Any) -> dict[str, Any]:
    """:func:`prune`'s run record (:func:`edgeprune.artifact.new_record`) from the structure before
    and after, CORP's ``info`` and the calibration description (``source``: the data's,
    ``calibration_info``: the caller's); ``seconds``: the whole prune's wall time."""
    requested = requested_sparsity(config)
    return new_record(
        "corp" if config.compensation else "uncompensated",
        base_record, config, dense, pruned,
        calibration={"source": source, "num_images": info["num_images"], "passes": info["passes"],
                     "batch_size": batch_size, **(calibration_info or {}), **distributed_info()},
        timing={"total_s": seconds, "calibration_s": info["calibration_seconds"],
                "solve_s": info["solve_seconds"]},
        device=str(device),
        targets=config.target,
        sparsity=requested,
        achieved_sparsity=achieved_sparsity(dense["blocks"], pruned["blocks"]),
        settings=record_settings(config, info, last_block),
        solve=info["blocks"],
        **({"allocation": info["allocation"]} if info.get("allocation") else {}),
        **({"bias_correction": bias_record} if bias_record else {}),
        **({"embed": info["embed"]} if info.get("embed") else {}),
    )


class _BiasCorrection:
    """Output correction around a prune: the classifier refit (``edgeprune.solve.head_refit``,
    default) or the bias correction alone (``edgeprune.solve.output_bias``). The dense model's
    outputs over the first ``k`` calibration images come from CORP's calibration pass
    (``corp_prune``'s ``output_sums`` / ``output_rows``, no extra cost) or, for sequential
    calibration, from a pass made here before the model is pruned in place; :meth:`fold` runs the
    pruned model over the same images and folds the fit into the classifier. A no-op for
    ``k = 0``; recorded as skipped for a model without an affine classifier."""

    def __init__(self, model: nn.Module, batches: Callable[[], Iterable[torch.Tensor]], k: int,
                 separate_pass: bool, refit: bool = True) -> None:
        self.batches, self.k, self.refit = batches, int(k), bool(refit)
        self.head = classifier_head(model) if self.k > 0 else None
        self.skipped = self.k > 0 and self.head is None
        self.dense: tuple[torch.Tensor, int] | None = None
        self.rows: torch.Tensor | None = None
        if self.head is not None and separate_pass:
            rows: list[torch.Tensor] = []
            self.dense = output_sums(model, batches(), self.k, getattr(batches, "first_image", 0), rows=rows)
            self.rows = rows[0]

    def fold(self, model: nn.Module, from_pass: tuple[torch.Tensor, int] | None,
             rows: torch.Tensor | None = None) -> dict[str, Any] | None:
        if self.skipped:
            return {"images": 0, "skipped": "the model has no affine classifier head"}
        if self.head is None:
            return None
        dense = self.dense or from_pass
        rows = self.rows if self.rows is not None else rows
        if dense is None or (self.refit and rows is None):
            raise RuntimeError("output correction: the calibration pass returned no dense outputs")
        t0 = time.perf_counter()
        head = classifier_head(model)
        if head is None:
            raise RuntimeError("output correction: the pruned model lost its classifier")
        first = getattr(self.batches, "first_image", 0)
        note = refit_note(dense[1]) if self.refit else None  # too few images: the bias alone, said
        refit = self.refit and note is None
        inputs: list[torch.Tensor] = []  # the head's inputs of the pruned pass
        hook = head.register_forward_hook(lambda _m, args, _out: inputs.append(args[0].detach())) if refit else None
        try:
            pruned, count = output_sums(model, self.batches(), self.k, first)
        finally:
            if hook is not None:
                hook.remove()
        fit = None
        if refit:
            feats = torch.cat(inputs).flatten(1) if inputs else torch.zeros(0, head.in_features)
            stats = refit_statistics(feats, rows, first)
            if is_distributed():
                for t in stats.tensors:
                    t.copy_(all_reduce_sum(t))
            fit = fit_head(stats, head.weight)
        if count != dense[1]:
            raise RuntimeError("output correction: the pruned pass saw another number of images than the dense one")
        shift = fold_output_bias(head, dense[0], pruned, count) if fit is None else (dense[0] - pruned) / count
        record: dict[str, Any] = {"images": count, "kind": "bias", "shift_norm": float(shift.norm()),
                                  "shift": [float(v) for v in shift]}
        if fit is not None:
            w0 = head.weight.detach().double().cpu()
            with torch.no_grad():
                head.weight.copy_(fit["weight"].to(head.weight.dtype))
                head.bias.copy_(fit["bias"].to(head.bias.dtype))
            alpha = fit["alpha"]
            finite = alpha != float("inf")
            record.update(kind="head refit" if finite else "bias (chosen by the refit's cross-validation)",
                          alpha=alpha if finite else None,
                          cv_error={(f"{a:g}" if a != float("inf") else "bias only"): e for a, e in fit["cv_error"].items()},
                          weight_change=float((fit["weight"] - w0).norm() / w0.norm().clamp_min(1e-300)))
        if note:
            record["note"] = note
        record["seconds"] = time.perf_counter() - t0
        return record
