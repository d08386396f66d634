"""``edgeprune derive``: NuWa class-specific derivation under a FLOPs / params / latency budget.

    edgeprune derive --model fmnist-vit --classes 0,3,7 --flops 0.6 -o runs/nuwa-037
    edgeprune derive --model fmnist-vit --classes 0,3,7 --latency 0.5 --latency-table t.json

``--latency`` (a fraction of the dense latency on ``--latency-table``, or ``12ms``) is parsed and
refused exactly as ``edgeprune prune`` does (docs/latency_budget.md, "derive --latency"); where the
table's backend runs here the derived model is measured and the dims re-planned until it lands within
``--latency-tolerance`` (``--latency-rounds``, ``--no-verify-latency``: as prune; ``edgeprune.nuwa.measured``).

Labeled images of the target classes come from the train split (fmnist-vit) or ``--train-data``
(an ImageFolder, timm models); the final evaluation uses the test split / ``--eval-data``, with the
argmax taken over the target classes. See ``edgeprune.nuwa``.

``--torch-device`` (default ``auto``: cuda when available, else cpu; cpu with ``--device cpu``, a
CPU deployment profile) runs SKP, the calibration pass and
the evaluations; the SVD and the least-squares re-fits run in float64 on the CPU, and the derived
model is saved from the CPU. The device is printed and recorded (``device``, ``config.device``).
"""

from __future__ import annotations

import click
import torch

from edgeprune.artifact import check_new_dir, save_run
from edgeprune.cli.help import RecipeCommand
from edgeprune.budget.correction import Correction
from edgeprune.cli import generate
from edgeprune.cli.options import (FINITE, check_ignored_options, check_readable_dir, device_option, eval_options,
                                   latency_table_option, make_spec, model_options, out_option, quiet_option,
                                   torch_device_of)
from edgeprune.cli.recipe import replay_measurer, replay_rounds, write_recipe
from edgeprune.errors import UserError
from edgeprune.nuwa.config import DeriveConfig
from edgeprune.nuwa.derive import check_budget, derive
from edgeprune.nuwa.head import num_classes as head_classes
from edgeprune.nuwa.inputs import evaluate_targets, resolve_budget, resolve_classes
from edgeprune.nuwa.skp import SKPConfig
from edgeprune.pruning.latency_check import latency_report
from edgeprune.zoo.labeled import class_names, load_labeled, load_labeled_eval


#: the verbs of the correction options' help (``edgeprune.budget.correction``)
CORRECTION_WORDS = {"redo": "re-plan", "made": "derived", "reference": "base"}


@click.command("derive", cls=RecipeCommand, settings_sections=(Correction,))
@model_options(default="fmnist-vit", help="fmnist-vit or a timm ViT/DeiT classifier name (with --checkpoint).")
@click.option("--classes", required=True,
              help="Target classes: indices or names, comma-separated (e.g. 0,3,7 or 'T-shirt/top,Bag').")
@click.option("--flops", default=None, metavar="F",
              help="FLOPs budget: a fraction of the base model to keep (0.6) or a count (2.3G), as for prune.")
@click.option("--params", default=None, metavar="P",
              help="Parameter budget: a fraction of the base model to keep (0.7) or a count (20M).")
@click.option("--latency", default=None, metavar="F",
              help="Latency budget: a fraction of the dense model's latency on the --latency-table (0.5) or "
                   "milliseconds per batch of the table's batch size (12ms); head dims and MLP widths on the "
                   "table's grid, every head kept.")
@latency_table_option
@generate.options((Correction,), CORRECTION_WORDS)
@click.option("--slice-head", is_flag=True,
              help="Slice the head to the target classes (default: suppress the others with a -100 bias).")
@click.option("--data", type=click.Path(), default=None, metavar="DIR", help="Fashion-MNIST directory (fmnist-vit).")
@click.option("--train-data", type=click.Path(), default=None, metavar="DIR",
              help="Labeled training images, ImageFolder (timm models).")
@click.option("--train-per-class", type=int, default=None,
              help="At most this many labeled images per class [fmnist-vit: all; folders: 300].")
@click.option("--calib", "calib_dir", type=click.Path(), default=None, metavar="DIR",
              help="Unlabeled calibration images (ImageFolder dir) [target-class training images].")
@click.option("--calib-size", type=int, default=128, show_default=True, help="Calibration images for OFP-MLP.")
@click.option("--val-size", type=int, default=300, show_default=True,
              help="Held-out target-class training images scoring SKP checkpoints and rho.")
