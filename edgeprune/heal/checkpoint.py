"""Healing checkpoints: one ``checkpoint.safetensors`` per ``HEALED_DIR.partial/`` (no pickle).

After every epoch the trainer writes, atomically: the trainable weights (``param.*``), the best
epoch's weights (``best.*``), the AdamW moments (``optim.<i>.<key>``), the shuffling generator's
and torch's RNG states (``rng.*``), and a JSON header in the metadata (``edgeprune_heal_state``:
version, epoch, step, history, settings, optimizer groups). Resuming restores all of it, so a
resumed heal is bit-identical to an uninterrupted one (on the same device). Tensors are saved from
host copies (a heal on CUDA writes CPU tensors); on resume ``copy_`` and
``Optimizer.load_state_dict`` move them to the parameters' device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open

from edgeprune.atomic import atomic_save_safetensors
from edgeprune.errors import UserError

CHECKPOINT = "checkpoint.safetensors"
STATE_KEY = "edgeprune_heal_state"
STATE_VERSION = 2  # 2: keep-best state (best.* tensors, best_loss / best_epoch)


def partial_dir(out: str | Path) -> Path:
    """The checkpoint directory of an output run directory: ``<out>.partial``."""
    p = Path(out)
    return p.with_name(p.name + ".partial")


def _save_checkpoint(directory: Path, model: nn.Module, param_names: list[str], opt: torch.optim.Optimizer,
                     gen: torch.Generator, header: dict[str, Any],
                     best: dict[str, torch.Tensor] | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {f"param.{n}": params[n].detach().cpu().clone().contiguous()
                                        for n in param_names}
    for n, t in (best or {}).items():
        tensors[f"best.{n}"] = t.detach().cpu().contiguous()
    sd = opt.state_dict()
    extra: dict[str, dict[str, Any]] = {}
    for i, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim.{i}.{k}"] = v.detach().cpu().clone().contiguous()
            else:
                extra.setdefault(str(i), {})[k] = v
    tensors["rng.shuffle"] = gen.get_state().clone()
    tensors["rng.torch"] = torch.get_rng_state().clone()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    header = dict(header, optimizer={"param_groups": groups, "extra_state": extra})
    atomic_save_safetensors(directory / CHECKPOINT, tensors, {STATE_KEY: json.dumps(header)})


def _load_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    path = directory / CHECKPOINT
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        header = json.loads(meta[STATE_KEY])
    except Exception as err:  # noqa: BLE001 - any parse failure is a bad checkpoint
        raise UserError(f"cannot read healing checkpoint {path}: {str(err).splitlines()[0]}; "
                        "delete it to start over") from None
    if header.get("version") != STATE_VERSION:
        raise UserError(f"healing checkpoint {path} has an unsupported version; delete it to start over")
    return tensors, header


def _settings_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], header: dict[str, Any],
                      num_params: int) -> None:
    """Load the AdamW state saved by :func:`save_checkpoint` into ``opt``."""
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith("optim."):
            _, i, k = key.split(".", 2)
            state.setdefault(int(i), {})[k] = t
    for i, ex in header["optimizer"]["extra_state"].items():
        state.setdefault(int(i), {}).update(ex)
    groups = [dict(g, params=list(range(num_params))) for g in header["optimizer"]["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


save_checkpoint = _save_checkpoint
load_checkpoint = _load_checkpoint
settings_diff = _settings_diff
