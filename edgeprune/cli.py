"""The ``edgeprune`` command line (click).

Every user mistake ends as ``error: <one line>`` on stderr with exit status 2 (see
:func:`main`); an interrupt exits 130 and leaves no half-written output.
"""

from __future__ import annotations

import json
import sys

import click

from edgeprune.atomic import atomic_write_text
from edgeprune.errors import UserError


def _fmt_metric(m: dict | None, kind: str) -> str:
    if not m:
        return "-"
    if kind == "saliency":
        return (f"MAE {m['mae']:.4f} | Pearson {m['pearson']:.4f} | IoU@0.5 {m['iou@0.5']:.4f} | "
                f"feat cos {m['feature_cosine']:.4f}")
    parts = []
    if "top1" in m:
        parts.append(f"top-1 {m['top1'] * 100:.2f}%")
    if "agreement" in m:
        parts.append(f"agreement {m['agreement'] * 100:.2f}%")
    return " | ".join(parts) or "-"


def _spec_options(f):
    f = click.option("--num-classes", type=int, default=None, help="Classifier outputs of a timm model (default: its own).")(f)
    f = click.option("--random-init", is_flag=True, help="timm model without weights (tests, latency only).")(f)
    f = click.option("--checkpoint", type=click.Path(), default=None,
                     help="Weights of a timm model (safetensors or timm .pth, loaded without pickle).")(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgeprune")
def cli() -> None:
    """edgeprune: prune, heal, export, build and benchmark Vision Transformers for the edge."""


@cli.command("prune")
@click.option("--model", "model_name", default="fmnist-vit", show_default=True,
              help="fmnist-vit, dinov2-s14, or a timm ViT/DeiT name (with --checkpoint).")
@_spec_options
@click.option("--target", type=click.Choice(["mlp", "attn", "both"]), default="both", show_default=True,
              help="MLP hidden channels, attention Q/K head dims, or both.")
@click.option("--sparsity", type=float, default=0.5, show_default=True, help="Fraction of each targeted module's dims removed.")
@click.option("--mlp-sparsity", type=float, default=None, help="Override the MLP sparsity.")
@click.option("--attn-sparsity", type=float, default=None, help="Override the Q/K sparsity.")
@click.option("--criterion", type=click.Choice(["combined", "energy", "magnitude", "active"]), default="combined",
              show_default=True, help="MLP channel ranking.")
@click.option("--no-compensation", is_flag=True, help="Uncompensated baseline (same ranking, plain removal).")
@click.option("--ridge-alpha", type=float, default=None, help="Scale-free MLP ridge strength (default 1e-3).")
@click.option("--qk-ridge-alpha", type=float, default=None, help="Scale-free Q/K ridge strength (default 1e-3).")
@click.option("--qk-solver", type=click.Choice(["auto", "direct", "cg"]), default="auto", show_default=True,
              help="Exact Q/K system: Cholesky, matrix-free CG, or the cheaper of the two for the kept qk_dim and calibration size.")
@click.option("--round-to", type=int, default=8, show_default=True, help="Kept dims are multiples of this.")
@click.option("--calib", "calib_dir", type=click.Path(), default=None,
              help="Calibration data: Fashion-MNIST dir (fmnist-vit) or ImageFolder dir (timm models).")
@click.option("--eval-data", type=click.Path(), default=None, help="Evaluation data (ImageFolder; fmnist: its dir).")
@click.option("--calib-size", type=int, default=None, help="Calibration images [fmnist-vit 512, dinov2-s14 64, timm 256].")
@click.option("--eval-size", type=int, default=None, help="Evaluate on at most this many images.")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Calibration sampling seed.")
@click.option("--no-eval", is_flag=True, help="Skip the dense/pruned evaluation.")
@click.option("-o", "--out", type=click.Path(), default=None, help="New run directory [runs/<model>-<target>-<sparsity>].")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def prune_cmd(model_name, checkpoint, random_init, num_classes, target, sparsity, mlp_sparsity, attn_sparsity,
              criterion, no_compensation, ridge_alpha, qk_ridge_alpha, qk_solver, round_to, calib_dir, eval_data,
              calib_size, eval_size, batch_size, seed, no_eval, out, quiet):
    """Prune a model with CORP, evaluate dense vs pruned, and save a run directory."""
    import time

    import torch

    from edgeprune.api import prune
    from edgeprune.artifact import check_new_dir, save_run
    from edgeprune.evaluate import evaluate
    from edgeprune.plan import resolve_sparsities
    from edgeprune.zoo.registry import get_model_spec

    sp = resolve_sparsities(target, sparsity, mlp_sparsity, attn_sparsity)
    if round_to < 1:
        raise UserError(f"--round-to must be >= 1, got {round_to}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    out = out or f"runs/{model_name}-{target}-{sparsity:g}{'-nocomp' if no_compensation else ''}"
    out_path = check_new_dir(out)
    spec = get_model_spec(model_name, checkpoint, random_init, num_classes)
    default_n = {"fmnist-vit": 512, "dinov2-s14": 64}.get(model_name, 256)
    n = calib_size if calib_size is not None else default_n
    calib = spec.calibration_source(n, seed=seed, data=calib_dir, eval_data=eval_data)
    dense = spec.create(pretrained=True)
    click.echo(f"model {model_name}: calibration {calib.description}")
    t0 = time.perf_counter()
    result = prune(dense, calib, target=target, sparsity=sparsity, mlp_sparsity=mlp_sparsity,
                   attn_sparsity=attn_sparsity, compensation=not no_compensation, criterion=criterion,
                   ridge_alpha=ridge_alpha, qk_ridge_alpha=qk_ridge_alpha, qk_solver=qk_solver,
                   round_to=round_to, batch_size=batch_size, progress=not quiet, spec=spec,
                   calibration_info={"seed": seed, "size_requested": n})
    prune_s = time.perf_counter() - t0
    rec = result.record
    dense_m = pruned_m = None
    if not no_eval:
        ev = spec.eval_source(eval_data or (calib_dir if model_name == "fmnist-vit" else None), n=eval_size)
        click.echo(f"evaluation: {ev.description}")
        with torch.no_grad():
            if spec.output_kind == "saliency":
                pruned_m = evaluate(spec, result.model, ev, dense=dense, progress=not quiet)
            else:
                dense_m = evaluate(spec, dense, ev, progress=not quiet)
                pruned_m = evaluate(spec, result.model, ev, dense=dense, progress=not quiet)
        rec["evaluation"] = {"data": ev.description, "dense": dense_m, "pruned": pruned_m}
    save_run(out_path, result.model, rec)
    a = rec["achieved_sparsity"]
    click.echo("")
    click.echo(f"| {'':8} | {'params':>10} | {'GFLOPs':>8} | quality |")
    click.echo(f"|{'-' * 10}|{'-' * 12}|{'-' * 10}|---------|")
    dense_q = _fmt_metric(dense_m, spec.output_kind) if spec.output_kind != "saliency" else "reference"
    click.echo(f"| {'dense':8} | {rec['dense_params']:>10,} | {rec['dense_flops'] / 1e9:>8.3f} | {dense_q} |")
    click.echo(f"| {'pruned':8} | {rec['params']:>10,} | {rec['flops'] / 1e9:>8.3f} | {_fmt_metric(pruned_m, spec.output_kind)} |")
    click.echo(f"\n{rec['method']} target={target} sparsity mlp={sp['mlp']:g} attn={sp['attn']:g} "
               f"(achieved mlp={a['mlp']:.3f} attn={a['attn']:.3f}); params x{rec['params'] / rec['dense_params']:.3f}, "
               f"FLOPs x{rec['flops'] / rec['dense_flops']:.3f}; pruning took {prune_s:.1f} s")
    click.echo(f"saved {out_path}")


@cli.command("eval")
@click.argument("run_dir", required=False, type=click.Path())
@click.option("--model", "model_name", default=None, help="Evaluate a dense model instead of a run.")
@_spec_options
@click.option("--eval-data", type=click.Path(), default=None, help="Evaluation data (ImageFolder; fmnist: its dir).")
@click.option("--eval-size", type=int, default=None, help="At most this many images.")
@click.option("--json", "json_out", type=click.Path(), default=None, help="Also write the metrics as JSON.")
@click.option("--quiet", is_flag=True)
def eval_cmd(run_dir, model_name, checkpoint, random_init, num_classes, eval_data, eval_size, json_out, quiet):
    """Evaluate a run (against its dense base model) or a dense model on held-out data."""
    import torch

    from edgeprune.evaluate import evaluate

    from edgeprune.loading import load_target

    if run_dir is None and model_name is None:
        model_name = "fmnist-vit"
    model, rec, spec = load_target(run_dir, model_name, checkpoint, random_init, num_classes)
    ev = spec.eval_source(eval_data, n=eval_size)
    if rec is not None and rec.get("head"):  # NuWa run: only its target classes count
        from edgeprune.nuwa.derive import evaluate_targets

        classes = [int(c) for c in rec["head"]["classes"]]
        keep = torch.tensor(classes)
        pairs = [(x[torch.isin(y, keep)], y[torch.isin(y, keep)]) for x, y in ev.batches(1024) if y is not None]
        if not pairs:
            raise UserError("evaluating a NuWa run needs labeled evaluation images")
        xs, ys = zip(*pairs)
        x, y = torch.cat(xs), torch.cat(ys)
        with torch.no_grad():
            top1, _ = evaluate_targets(model, x, y, classes, sliced=rec["head"].get("mode") == "slice")
        m = {"top1": top1, "num_images": len(y)}
        click.echo(f"{run_dir}: {ev.description}, target classes {classes} ({len(y)} images): "
                   f"top-1 {top1 * 100:.2f}% (argmax over the target classes)")
        if json_out:
            atomic_write_text(json_out, json.dumps(m, indent=2) + "\n")
        return
    dense = spec.create(pretrained=True) if rec is not None else None
    with torch.no_grad():
        if spec.output_kind == "saliency" and dense is None:
            raise UserError("dinov2-s14 quality is fidelity to the dense model: evaluate a run directory")
        m = evaluate(spec, model, ev, dense=dense, progress=not quiet)
    click.echo(f"{run_dir or spec.name}: {ev.description}: {_fmt_metric(m, spec.output_kind)}")
    if json_out:
        atomic_write_text(json_out, json.dumps(m, indent=2) + "\n")


@cli.command("info")
@click.argument("run_dir", required=False, type=click.Path())
@click.option("--model", "model_name", default=None, help="Describe a dense model instead of a run.")
@_spec_options
def info_cmd(run_dir, model_name, checkpoint, random_init, num_classes):
    """Per-block dims, params and FLOPs of a run or a model."""
    from edgeprune.anatomy import find_anatomy
    from edgeprune.flops import count_params, model_flops

    if run_dir is None and model_name is None:
        model_name = "fmnist-vit"
    if run_dir is not None:
        from edgeprune.loading import load_target

        model, rec, spec = load_target(run_dir, model_name, checkpoint, random_init, num_classes)
    else:  # the structure needs no weights
        from edgeprune.zoo.registry import get_model_spec

        spec = get_model_spec(model_name, checkpoint, random_init, num_classes)
        model, rec = spec.create(pretrained=False), None
    an = find_anatomy(model)
    fl = model_flops(an)
    click.echo(f"{run_dir or spec.name}: {len(an.blocks)} blocks, width {an.embed_dim}, "
               f"{an.num_tokens} tokens ({an.num_prefix_tokens} prefix), input {spec.input_size}")
    if rec:
        click.echo(f"method {rec.get('method')} targets {rec.get('targets')} sparsity {rec.get('sparsity')} "
                   f"calibration: {rec.get('calibration', {}).get('source')}")
    click.echo("| block | heads | head_dim | qk_dim | v_dim | mlp_hidden | params | MFLOPs |")
    click.echo("|------:|------:|---------:|-------:|------:|-----------:|-------:|-------:|")
    for b, f in zip(an.blocks, fl["blocks"]):
        params = sum(p.numel() for p in b.block.parameters())
        click.echo(f"| {b.index} | {b.num_heads} | {b.head_dim} | {b.qk_dim} | {b.v_dim} | {b.mlp_hidden} | "
                   f"{params:,} | {f['total'] / 1e6:.1f} |")
    click.echo(f"total: {count_params(model):,} params, {fl['total'] / 1e9:.3f} GFLOPs per image "
               f"(patch embedding {fl['patch_embed'] / 1e9:.3f}, head {fl['head'] / 1e9:.3f})")


def _register_optional_commands() -> None:
    """Commands that live in their own modules (deployment, healing, derivation)."""
    import importlib

    for mod, names in (("edgeprune.cli_deploy", {"export_cmd": "export", "verify_cmd": "verify", "bench_cmd": "bench"}),
                       ("edgeprune.cli_trt", {"build_cmd": "build", "devices_cmd": "devices"}),
                       ("edgeprune.cli_heal", {"heal_cmd": "heal"}),
                       ("edgeprune.cli_derive", {"derive_cmd": "derive"})):
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as err:
            if err.name == mod:
                continue
            raise
        for attr, name in names.items():
            if hasattr(module, attr):
                cli.add_command(getattr(module, attr), name=name)


_register_optional_commands()


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning user errors into one line and a non-zero exit."""
    try:
        cli.main(args=argv, prog_name="edgeprune", standalone_mode=False)
    except UserError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
