"""The job of ``edgeprune prune`` with a deploy's settings: a model pruned into a new run directory
(``model.safetensors`` + ``run.json``), its dense and pruned quality evaluated and printed as the command
prints them (:mod:`edgeprune.jobs.prune_report`).

The settings are those of ``edgeprune deploy``'s prune stage (the model, the data, one budget, the latency
table, token merging, the torch device); every other prune setting takes the command's default. The run's
``recipe.toml`` is the CLI's: ``write_recipe(path, values, record)`` is called when given.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from edgeprune import api
from edgeprune.artifact import check_new_dir, save_run
from edgeprune.budget import budget_kinds
from edgeprune.distributed import is_main_process, process_group
from edgeprune.embed.settings import parse_embed_sparsity
from edgeprune.errors import UserError
from edgeprune.jobs.calib_reuse import calibration_fields
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import check_readable_dir, make_spec, torch_device_of
from edgeprune.jobs.prune_report import announce, evaluate_models, report
from edgeprune.option_checks import refuse_sparsities_with_budget
from edgeprune.pruning.latency_check import latency_report


@dataclasses.dataclass
class PruneRunResult:
    """Outcome of :func:`prune_run`: the run directory written and its record (None on another torchrun rank)."""

    out: Path
    record: dict[str, Any] | None


def prune_run(out: str | Path, *, model_name: str = "fmnist-vit", checkpoint: str | Path | None = None,
              random_init: bool = False, num_classes: int | None = None, img_size: int | None = None,
              model_kwargs: dict | None = None, sparsity: float | None = None, flops: str | None = None,
              params: str | None = None, latency: str | None = None, latency_table: str | Path | None = None,
              tokens_merge: str | None = None, calib_dir: str | None = None, calib_size: int | None = None,
              seed: int = 0, batch_size: int = 32, eval_data: str | None = None, eval_size: int | None = None,
              no_eval: bool = False, torch_device: str | None = None, quiet: bool = False, echo: Echo = _echo,
              write_recipe: Callable[[Path, dict[str, Any], dict[str, Any]], Any] | None = None) -> PruneRunResult:
    """Prune ``model_name`` with CORP into the new run directory ``out``, as ``edgeprune prune`` does with
    these options (``sparsity`` [0.5] or one budget: ``flops``, ``params`` or ``latency`` with ``latency_table``).

    Raises:
        UserError: bad settings, ``out`` exists, an unknown model, unreadable data.
    """
    device = torch_device_of(None, torch_device, default="auto")
    budget = next((f"--{k}" for k, v in (("flops", flops), ("params", params), ("latency", latency))
                   if k in budget_kinds() and v is not None), None)
    refuse_sparsities_with_budget(budget, {"--sparsity": sparsity})
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    embed_sparsity = parse_embed_sparsity(None)
    overrides = {k: v for k, v in (("embed_sparsity", embed_sparsity),
                                   ("verify_budget", None if latency is None else True),
                                   ("tokens_merge", tokens_merge)) if v is not None}
    config = api.corp_config(None, 0.5 if sparsity is None else sparsity, compensation=True, criterion="combined",
                             round_to=8, qk_solver="auto", flops=flops, params=params, sequential=None,
                             latency=latency, latency_table=latency_table, **overrides)
    out_path = check_new_dir(out)
    spec = make_spec(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs)
    check_readable_dir(calib_dir, "calibration data")
    check_readable_dir(eval_data, "evaluation data")
    n = calib_size if calib_size is not None else spec.default_calib_size
    calib = spec.calibration_source(n, seed=seed, data=calib_dir, eval_data=eval_data)
    with process_group(device):
        main = is_main_process()  # rank 0 (or a single process) evaluates, writes and reports
        say = echo if main else (lambda *_a, **_k: None)
        ev = None
        if not no_eval and main:
            ev = spec.eval_source(eval_data or (calib_dir if spec.data_holds_both_splits else None), n=eval_size)
        dense = spec.create(pretrained=True)
        announce(dense, config, device, spec, calib, echo=say)
        t0 = time.perf_counter()
        result = api.prune(dense, calib, config, spec=spec, progress=not (quiet or not main), batch_size=batch_size,
                           device=device, calibration_info={"seed": seed, "size_requested": n,
                                                            **calibration_fields(calib_dir, calib, eval_data)})
        prune_s = time.perf_counter() - t0
        if not main:
            return PruneRunResult(out=out_path, record=None)
        rec = result.record
        metrics = evaluate_models(spec, dense, result.model, ev, device, quiet, rec, echo=echo)
        latency_lines = latency_report(rec.get("latency_check"))
        save_run(out_path, result.model, rec)
        if write_recipe is not None:
            write_recipe(out_path / "recipe.toml", {"out": str(out_path)}, rec)
    report(rec, spec, *metrics, prune_s, echo=echo)
    for line in latency_lines:
        echo(line, err=line.startswith("warning"))
    echo(f"saved {out_path}")
    return PruneRunResult(out=out_path, record=rec)


__all__ = ["PruneRunResult", "prune_run"]
