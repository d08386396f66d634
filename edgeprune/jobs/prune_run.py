"""The job of ``edgeprune prune`` with a deploy's settings: a model pruned into a new run directory
(``model.safetensors`` + ``run.json``), its dense and pruned quality evaluated and printed as the command
prints them (:mod:`edgeprune.jobs.prune_report`).

The prune's settings are a :class:`~edgeprune.pruning.settings.PruneSettings` (``edgeprune prune`` builds it from its
options) or their keywords (``edgeprune deploy``'s prune stage: one budget, the latency table, token merging); the
job's own arguments are the model, the data, the devices and the output. The run's ``recipe.toml`` is the CLI's:
``write_recipe(path, values, record)`` is called when given.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from edgeprune import api
from edgeprune.artifact import check_new_dir, save_run
from edgeprune.distributed import is_main_process, process_group
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.jobs.calib_reuse import calibration_fields
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import check_readable_dir, make_spec, torch_device_of
from edgeprune.jobs.prune_report import announce, evaluate_models, report
from edgeprune.pruning.config import DEFAULT_SPARSITY
from edgeprune.budget.latency_check import latency_report
from edgeprune.pruning.settings import PruneSettings


@dataclasses.dataclass
class PruneRunResult:
    """Outcome of :func:`prune_run`: the run directory written and its record (None on another torchrun rank)."""

    out: Path
    record: dict[str, Any] | None


def _settings(settings: PruneSettings | None, keywords: dict[str, Any]) -> PruneSettings:
    """``settings``, or the settings of ``keywords`` (None values = not given).

    Raises:
        UserError: both given, an unknown keyword.
    """
    given = {k: v for k, v in keywords.items() if v is not None}
    if settings is not None:
        if given:
            raise UserError(f"prune_run: give settings= or setting keywords, not both ({', '.join(given)})")
        return settings
    return PruneSettings.from_keywords(**given)


def default_out(model_name: str, config: Any, sparsity: float) -> Path:
    """``runs/<model>-<target>-<amount>[-nocomp]``: the run directory of a prune given none (the amount: the budget's
    option value, or ``sparsity``)."""
    amount = config.budget.option() if config.budget else f"{sparsity:g}"
    return Path(f"runs/{model_name}-{config.target}-{amount}{'-nocomp' if not config.compensation else ''}")


def prune_run(out: str | Path | None = None, settings: PruneSettings | None = None, *, model_name: str = "fmnist-vit",
              checkpoint: str | Path | None = None, random_init: bool = False, num_classes: int | None = None,
              img_size: int | None = None, model_kwargs: dict | None = None, calib_dir: str | None = None,
              calib_size: int | None = None, seed: int = 0, batch_size: int = 32, eval_data: str | None = None,
              eval_size: int | None = None, no_eval: bool = False, torch_device: str | None = None,
              device: str | None = None, quiet: bool = False, echo: Echo = _echo, replay: Any = None,
              write_recipe: Callable[[Path, dict[str, Any], dict[str, Any]], Any] | None = None,
              **setting_keywords: Any) -> PruneRunResult:
    """Prune ``model_name`` with CORP into the new run directory ``out`` (None: :func:`default_out`), as
    ``edgeprune prune`` does.

    Args:
        settings: every prune setting (``PruneSettings.from_keywords(...)``), or instead ``**setting_keywords``
            (``sparsity=0.5``, ``flops="0.5"``, ``latency=0.5, latency_table="t.json"``, ``tokens_merge=4`` ...;
            None = not given).
        device, torch_device: the deployment profile's (old) torch-device spelling and the torch device
            (``edgeprune.jobs.models.torch_device_of``; default auto).
        replay: a recipe's recorded measurements (``edgeprune.cli.recipe_replay.ReplayMeasurer``: a measurer with
            ``check(record) -> line``) or None.
        write_recipe: ``(path, values, record)`` writes the run's recipe (the CLI's) or None.

    Raises:
        UserError: bad settings, ``out`` exists, an unknown model, unreadable data.
    """
    settings = _settings(settings, setting_keywords)
    device = torch_device_of(device, torch_device, default="auto")
    if batch_size < 1:
        raise SettingError(f"{{batch_size}} must be >= 1, got {batch_size}")
    config = settings.config()
    sparsity = DEFAULT_SPARSITY if settings.corp.sparsity is None else settings.corp.sparsity
    out_path = check_new_dir(out if out is not None else default_out(model_name, config, sparsity))
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
        dense = spec.create(pretrained=True)  # random-init weights: seeded by the spec (recorded)
        announce(dense, config, device, spec, calib, echo=say)
        t0 = time.perf_counter()
        result = api.prune(dense, calib, config, spec=spec, progress=not (quiet or not main), batch_size=batch_size,
                           device=device, calibration_info={"seed": seed, "size_requested": n,
                                                            **calibration_fields(calib_dir, calib, eval_data)},
                           measurer=replay)
        prune_s = time.perf_counter() - t0
        if not main:
            return PruneRunResult(out=out_path, record=None)
        rec = result.record
        rec["sections"] = settings.to_dict()  # every declared setting by section, as given (issue 53)
        replayed = [replay.check(rec)] if replay is not None else []  # a recipe's exact replay (issue 52)
        metrics = evaluate_models(spec, dense, result.model, ev, device, quiet, rec, echo=echo)
        latency_lines = latency_report(rec.get("latency_check")) + replayed  # measured and corrected (issue 40)
        save_run(out_path, result.model, rec)
        if write_recipe is not None:
            write_recipe(out_path / "recipe.toml", {"out": str(out_path)}, rec)
    report(rec, spec, *metrics, prune_s, echo=echo)
    for line in latency_lines:
        echo(line, err=line.startswith("warning"))
    echo(f"saved {out_path}")
    return PruneRunResult(out=out_path, record=rec)


__all__ = ["PruneRunResult", "default_out", "prune_run"]
