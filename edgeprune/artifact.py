"""Run directories: a pruned model as ``model.safetensors`` + ``run.json``, written atomically.

``run.json`` (the run record) holds: ``edgeprune_version``, ``base_model`` (name, checkpoint,
input size, preprocessing), ``method``, ``targets``, ``sparsity`` (requested per target),
``achieved_sparsity``, ``blocks`` (per-block num_heads, head_dim, qk_dim, v_dim, mlp_hidden),
``calibration`` (source, size, seed), ``settings`` (criterion, ridge alpha, round_to, ...),
``params``, ``flops`` and timings. :func:`load_run` rebuilds the model from the record
(architecture + per-block shapes) and loads the weights strictly -- no pickle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.nn as nn

from edgeprune.atomic import atomic_dir
from edgeprune.errors import UserError

WEIGHTS = "model.safetensors"
RECORD = "run.json"


def check_new_dir(path: str | os.PathLike) -> Path:
    """Raise UserError if ``path`` exists (edgeprune never overwrites a run); return it as Path."""
    p = Path(path)
    if p.exists():
        raise UserError(f"output directory {p} already exists; choose another -o/--out")
    if not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    return p


def save_run(path: str | os.PathLike, model: nn.Module, record: dict[str, Any]) -> Path:
    """Write ``model.safetensors`` and ``run.json`` into a new directory, atomically.

    Everything is written into a temporary sibling directory first and renamed into place, so an
    interrupted or failed save leaves no half-written run directory.

    Raises:
        UserError: the directory already exists.
    """
    from safetensors.torch import save_file

    out = check_new_dir(path)
    with atomic_dir(out) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt", "edgeprune_record": RECORD})
        (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")
        if out.exists():
            raise UserError(f"output directory {out} appeared while saving; not overwriting it")
    return out


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """The run record of a run directory.

    Raises:
        UserError: not a run directory, or an unreadable record.
    """
    p = Path(path)
    if not (p / RECORD).is_file() or not (p / WEIGHTS).is_file():
        raise UserError(f"{p} is not an edgeprune run directory (needs {RECORD} and {WEIGHTS})")
    try:
        rec = json.loads((p / RECORD).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {p / RECORD}: {err}") from None
    for key in ("base_model", "blocks"):
        if key not in rec:
            raise UserError(f"{p / RECORD} has no {key!r} entry")
    return rec


def load_run(path: str | os.PathLike) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a run's model (eval mode, float32, CPU) and return it with its record.

    Raises:
        UserError: not a run directory, or weights that do not fit the recorded structure.
    """
    from safetensors.torch import load_file

    from edgeprune.surgery import apply_structure
    from edgeprune.zoo.registry import spec_from_record

    p = Path(path)
    rec = read_record(p)
    spec = spec_from_record(rec["base_model"])
    model = spec.create(pretrained=False)
    try:
        apply_structure(model, rec["blocks"])
        if rec.get("head"):  # NuWa: head suppressed or sliced to the target classes
            from edgeprune.nuwa.head import apply_head_structure

            apply_head_structure(model, rec["head"])
        state = load_file(str(p / WEIGHTS))
        model.load_state_dict(state, strict=True)
    except (ValueError, RuntimeError, KeyError) as err:
        raise UserError(f"{p}: weights do not fit the recorded model: {str(err).splitlines()[0]}") from None
    return model.eval(), rec
