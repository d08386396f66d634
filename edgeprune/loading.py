"""The model a command works on: a run directory (pruned, healed or derived) or a dense model name.

Every command that takes ``RUN_DIR`` or ``--model NAME`` (eval, info, export, verify, bench) loads
through :func:`load_target`, so they agree on the errors and on the weights of ``--random-init``
models (seeded: export and verify of the same random-init model see the same weights).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from edgeprune.errors import UserError

#: torch seed for ``--random-init`` models.
RANDOM_INIT_SEED = 0


def load_target(run_dir: str | os.PathLike | None, model_name: str | None,
                checkpoint: str | os.PathLike | None = None, random_init: bool = False,
                num_classes: int | None = None) -> tuple[nn.Module, dict | None, object]:
    """Load a run directory or build a dense model, in eval mode.

    Args:
        run_dir: an edgeprune run directory, or None.
        model_name: a zoo or timm model name, or None (exactly one of the two is given).
        checkpoint, random_init, num_classes: for ``model_name`` (see ``get_model_spec``).

    Returns:
        ``(model, run record or None, ModelSpec)``.

    Raises:
        UserError: neither or both given, options that do not go with a run directory, a
            missing run directory, an unknown model.
    """
    from edgeprune.zoo.registry import get_model_spec, spec_from_record

    if (run_dir is None) == (model_name is None):
        raise UserError("give either a run directory or --model NAME (not both)")
    if run_dir is not None:
        if checkpoint is not None or random_init or num_classes is not None:
            raise UserError("--checkpoint/--random-init/--num-classes go with --model, not a run directory")
        run_dir = Path(run_dir)
        if not run_dir.exists():
            raise UserError(f"run directory not found: {run_dir}")
        if not run_dir.is_dir():
            raise UserError(f"{run_dir} is not a run directory")
        from edgeprune.artifact import load_run

        model, record = load_run(run_dir)
        return model.eval(), record, spec_from_record(record["base_model"])
    spec = get_model_spec(model_name, str(checkpoint) if checkpoint else None, random_init, num_classes)
    if random_init:
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_INIT_SEED)
            model = spec.create(pretrained=False)
    else:
        model = spec.create(pretrained=True)
    return model.eval(), None, spec