@click.option("--skp-steps", type=int, default=400, show_default=True,
              help="SKP optimiser steps (0 = no SKP; the paper uses 10000).")
@click.option("--skp-batch-size", type=int, default=1, show_default=True, help="Images per SKP step.")
@click.option("--skp-eval-every", type=int, default=50, show_default=True, help="Evaluate SKP masks every N steps.")
@click.option("--lr-beta", type=FINITE, default=0.1, show_default=True, help="SKP learning rate of the mask scales.")
@click.option("--lr-mask", type=FINITE, default=1e-3, show_default=True, help="SKP learning rate of the mask logits.")
@click.option("--weight-decay", type=FINITE, default=0.05, show_default=True, help="SKP weight decay.")
@click.option("--rho", type=FINITE, default=None, help="Fix the retained singular-value energy ratio [search].")
@click.option("--key-bias", type=click.Choice(["drop", "augment"]), default="drop", show_default=True,
              help="Leave the softmax-invariant key bias out of the QK SVD, or augment with it.")
@click.option("--ridge-alpha", type=FINITE, default=1e-4, show_default=True,
              help="Ridge of the fc2 least-squares re-fit.")
@eval_options
@click.option("--no-eval", is_flag=True, help="Skip the final evaluation.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the on-disk SVD cache.")
@click.option("--seed", type=int, default=0, show_default=True, help="Data split, sampling and SKP seed.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads [torch's default].")
@device_option(default="auto")
@out_option("runs/<model>-nuwa-<classes>-<budget>")
@quiet_option
def derive_cmd(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs, classes, flops, params,
               latency, latency_table, slice_head, data, train_data, train_per_class, calib_dir, calib_size, val_size,
               skp_steps, skp_batch_size, skp_eval_every, lr_beta, lr_mask, weight_decay, rho, key_bias, ridge_alpha,
               eval_data, eval_size, no_eval, no_cache, seed, threads, device, out, quiet, correction_tolerance=0.03,
               correction_rounds=3, verify_budget=True, torch_device=None):
    """Derive a class-specific model with NuWa.

    SKP masks, SVD attention truncation and least-squares MLP pruning, under a FLOPs, params or
    latency budget (--flops / --params / --latency with --latency-table).
    """
    # 1. everything that can be checked without work
    device = torch_device_of(device, torch_device, default="auto")  # --device is the deployment profile
    check_ignored_options(click.get_current_context())
    budget = resolve_budget(flops, params, latency=latency, table=latency_table)
    metric, amount, unit = budget.kind, budget.value, budget.unit or ""
    budget.check_inputs()  # a missing / malformed table: one line, before the model is built
    if train_per_class is not None and train_per_class < 1:
        raise UserError(f"--train-per-class must be >= 1, got {train_per_class}")
    cfg = DeriveConfig(
        skp=SKPConfig(steps=skp_steps, batch_size=skp_batch_size, lr_beta=lr_beta, lr_mask=lr_mask,
                      weight_decay=weight_decay, eval_every=skp_eval_every, seed=seed),
        head="slice" if slice_head else "suppress", val_size=val_size, calib_size=calib_size, rho=rho,
        key_bias=key_bias, ridge_alpha=ridge_alpha, cache=not no_cache, seed=seed, device=device,
        **Correction(verify_budget, correction_tolerance, correction_rounds).validate().to_dict())
    cfg.validate()
    if out is not None:
        check_new_dir(out)
    if threads is not None:
        torch.set_num_threads(threads)
    for path, what in ((data, "Fashion-MNIST data"), (train_data, "training data"), (calib_dir, "calibration data"),
                       (eval_data, "evaluation data")):
        check_readable_dir(path, what)
    spec = make_spec(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs)
    if spec.output_kind != "logits":
        raise UserError(f"{model_name} is not a classifier; NuWa derives classifiers")
    base = spec.create(pretrained=True)
    names = class_names(spec, train_data)
    cls = resolve_classes(classes, head_classes(base), names)
    tag = "-".join(str(c) for c in cls)
    sliced = "-slice" if slice_head else ""
    out_path = check_new_dir(out or f"runs/{model_name}-nuwa-{tag}-{metric}{amount:g}{unit}{sliced}")
    check_budget(base, cls, budget, cfg, names)
    x, y, train_desc = load_labeled(spec, data, train_data, cls, train_per_class, seed)
    calibration = None
    if calib_dir is not None:
        calibration = spec.calibration_source(calib_size, seed=seed, data=calib_dir, eval_data=eval_data)
    ev = None if no_eval else load_labeled_eval(spec, data, eval_data, cls, eval_size)

    # 2. the work
    click.echo(f"model {model_name}: classes {cls}"
               + (f" ({', '.join(names[c] for c in cls)})" if names else "")
               + f"; {metric} budget {amount:g}{unit}; labeled images: {train_desc}; device {cfg.device}")
    replay = replay_measurer(click.get_current_context())  # a recipe's recorded measurements (issue 52)
    res = derive(base, cls, x, y, budget=budget, calibration=calibration, config=cfg,
                 class_names=names, spec=spec, progress=not quiet, measurer=replay)
    rec = res.record
    replayed = [replay.check(rec)] if replay is not None else []
    rec["derivation"]["data"]["train_source"] = train_desc
    d = rec["derivation"]
    rows = [("base", rec["dense_params"], rec["dense_flops"], None),
            ("anchor", d["anchor"]["params"], d["anchor"]["flops"], None),
            ("derived", rec["params"], rec["flops"], None)]
    if ev is not None:
        ex, ey, edesc = ev
        m_base = evaluate_targets(base, ex, ey, cls, False, device=cfg.device)[0]
        m_anchor = evaluate_targets(res.anchor_model, ex, ey, cls, slice_head, device=cfg.device)[0]
        m_derived = evaluate_targets(res.model, ex, ey, cls, slice_head, device=cfg.device)[0]
        rec["evaluation"] = {"data": edesc, "metric": "top-1 over the target classes (argmax over them)",
                             "base": {"top1": m_base}, "anchor": {"top1": m_anchor}, "derived": {"top1": m_derived}}
        rows = [(r[0], r[1], r[2], m) for r, m in zip(rows, (m_base, m_anchor, m_derived))]
        click.echo(f"evaluation: {edesc}")
    save_run(out_path, res.model.cpu(), rec)
    write_recipe(click.get_current_context(), out_path / "recipe.toml", {"out": str(out_path)},
                 replay=replay_rounds(rec))  # issue 52: what the run measured, for an exact replay

    # 3. the report
    _print_report(rec, rows, metric, f"{amount:g}{unit}", out_path,
                  latency_report(rec.get("latency_check")) + replayed)


