"""The model a command works on: a run directory (pruned, healed or derived) or a dense model name.

Every command that takes ``RUN_DIR`` or ``--model NAME`` (eval, info, export, verify, bench) loads
through :func:`load_run_or_model`, so they agree on the errors and on the weights of
``--random-init`` models (seeded by the spec: export and verify of the same random-init model see
the same weights). A run directory alone is read by :func:`edgeprune.artifact.load_run`.
:func:`load_base_model` rebuilds a run's dense base model from its record -- same seed, img_size,
model_kwargs, and the recorded checkpoint, refused if it is gone or its sha256 changed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from edgeprune.artifact import load_run
from edgeprune.errors import UserError
from edgeprune.zoo.registry import MissingWeightsError, get_model_spec, spec_from_record

#: torch seed for ``--random-init`` models (``ModelSpec.seed``'s default).
RANDOM_INIT_SEED = 0


def load_base_model(record: dict) -> nn.Module:
    """The dense base model of a run, rebuilt from ``record["base_model"]`` (eval mode).

    Random-init models come out identical to the one the run was pruned from (recorded seed);
    checkpoints are loaded from the recorded absolute path and checked against the recorded
    sha256.

    Raises:
        UserError: the checkpoint is gone or changed ("checkpoint X changed since the run was made
            ..."), the record names no checkpoint (the hint: a dense ``eval --model NAME
            --checkpoint PATH``), an unknown model.
    """
    spec = spec_from_record(record["base_model"])
    try:
        return spec.create(pretrained=not spec.random_init)
    except MissingWeightsError:
        raise UserError(f"the run's record names no checkpoint for its dense base model {spec.name} "
                        "(base_model.checkpoint is null), so the dense model cannot be rebuilt for this "
                        f"command ('edgeprune eval --model {spec.name} --checkpoint PATH' evaluates it "
                        "on its own)") from None


def load_run_or_model(run_dir: str | os.PathLike | None, model_name: str | None,
                checkpoint: str | os.PathLike | None = None, random_init: bool = False,
                num_classes: int | None = None, img_size: int | None = None,
                model_kwargs: dict | None = None,
                seed: int = RANDOM_INIT_SEED) -> tuple[nn.Module, dict | None, object]:
    """Load a run directory (:func:`~edgeprune.artifact.load_run`) or build the dense model
    ``model_name``, in eval mode.

    Args:
        run_dir: an edgeprune run directory, or None.
        model_name: a zoo or timm model name, or None (exactly one of the two is given).
        checkpoint, random_init, num_classes, img_size, model_kwargs, seed: for ``model_name``
            (see ``get_model_spec``).

    Returns:
        ``(model, run record or None, ModelSpec)``.

    Raises:
        UserError: neither or both given, options that do not go with a run directory, a
            missing run directory, an unknown model.
    """
    if (run_dir is None) == (model_name is None):
        raise UserError("give either a run directory or --model NAME (not both)")
    if run_dir is not None:
        if (checkpoint is not None or random_init or num_classes is not None or img_size is not None
                or model_kwargs):
            raise UserError("--checkpoint/--random-init/--num-classes/--img-size/--model-kwargs go with "
                            "--model, not a run directory")
        run_dir = Path(run_dir)
        if not run_dir.exists():
            raise UserError(f"run directory not found: {run_dir}")
        if not run_dir.is_dir():
            raise UserError(f"{run_dir} is not a run directory")
        model, record = load_run(run_dir)
        return model.eval(), record, spec_from_record(record["base_model"])
    spec = get_model_spec(model_name, str(checkpoint) if checkpoint else None, random_init, num_classes,
                          img_size=img_size, model_kwargs=model_kwargs, seed=seed)
    model = spec.create(pretrained=not random_init)  # seeded by spec.seed
    return model.eval(), None, spec
