"""``edgeprune prune``: CORP one-shot structured pruning of a model into a new run directory."""

from __future__ import annotations

import time

import click

from edgeprune import api
from edgeprune.artifact import check_new_dir, save_run
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import (FINITE, calibration_options, check_budget_options, check_ignored_options,
                                   check_readable_dir, device_option, eval_options, latency_table_option,
                                   latency_correction_options, make_spec, model_options, out_option, quiet_option,
                                   torch_device_of)
from edgeprune.jobs.calib_reuse import calibration_fields
from edgeprune.cli.recipe import replay_measurer, replay_rounds, tokens_choice, write_recipe
from edgeprune.corp import LAYOUTS, list_qk_solvers
from edgeprune.distributed import is_main_process, process_group
from edgeprune.embed.settings import parse_embed_sparsity
from edgeprune.errors import UserError
from edgeprune.jobs.prune_report import announce, evaluate_models, report, report_embed_auto, report_tokens_auto
from edgeprune.pruning.latency_check import latency_report
from edgeprune.plan import TARGETS
from edgeprune.ranking import list_criteria


_TARGET_WORDS = {"mlp": "MLP hidden channels", "attn": "Q/K head dims", "v": "V/O head dims",
                 "heads": "whole attention heads", "both": "mlp + attn", "all": "every kind"}


def _target_help() -> str:
    parts = [f"{t} ({_TARGET_WORDS[t]})" if t in _TARGET_WORDS else t for t in TARGETS]
    return "Which dims to prune: " + ", ".join(parts) + "."


@click.command("prune", cls=RecipeCommand)
@model_options(default="fmnist-vit")
@click.option("--target", type=click.Choice(list(TARGETS)), default=None,
              help=_target_help() + " [both; all with a budget]")
@click.option("--sparsity", type=FINITE, default=0.5, show_default=True,
              help="Fraction of each targeted module's dims removed, in [0, 1).")
@click.option("--mlp-sparsity", type=FINITE, default=None, help="Override the MLP sparsity (selects the MLP).")
@click.option("--attn-sparsity", type=FINITE, default=None, help="Override the Q/K sparsity (selects Q/K).")
@click.option("--v-sparsity", type=FINITE, default=None, help="Override the V/O sparsity (selects V/O).")
@click.option("--head-sparsity", type=FINITE, default=None, help="Fraction of whole attention heads removed.")
@click.option("--layout", type=click.Choice(LAYOUTS), default=None,
              help="Attention weight layout of the pruned model [default].")
@click.option("--criterion", type=click.Choice(list_criteria("mlp")), default="combined",
              show_default=True, help="MLP channel ranking (a registered criterion, edgeprune.ranking).")
@click.option("--no-compensation", is_flag=True, help="Uncompensated baseline (same ranking, plain removal).")
@click.option("--ridge-alpha", type=FINITE, default=None, help="Scale-free MLP ridge strength [1e-3].")
@click.option("--qk-ridge-alpha", type=FINITE, default=None, help="Scale-free Q/K ridge strength [1e-3].")
@click.option("--qk-solver", type=click.Choice(list_qk_solvers()), default="auto", show_default=True,
              help="Exact Q/K system: Cholesky, matrix-free CG, or the cheaper of the two.")
@click.option("--round-to", type=int, default=8, show_default=True, help="Kept dims are multiples of this.")
@click.option("--gram-tokens", type=int, default=None, metavar="K",
              help="MLP statistics from K random tokens per image (the MLP covariance is the largest cost "
                   "of the calibration pass; an estimator, docs/prune_cost.md); 0 = all tokens (exact) "
                   "[auto: a sample on large calibration sets].")
@click.option("--flops", default=None, metavar="F",
              help="FLOPs budget instead of --sparsity: a fraction of the dense model (0.5) or a count (2.3G); "
                   "kept dims are allocated per block and module.")
@click.option("--params", default=None, metavar="P",
              help="Parameter budget instead of --sparsity: a fraction (0.5) or a count (20M).")
@click.option("--latency", default=None, metavar="F",
              help="Latency budget instead of --sparsity: a fraction of the dense model's latency on the "
                   "--latency-table (0.5) or milliseconds per batch of the table's batch size (12ms).")
@latency_table_option
@latency_correction_options("re-allocate", "pruned", "dense")
@click.option("--sensitivity-images", type=int, default=None, metavar="N",
              help="With a budget: measure each unit's sensitivity on the first N check images [8].")
