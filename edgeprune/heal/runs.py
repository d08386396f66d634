"""Healing a run directory (what ``edgeprune heal RUN_DIR`` does, minus the printing).

* :func:`check_healable` -- refuse, before any work, a run that cannot be healed;
* :func:`default_calib_size` -- the run's own calibration size;
* :func:`healed_record` -- the healed run's record: the input record plus a ``healing`` entry
  (settings, ``config`` = ``asdict(HealConfig)``, history, losses, device).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from edgeprune.artifact import read_record
from edgeprune.errors import UserError
from edgeprune.heal.reduced import reduced_modules_from_record


def default_calib_size(record: dict[str, Any], spec: Any) -> int:
    """Calibration images when none is asked for: the run's own calibration set size (the images
    ``prune`` calibrated on, same seed by default), else the model's default (issue 14: healing
    uses the run's calibration set unless asked otherwise)."""
    cal = record.get("calibration") or {}
    n = cal.get("size_requested") or cal.get("num_images")
    return int(n) if n else int(spec.default_calib_size)


def check_healable(run_dir: str | Path) -> dict[str, Any]:
    """The record of ``run_dir`` after checking that healing it makes sense.

    Raises:
        UserError: not a run directory, no valid base model, a random-init base model (no real
            weights to align to), a sliced residual width (``--embed-sparsity``; block alignment
            would need the rotation), or nothing pruned (sparsity 0).
    """
    run_path = Path(run_dir)
    rec = read_record(run_path)
    base = rec.get("base_model")
    if not isinstance(base, dict) or "name" not in base:
        raise UserError(f"{run_path}: run record has no valid base_model entry")
    if base.get("random_init"):
        raise UserError(f"{run_path}: the base model {base['name']} has random weights (--random-init); "
                        "healing needs the dense model's real weights")
    embed = rec.get("embed") or {}
    if embed.get("embed_dim", 0) != embed.get("dense_embed_dim", 0):
        raise UserError(f"{run_path}: heal does not take runs with a sliced residual width yet "
                        f"(--embed-sparsity: {embed.get('dense_embed_dim')} -> {embed.get('embed_dim')}; "
                        "docs/embed.md)")
    if "dense_blocks" in rec and not reduced_modules_from_record(rec):
        raise UserError(f"{run_path}: nothing to heal: the run has the dense model's shapes everywhere (sparsity 0)")
    return rec


def healed_record(rec: dict[str, Any], result: Any, run_dir: str | Path, *,
                  calibration: dict[str, Any] | None = None,
                  evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record of a healed run: a copy of the input record with a ``healing`` entry.

    Args:
        rec: the input run's record.
        result: the :class:`~edgeprune.heal.trainer.HealResult`.
        run_dir: the input run directory (recorded).
        calibration: extra calibration entries (seed, size requested).
        evaluation: the new ``evaluation`` entry (None drops the input's, which was of the
            unhealed model).
    """
    info = result.info
    new = copy.deepcopy(rec)
    if evaluation is None:
        new.pop("evaluation", None)
    else:
        new["evaluation"] = evaluation
    config = info.get("config") or {}
    new["healing"] = {
        "method": "starfish",
        "input_run": str(run_dir),
        "input_method": rec.get("method"),
        **{k: v for k, v in info.items() if k != "trained_parameters"},
        "calibration": {**info["calibration"], **(calibration or {})},
        "history": result.history,
        "device": config.get("device", "cpu"),
        "evaluation_before_healing": rec.get("evaluation"),
    }
    return new
