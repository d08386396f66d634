"""``edgeprune eval`` and ``edgeprune info``: quality and structure of a run or a dense model.

The commands are faces over :func:`edgeprune.jobs.eval_run.eval_run` and :func:`edgeprune.jobs.info_run.info_run`
(the checks, the work, the lines printed); their options are the shared ones of ``edgeprune.cli.options``.
"""

from __future__ import annotations

import click

from edgeprune.cli.help import SettingsCommand
from edgeprune.cli.options import device_option, eval_options, json_option, model_options, quiet_option
from edgeprune import eval_run, info_run


@click.command("eval", cls=SettingsCommand)
@click.argument("run_dir", required=False, type=click.Path())
@model_options()
@eval_options
@json_option("Also write the metrics as JSON.")
@device_option
@quiet_option
def eval_cmd(run_dir, model_name, checkpoint, random_init, num_classes, img_size, model_kwargs, eval_data, eval_size,
             json_out, device, quiet, torch_device=None):
    """Evaluate a run or a dense model on held-out data.

    RUN_DIR is compared against its dense base model (top-1 and agreement); a NuWa run is scored
    over its target classes.
    """
    eval_run(run_dir, model_name=model_name, checkpoint=checkpoint, random_init=random_init, num_classes=num_classes,
             img_size=img_size, model_kwargs=model_kwargs, eval_data=eval_data, eval_size=eval_size,
             json_out=json_out, device=device, torch_device=torch_device, quiet=quiet, echo=click.echo)


@click.command("info", cls=SettingsCommand)
@click.argument("run_dir", required=False, type=click.Path())
@model_options()
def info_cmd(run_dir, model_name, checkpoint, random_init, num_classes, img_size, model_kwargs):
    """Per-block dims, params and FLOPs of a run or a dense model."""
    info_run(run_dir, model_name=model_name, checkpoint=checkpoint, random_init=random_init, num_classes=num_classes,
             img_size=img_size, model_kwargs=model_kwargs, echo=click.echo)


__all__ = ["eval_cmd", "info_cmd"]