@click.option("--check-images", type=int, default=None, metavar="N",
              help="With --flops/--params: the candidate allocations and the per-unit sensitivities are "
                   "measured on the first N calibration images (0: the proxy alone) [32].")
@click.option("--bias-correction", "bias_correction", type=click.IntRange(min=0), default=None, metavar="N",
              help="Fold the pruned model's mean output shift against the dense model, measured on the "
                   "first N calibration images, into the classifier bias (models with a linear head; "
                   "0 = off) [all images with a budget, else 0].")
@click.option("--head-refit/--no-head-refit", "head_refit", default=None,
              help="With the output correction on: re-fit the classifier head (weights and bias) to the "
                   "dense model's outputs, ridge toward the dense head with its strength chosen by "
                   "cross-validation (the bias correction alone is one of the candidates) "
                   "[on whenever the correction runs].")
@click.option("--last-block", "last_block", type=click.Choice(["auto", "cls", "full"]), default=None,
              help="cls: the pruned model's last block computes only the class token its classifier "
                   "reads (exact; the other tokens' queries, attention rows, proj and MLP are dropped); "
                   "full: every token (auto: cls with a budget where the classifier reads the class token) "
                   "[auto].")
@click.option("--embed-sparsity", default=None, metavar="S|auto",
              help="Also slice the residual stream (embedding dim D) to D' = (1-S) D, rotated into its principal "
                   "subspace (docs/embed.md) [0]. auto (with --flops/--params): the budget chooses D' "
                   "among S = 0, 0.125, 0.25 by the output error on the check images; costs one whole prune "
                   "(calibration pass included) per candidate.")
@click.option("--embed-order", type=click.Choice(["first", "last"]), default=None,
              help="Slice the stream before (first) or after (last) the width pruning [first].")
@click.option("--embed-refit", is_flag=True, default=None, help="Ridge re-fit of the writers to the dense stream.")
@click.option("--tokens-merge", "tokens_merge", default=None, metavar="R",
              help="Token merging after the width pruning (ToMe, training-free, docs/tokens.md): R tokens merged "
                   "per block, a list r0,r1,... (one per block) or decreasing:R (r falls from 2R to 0); fixed "
                   "shapes, exports to ONNX / TensorRT. auto (with --latency and a table with a token axis): the "
                   "schedule with the lowest output error on the check images among a few candidates (0 one of "
                   "them), one prune per candidate [off].")
@click.option("--sequential", is_flag=True, help="Sequential calibration: statistics of each block on the "
              "output of the already pruned blocks.")
