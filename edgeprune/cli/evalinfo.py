"""``edgeprune eval`` and ``edgeprune info``: quality and structure of a run or a dense model."""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from edgeprune.allocation.report import allocation_lines
from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import check_writable
from edgeprune.atomic import atomic_write_text
from edgeprune.cli.options import (check_readable_dir, device_option, eval_options, fmt_metric, load_model,
                                   make_spec, model_options, quiet_option, torch_device_of)
from edgeprune.jobs.calib_reuse import heldout_source, recorded_eval_folder, recorded_folder
from edgeprune.evaluate import evaluate, evaluate_target_classes
from edgeprune.flops import block_tokens, count_params, model_flops
from edgeprune.loading import load_base_model


@click.command("eval")
@click.argument("run_dir", required=False, type=click.Path())
@model_options()
@eval_options
@click.option("--json", "json_out", type=click.Path(), default=None, metavar="FILE",
              help="Also write the metrics as JSON.")
@device_option
@quiet_option
def eval_cmd(run_dir, model_name, checkpoint, random_init, num_classes, img_size, model_kwargs, eval_data, eval_size,
             json_out, device, quiet, torch_device=None):
    """Evaluate a run or a dense model on held-out data.

    RUN_DIR is compared against its dense base model (top-1 and agreement); a NuWa run is scored
    over its target classes.
    """
    device = torch_device_of(device, torch_device, default="cpu")  # --device is the deployment profile
    if run_dir is None and model_name is None:
        model_name = "fmnist-vit"
    check_readable_dir(eval_data, "evaluation data")
    if json_out is not None:
        check_writable(Path(json_out).parent)
    model, rec, spec = load_model(run_dir, model_name, checkpoint, random_init, num_classes, img_size,
                                  model_kwargs)
    ev = _eval_source(spec, rec, eval_data, eval_size)
    if rec is not None and rec.get("head"):  # NuWa run: only its target classes count
        with torch.no_grad():
            m = evaluate_target_classes(model, rec["head"], ev, device=device)
        click.echo(f"{run_dir}: {ev.description}, target classes {rec['head']['classes']} "
                   f"({m['num_images']} images): top-1 {m['top1'] * 100:.2f}% (argmax over the target classes)")
    else:
        dense = None
        if rec is not None:  # the run's dense base model, rebuilt as at prune time
            dense = load_base_model(rec)
        with torch.no_grad():
            m = evaluate(spec, model, ev, dense=dense, progress=not quiet, device=device)
        click.echo(f"{run_dir or spec.name}: {ev.description}: {fmt_metric(m, spec.output_kind)}")
    if json_out:
        atomic_write_text(json_out, json.dumps(m, indent=2) + "\n")


def _eval_source(spec, rec: dict | None, eval_data: str | None, eval_size: int | None):
    """The evaluation images: ``--eval-data``; else the run's recorded evaluation folder (issue 52); else,
    for a run that recorded its calibration folder (issue 42), that folder's test split (Fashion-MNIST)
    or, for a timm model, the folder's images the calibration did not use (unlabeled: agreement with
    the dense model only; a folder that is gone is refused); else the model's own."""
    if eval_data is None and rec is not None and not rec.get("head"):
        cal = rec.get("calibration") or {}
        eval_data = recorded_eval_folder(cal)  # issue 52: the run's own --eval-data first
        if eval_data is None and cal.get("folder") and (spec.data_holds_both_splits or not spec.is_zoo):
            folder = recorded_folder(cal, spec, option="--eval-data DIR")
            if folder is not None and spec.data_holds_both_splits:
                eval_data = folder
            elif folder is not None:
                n = cal.get("num_images") or cal.get("size_requested")
                return heldout_source(spec, folder, n, cal.get("seed") or 0, eval_size)
    return spec.eval_source(eval_data, n=eval_size)


@click.command("info")
@click.argument("run_dir", required=False, type=click.Path())
@model_options()
def info_cmd(run_dir, model_name, checkpoint, random_init, num_classes, img_size, model_kwargs):
    """Per-block dims, params and FLOPs of a run or a dense model."""
    if run_dir is None and model_name is None:
        model_name = "fmnist-vit"
    if run_dir is not None:
        model, rec, spec = load_model(run_dir, model_name, checkpoint, random_init, num_classes, img_size,
                                      model_kwargs)
    else:  # the structure needs no weights
        spec = make_spec(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs)
        model, rec = spec.create(pretrained=False), None
    an = find_anatomy(model)
    fl = model_flops(an)
    click.echo(f"{run_dir or spec.name}: {len(an.blocks)} blocks, width {an.embed_dim}, "
               f"{an.num_tokens} tokens ({an.num_prefix_tokens} prefix), input {spec.input_size}")
    if rec:
        click.echo(f"method {rec.get('method')} targets {rec.get('targets')} sparsity {rec.get('sparsity')} "
                   f"calibration: {(rec.get('calibration') or {}).get('source')}")
        if rec.get("allocation"):  # budgeted run: the allocator's per-block dims and costs
            for line in allocation_lines(rec["allocation"]):
                click.echo(line)
    merged = any(b.merge_r for b in an.blocks)  # token merging (issue 44): tokens in, merged away
    click.echo("| block | " + ("tokens | merged | " if merged else "")
               + "heads | head_dim | qk_dim | v_dim | mlp_hidden | params | MFLOPs |")
    click.echo("|------:|" + ("-------:|-------:|" if merged else "")
               + "------:|---------:|-------:|------:|-----------:|-------:|-------:|")
    for b, f, t in zip(an.blocks, fl["blocks"], block_tokens(an)):
        params = sum(p.numel() for p in b.block.parameters())
        only = "" if b.query_tokens is None else f" (computes {b.query_tokens} token(s): class-token block)"
        tokens = f"{t} | {b.merge_r} | " if merged else ""
        click.echo(f"| {b.index}{only} | {tokens}{b.num_heads} | {b.head_dim} | {b.qk_dim} | {b.v_dim} | "
                   f"{b.mlp_hidden} | {params:,} | {f['total'] / 1e6:.1f} |")
    click.echo(f"total: {count_params(model):,} params, {fl['total'] / 1e9:.3f} GFLOPs per image "
               f"(patch embedding {fl['patch_embed'] / 1e9:.3f}, head {fl['head'] / 1e9:.3f})")
