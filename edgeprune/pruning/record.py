"""The run record of a one-shot prune (``edgeprune.artifact.new_record``): the structure before and after, the
settings, the stages' reports.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
import torch.nn as nn

from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import new_record
from edgeprune.corp.config import CorpConfig
from edgeprune.distributed import distributed_info
from edgeprune.errors import UserError
from edgeprune.flops import count_params, model_flops
from edgeprune.plan import achieved_sparsity
from edgeprune.pruning.config import SPARSITY_KEYS
from edgeprune.surgery import block_dims
from edgeprune.zoo.registry import get_model_spec


def structure_summary(model: nn.Module) -> dict[str, Any]:
    """Params, FLOPs (per image) and per-block dims of a model."""
    anatomy = find_anatomy(model)
    flops = model_flops(anatomy)
    return {"params": count_params(model), "flops": flops["total"], "blocks": block_dims(anatomy),
            "block_flops": [b["total"] for b in flops["blocks"]]}


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
    return {key: float(fields[name]) for name, key in SPARSITY_KEYS.items()
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


def base_model_record(model: nn.Module, spec=None) -> dict[str, Any]:
    """The ``base_model`` entry of a run record.

    ``spec.to_record()`` when a spec is given. Without one, a timm model is recognised by its
    ``pretrained_cfg["architecture"]`` when rebuilding that name (with the model's number of
    classes) gives exactly the same parameter names and shapes -- so ``load_run`` can rebuild
    it; anything else is recorded by its class name only (then pass ``spec=``). The guess is built on the
    meta device (shapes only, no memory or init time: the default of a name can be a 1B-parameter model).
    """
    if spec is not None:
        return spec.to_record()
    arch = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    if arch:
        try:
            guess = get_model_spec(arch, num_classes=getattr(model, "num_classes", None))
            with torch.device("meta"):
                built = guess.create(pretrained=False)
        except (UserError, RuntimeError, TypeError, ValueError, NotImplementedError):
            built = None
        if built is not None:
            mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            theirs = {k: tuple(v.shape) for k, v in built.state_dict().items()}
            if mine == theirs:
                return guess.to_record()
    return {"name": type(model).__name__}


def config_dict(config: CorpConfig) -> dict[str, Any]:
    """The record's ``config``: every field (``dataclasses.asdict``, tuples as lists), the budget in its record
    form (:meth:`edgeprune.budget.Budget.to_dict`)."""
    out = dataclasses.asdict(dataclasses.replace(config, budget=None))
    out["budget"] = config.budget.to_dict() if config.budget is not None else None
    return json.loads(json.dumps(out, default=str))


def cost_split(info: dict) -> dict[str, Any]:
    """Where a budgeted prune's time went (issue 40 item 4): ``split`` = statistics (the calibration pass), curves
    (the allocator's closed-form error curves), sensitivity (each unit pruned alone and measured on the check images),
    check (the candidate allocations folded and measured), allocation (the rest of choosing the dims), solve (the
    chosen allocation's closed forms and cut), output (the output correction: the pruned model's pass over the
    calibration images and the classifier's bias or refit), in seconds; ``{}`` without a budget. The first six add
    up to ``calibration_s + solve_s``; a latency prune's measurement is in ``latency_check.rounds``."""
    alloc = info.get("allocation")
    if not alloc:
        return {}
    sel = alloc.get("selection") or {}
    chosen_s = float(sel.get("seconds", alloc.get("seconds", 0.0)))
    sens = float((sel.get("sensitivity") or {}).get("seconds", 0.0))
    curves = float(info.get("curve_seconds", 0.0))
    check = float(sel.get("check_seconds", 0.0))
    return {"split": {"statistics": float(info["calibration_seconds"]), "curves": curves, "sensitivity": sens,
                      "check": check, "allocation": max(0.0, chosen_s - sens - check - curves),
                      "solve": max(0.0, float(info["solve_seconds"]) - chosen_s),
                      "output": float(info.get("output_seconds", 0.0))}}


def prune_record(config: CorpConfig, base_record: dict, dense: dict, pruned: dict, info: dict, last_block: Any,
                  bias_record: dict | None, *, source: str, batch_size: int, calibration_info: dict | None,
                  seconds: float, device: Any) -> dict[str, Any]:
    """:func:`prune`'s run record (:func:`edgeprune.artifact.new_record`) from the structure before
    and after, CORP's ``info`` and the calibration description (``source``: the data's,
    ``calibration_info``: the caller's); ``seconds``: the whole prune's wall time."""
    requested = requested_sparsity(config)
    return new_record(
        "corp" if config.compensation else "uncompensated",
        base_record, config_dict(config), dense, pruned,
        calibration={"source": source, "num_images": info["num_images"], "passes": info["passes"],
                     "batch_size": batch_size, **(calibration_info or {}), **distributed_info()},
        timing={"total_s": seconds, "calibration_s": info["calibration_seconds"],
                "solve_s": info["solve_seconds"], **cost_split(info)},
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