@calibration_options("Calibration images [fmnist-vit 512, dinov2-s14 64, timm 256].")
@eval_options
@click.option("--no-eval", is_flag=True, help="Skip the dense/pruned evaluation.")
@device_option(default="auto")
@out_option("runs/<model>-<target>-<sparsity>")
@quiet_option
def prune_cmd(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs, target, sparsity, mlp_sparsity,
              attn_sparsity, v_sparsity, head_sparsity, layout, criterion, no_compensation, ridge_alpha,
              qk_ridge_alpha, qk_solver, round_to, calib_dir, calib_size, seed, batch_size, eval_data, eval_size,
              no_eval, device, torch_device, out, quiet, flops=None, params=None, sequential=False, gram_tokens=None,
              check_images=None, sensitivity_images=None,
              bias_correction=None, last_block=None, head_refit=None, latency=None, latency_table=None,
              verify_latency=True, embed_sparsity=None, embed_order=None, embed_refit=None,
              latency_tolerance=None, latency_rounds=None, tokens_merge=None):
    """Prune a model with CORP into a new run directory.

    Evaluates the dense and the pruned model on held-out data (unless --no-eval) and prints
    params, FLOPs and quality of both.
    """
    # 1. everything that can be checked without work
    device = torch_device_of(device, torch_device, default="auto")  # --device is the deployment profile
    check_budget_options(click.get_current_context())
    check_ignored_options(click.get_current_context())
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    embed_sparsity = parse_embed_sparsity(embed_sparsity)  # a number or "auto"
    overrides = {k: v for k, v in (("v_sparsity", v_sparsity), ("head_sparsity", head_sparsity),
                                   ("layout", layout), ("ridge_alpha", ridge_alpha),
                                   ("qk_ridge_alpha", qk_ridge_alpha), ("gram_tokens", gram_tokens),
                                   ("allocation_check_images", check_images),
                                   ("allocation_sensitivity_images", sensitivity_images),
                                   ("bias_correction_images", bias_correction), ("last_block", last_block),
                                   ("head_refit", head_refit), ("embed_sparsity", embed_sparsity),
                                   ("embed_order", embed_order), ("embed_refit", embed_refit or None),
                                   ("correction_tolerance", latency_tolerance), ("correction_rounds", latency_rounds),
                                   ("verify_budget", None if latency is None else verify_latency),
                                   ("tokens_merge", tokens_merge))
                 if v is not None}
    config = api.corp_config(target, sparsity, mlp_sparsity=mlp_sparsity, attn_sparsity=attn_sparsity,
                             compensation=not no_compensation, criterion=criterion, round_to=round_to,
                             qk_solver=qk_solver, flops=flops, params=params, sequential=sequential or None,
                             latency=latency, latency_table=latency_table, **overrides)
    amount = config.budget.option() if config.budget else f"{sparsity:g}"
    out_path = check_new_dir(out or f"runs/{model_name}-{config.target}-{amount}{'-nocomp' if no_compensation else ''}")
    spec = make_spec(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs)
    check_readable_dir(calib_dir, "calibration data")
    check_readable_dir(eval_data, "evaluation data")
    n = calib_size if calib_size is not None else spec.default_calib_size
    calib = spec.calibration_source(n, seed=seed, data=calib_dir, eval_data=eval_data)
    # under torchrun: one process group for the command (METHODS.md §5 "Distributed statistics"),
    # started once the input is checked (a bad input fails every rank alike, before the rendezvous)
    click.get_current_context().with_resource(process_group(device))
    main = is_main_process()  # rank 0 (or a single process) evaluates, writes and reports
    quiet = quiet or not main
    ev = None
    if not no_eval and main:
        ev = spec.eval_source(eval_data or (calib_dir if spec.data_holds_both_splits else None), n=eval_size)
    dense = spec.create(pretrained=True)  # random-init weights: seeded by the spec (recorded)

    # 2. the work
    if main:
        _announce(dense, config, device, spec, calib)
    replay = replay_measurer(click.get_current_context(), click.echo if main else (lambda _line: None))
    t0 = time.perf_counter()
    result = api.prune(dense, calib, config, spec=spec, progress=not quiet, batch_size=batch_size, device=device,
                       calibration_info={"seed": seed, "size_requested": n,
                                         **calibration_fields(calib_dir, calib, eval_data)}, measurer=replay)
    prune_s = time.perf_counter() - t0
    if not main:
        return  # another rank of a torchrun job: rank 0 evaluates, writes and reports
    rec = result.record
    replayed = [replay.check(rec)] if replay is not None else []  # a recipe's exact replay (issue 52)
    metrics = _evaluate(spec, dense, result.model, ev, device, quiet, rec)
    latency_lines = latency_report(rec.get("latency_check")) + replayed  # measured and corrected (issue 40)
    save_run(out_path, result.model, rec)
    ctx = click.get_current_context()
    pinned, notes = tokens_choice(ctx, rec)  # issue 52: what the measurements decided, for an exact replay
    write_recipe(ctx, out_path / "recipe.toml", {"out": str(out_path), **pinned}, notes, replay_rounds(rec))

    # 3. the report
    _report(rec, spec, *metrics, prune_s)
    for line in latency_lines:
        click.echo(line, err=line.startswith("warning"))
    click.echo(f"saved {out_path}")


def _announce(dense, config, device: str, spec, calib) -> None:
    announce(dense, config, device, spec, calib, echo=click.echo)


def _evaluate(spec, dense, pruned, ev, device: str, quiet: bool, rec: dict) -> tuple:
    return evaluate_models(spec, dense, pruned, ev, device, quiet, rec, echo=click.echo)


def _report(rec: dict, spec, dense_m, pruned_m, prune_s: float) -> None:
    report(rec, spec, dense_m, pruned_m, prune_s, echo=click.echo)


def _report_embed_auto(auto: dict | None) -> None:
    report_embed_auto(auto, echo=click.echo)


def _report_tokens_auto(auto: dict | None) -> None:
    report_tokens_auto(auto, echo=click.echo)