def _print_report(rec: dict, rows: list[tuple], metric: str, amount: str, out_path, latency_lines: list[str]) -> None:
    """The summary table (params, MFLOPs, target top-1 of base, anchor and derived), the
    derivation's dims, budget and timing, and a latency budget's measured rounds (``latency_lines``:
    ``latency_report``, as prune prints them; warnings on stderr)."""
    d = rec["derivation"]
    click.echo("")
    click.echo(f"| {'':8} | {'params':>10} | {'MFLOPs':>9} | target top-1 |")
    click.echo(f"|{'-' * 10}|{'-' * 12}|{'-' * 11}|--------------|")
    for name, p, f, m in rows:
        q = "-" if m is None else f"{m * 100:.2f}%"
        click.echo(f"| {name:8} | {p:>10,} | {f / 1e6:>9.2f} | {q:>12} |")
    b = d["budget"]
    click.echo(f"\nnuwa: rho={d['rho']:g} qk={d['ofp_mha']['qk']} vo={d['ofp_mha']['vo']} mlp={d['ofp_mlp']['mlp']}; "
               f"anchor kept {d['anchor']['kept']} (SKP step {d['anchor']['step']}); "
               f"{metric} x{b['achieved_fraction']:.3f} (budget {amount}); head: {rec['head']['mode']}; "
               f"SVD factors: {d['ofp_mha']['svd_cache']['source']}")
    if isinstance(b.get(metric), dict) and "predicted" in b[metric]:
        m = b[metric]
        click.echo(f"{metric}: predicted {m['predicted']:.3f} ms (target {m['target']:.3f}, dense {m['dense']:.3f}) "
                   f"on {m.get('table')}; grid {m['round_to']}, rules {m['rules']}")
    t = rec["timing"]
    click.echo(f"time: SKP {t['skp_s']:.1f} s, statistics {t['stats_s']:.1f} s, SVD {t['svd_s']:.1f} s, "
               f"budget search {t['search_s']:.1f} s; total {t['total_s']:.1f} s")
    for line in latency_lines:
        click.echo(line, err=line.startswith("warning"))
    click.echo(f"saved {out_path}")
