"""The lines ``edgeprune prune`` prints about a prune (moved from ``edgeprune.cli.prune``): the announcement,
the evaluation of the dense and the pruned model, the table and the lines about what the prune did. Each
takes ``echo(line, err=False)`` (the CLI passes ``click.echo``)."""

from __future__ import annotations

import torch

from edgeprune import api
from edgeprune.allocation.report import allocation_lines, rounding_warnings
from edgeprune.anatomy import find_anatomy
from edgeprune.evaluate import evaluate
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import fmt_metric


def announce(dense, config, device: str, spec, calib, echo: Echo = _echo) -> None:
    """The warnings about rounding, then the line naming the model, the calibration data and the device."""
    for msg in rounding_warnings(find_anatomy(dense), config):
        echo(f"warning: {msg}", err=True)
    used = api.work_device(config, device)
    where = used if used == device else f"{used} (sequential calibration runs on the CPU)"
    echo(f"model {spec.name}: calibration {calib.description}; device {where}")


def evaluate_models(spec, dense, pruned, ev, device: str, quiet: bool, rec: dict, echo: Echo = _echo) -> tuple:
    """Dense and pruned quality on ``ev`` (None: not evaluated), recorded in ``rec["evaluation"]``."""
    dense_m = pruned_m = None
    if ev is not None:
        echo(f"evaluation: {ev.description}")
        with torch.no_grad():
            if spec.output_kind not in ("saliency", "dense"):  # fidelity to the dense model: itself is the reference
                dense_m = evaluate(spec, dense, ev, progress=not quiet, device=device)
            pruned_m = evaluate(spec, pruned, ev, dense=dense, progress=not quiet, device=device)
        rec["evaluation"] = {"data": ev.description, "dense": dense_m, "pruned": pruned_m, "device": device}
    return dense_m, pruned_m


def report(rec: dict, spec, dense_m, pruned_m, prune_s: float, echo: Echo = _echo) -> None:
    """The table of params / FLOPs / quality and the lines about what the prune did."""
    a, sp = rec["achieved_sparsity"], rec["sparsity"]
    echo("")
    echo(f"| {'':8} | {'params':>10} | {'GFLOPs':>8} | quality |")
    echo(f"|{'-' * 10}|{'-' * 12}|{'-' * 10}|---------|")
    dense_q = fmt_metric(dense_m, spec.output_kind) if spec.output_kind not in ("saliency", "dense") else "reference"
    echo(f"| {'dense':8} | {rec['dense_params']:>10,} | {rec['dense_flops'] / 1e9:>8.3f} | {dense_q} |")
    echo(f"| {'pruned':8} | {rec['params']:>10,} | {rec['flops'] / 1e9:>8.3f} | "
               f"{fmt_metric(pruned_m, spec.output_kind)} |")
    asked = " ".join(f"{k}={v:g}" for k, v in sp.items())
    if rec.get("allocation"):  # a budget replaced the sparsity
        asked = f"allocated by the {rec['allocation']['budget']['kind']} budget"
    got = " ".join(f"{k}={v:.3f}" for k, v in a.items())
    echo(f"\n{rec['method']} target={rec['targets']} sparsity {asked} (achieved {got}); "
               f"params x{rec['params'] / rec['dense_params']:.3f}, FLOPs x{rec['flops'] / rec['dense_flops']:.3f}; "
               f"pruning took {prune_s:.1f} s")
    used = rec["settings"].get("gram_tokens_used", 0)
    if used:  # the MLP statistics are an estimate from a token sample (docs/prune_cost.md)
        echo(f"MLP statistics from {used} random tokens per image (--gram-tokens 0: all tokens)")
    report_correction(rec.get("bias_correction"), echo=echo)
    report_embed_auto(rec.get("embed_auto"), echo=echo)
    report_tokens_auto(rec.get("tokens_auto"), echo=echo)
    if rec.get("embed"):  # issue 33
        e = rec["embed"]
        echo(f"residual stream sliced {e['dense_embed_dim']} -> {e['embed_dim']} ({e['rotation']} rotation, "
                   f"{100 * e['kept_energy']:.2f}% of the readers' moment kept, order {rec['config']['embed_order']})")
    if rec.get("tokens_merge"):  # issue 44
        tm = rec["tokens_merge"]
        echo(f"token merging: r per block {tm['r']}; tokens per block {tm['tokens']}, "
                   f"{tm['output_tokens']} after the last block (edgeprune info RUN)")
    for i, t in rec["settings"].get("class_token_blocks", {}).items():
        echo(f"block {i} computes only the first {t} token(s) (the class token the classifier reads; "
                   f"exact, --last-block full: every token)")
    if rec.get("allocation"):
        echo("\n".join(allocation_lines(rec["allocation"])))


def report_embed_auto(auto: dict | None, echo: Echo = _echo) -> None:
    """One line per candidate of ``--embed-sparsity auto`` and the choice (issue 33)."""
    if not auto:
        return
    for c in auto["candidates"]:
        echo(f"embed auto: S {c['embed_sparsity']:g} (D' {c['embed_dim']}, budget x{c['budget_fraction']:.3f}): "
                   f"check error {c['check_error']:.4g} on {auto['images']} images ({c['seconds']:.1f} s)")
    for c in auto["skipped"]:
        echo(f"embed auto: S {c['embed_sparsity']:g} skipped: {c['reason']}")
    echo(f"embed auto: chose S {auto['chosen']:g} (D' {auto['embed_dim']}, the smallest check error)")


def report_tokens_auto(auto: dict | None, echo: Echo = _echo) -> None:
    """The line of ``--tokens-merge auto`` (issue 44): the chosen schedule, its error against no merging."""
    if not auto:
        return
    rows = auto["candidates"]
    chosen = next(c for c in rows if c["schedule"] == auto["chosen"])
    zero = next((f"{c['check_error']:.4g}" for c in rows if not any(c["r"])), "skipped")
    echo(f"tokens auto: chose {auto['chosen']} (r per block {auto['r']}; check error {chosen['check_error']:.4g}"
               f" vs {zero} without merging, on {auto['images']} images; {len(rows)} candidates pruned, "
               f"{len(auto['skipped'])} skipped: run.json tokens_auto)")


def report_correction(bc: dict | None, echo: Echo = _echo) -> None:
    """The line about the output correction (bias or classifier refit), if one ran."""
    if bc and bc.get("skipped"):
        echo(f"output correction: {bc['skipped']}")
    elif bc and bc.get("kind") == "head refit":
        cv, alpha = bc["cv_error"], f"{bc['alpha']:g}"
        echo(f"output correction: classifier refit to the dense outputs of {bc['images']} calibration images "
                   f"(ridge alpha {alpha} by cross-validation: held-out squared error {cv[alpha]:.4g} "
                   f"vs {cv['bias only']:.4g} for the bias alone; head weights changed by "
                   f"{100 * bc['weight_change']:.2g}%; --no-head-refit: bias only, --bias-correction 0: off)")
    elif bc:
        why = "" if bc.get("kind", "bias") == "bias" else " (cross-validation preferred it to a classifier refit)"
        echo(f"output bias correction: mean output shift |c| = {bc['shift_norm']:.4g} over {bc['images']} "
                   f"calibration images folded into the classifier bias{why} (--bias-correction 0: off)")
        if bc.get("note"):
            echo(f"output correction: {bc['note']}")


__all__ = ["announce", "evaluate_models", "report", "report_correction", "report_embed_auto", "report_tokens_auto"]
