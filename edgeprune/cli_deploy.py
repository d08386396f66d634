"""``edgeprune export`` / ``verify`` / ``bench``: deploy a pruned (or dense) model.

The commands are plain click commands; ``edgeprune.cli`` adds them to the ``edgeprune`` group::

    from edgeprune.cli_deploy import bench_cmd, export_cmd, verify_cmd
    main.add_command(export_cmd, "export"); main.add_command(verify_cmd, "verify")
    main.add_command(bench_cmd, "bench")

User mistakes (missing or corrupt files, wrong input shapes, unavailable providers, an existing
output without ``--force``) end the command with one ``error: ...`` line and exit status 2;
``verify`` exits 1 when the ONNX output differs from PyTorch beyond the tolerance.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable

import click

from edgeprune.errors import UserError
from edgeprune.loading import RANDOM_INIT_SEED, load_target  # noqa: F401  (RANDOM_INIT_SEED re-exported)


class DeployError(click.ClickException):
    """A user mistake: printed as one ``error: <message>`` line, exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # noqa: D401 - click API
        click.echo(f"error: {self.format_message()}", err=True, file=file)


def _user_errors(fn: Callable) -> Callable:
    """Turn :class:`UserError` (and a missing edgeprune core) into :class:`DeployError`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            raise DeployError(str(err)) from None
        except ModuleNotFoundError as err:
            if err.name and (err.name.startswith("edgeprune") or err.name in ("onnxruntime", "onnx",
                                                                               "onnx_graphsurgeon")):
                raise DeployError(f"missing module {err.name}: reinstall edgeprune") from None
            raise

    return wrapper


def _quick_check(path: Path, model, input_shape) -> dict:
    """ONNX Runtime vs PyTorch on 2 seeded noise images (also exercises the dynamic batch)."""
    import torch

    from exporters.verify import verify_onnx

    x = torch.randn(2, *input_shape, generator=torch.Generator().manual_seed(1))
    return verify_onnx(path, model, x, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# export


@click.command("export")
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@click.option("--model", "model_name", metavar="NAME",
              help="export a dense model instead: fmnist-vit, dinov2-s14 or a timm ViT/DeiT name")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="weights for --model (timm models)")
@click.option("--random-init", is_flag=True, help="--model without weights (latency tests)")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="the .onnx file to write")
@click.option("--opset", default=17, show_default=True, type=int,
              help="ONNX opset (17: TensorRT 10.x; attention as MatMul/Softmax)")
@click.option("--static-batch", type=int, default=None, metavar="B",
              help="fixed batch size B instead of a dynamic batch axis")
@click.option("--force", is_flag=True, help="overwrite an existing output file")
@click.option("--no-check", is_flag=True, help="skip the ONNX Runtime vs PyTorch check on 2 noise images")
@_user_errors
def export_cmd(run_dir: Path | None, model_name: str | None, checkpoint: Path | None, random_init: bool,
               output: Path, opset: int, static_batch: int | None, force: bool, no_check: bool) -> None:
    """Export RUN_DIR (a pruned run) or --model NAME (dense) to ONNX.

    The file holds everything a deployer needs as metadata (base model, method, sparsities,
    per-block dims, input name/shape, preprocessing); read it with onnx or `edgeprune verify`.
    """
    from exporters.onnx import build_metadata, export_onnx

    if output.exists() and not force:
        raise UserError(f"{output} exists (use --force to overwrite)")
    if output.suffix != ".onnx":
        raise UserError(f"output must be a .onnx file, got {output}")
    if static_batch is not None and static_batch < 1:
        raise UserError(f"--static-batch must be >= 1, got {static_batch}")
    model, record, spec = load_target(run_dir, model_name, checkpoint, random_init)
    metadata = build_metadata(record=record, spec=spec, model=model,
                              model_name=spec.name, checkpoint=str(checkpoint) if checkpoint else None)
    if record is None:
        metadata["base_model"] = spec.to_record() if hasattr(spec, "to_record") else metadata["base_model"]
    path = export_onnx(model, output, tuple(spec.input_size), metadata, opset=opset,
                       dynamic_batch=static_batch is None, batch_size=static_batch or 1,
                       overwrite=force)
    size_mb = path.stat().st_size / 2**20
    click.echo(f"wrote {path} ({size_mb:.1f} MiB, opset {opset}, "
               f"{'dynamic batch' if static_batch is None else f'batch {static_batch}'}, "
               f"input {spec.input_size})")
    if not no_check and static_batch in (None, 2):
        rep = _quick_check(path, model, spec.input_size)
        click.echo(f"check: ONNX Runtime vs PyTorch on 2 noise images: max abs diff "
                   f"{rep['max_abs_diff']:.2e} ({'ok' if rep['passed'] else 'LARGE'}); "
                   f"run `edgeprune verify` for real inputs")


# ---------------------------------------------------------------------------------------------
# verify


@click.command("verify")
@click.argument("onnx_file", type=click.Path(path_type=Path))
@click.option("--against", "run_dir", type=click.Path(path_type=Path), metavar="RUN_DIR",
              help="the run directory the file was exported from")
@click.option("--model", "model_name", metavar="NAME", help="or a dense model name")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="weights for --model (timm models)")
@click.option("--random-init", is_flag=True, help="--model without weights")
@click.option("--n", "n", default=64, show_default=True, type=click.IntRange(min=1),
              help="number of evaluation inputs")
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="evaluation data (Fashion-MNIST dir or ImageFolder); default: the model's own")
@click.option("--atol", default=1e-4, show_default=True, type=float, help="max abs difference allowed")
@click.option("--rtol", default=0.0, show_default=True, type=float, help="plus rtol x |PyTorch output|")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="also write the report as JSON")
@_user_errors
def verify_cmd(onnx_file: Path, run_dir: Path | None, model_name: str | None, checkpoint: Path | None,
               random_init: bool, n: int, data: Path | None, atol: float, rtol: float, batch_size: int,
               json_out: Path | None) -> None:
    """Check that ONNX_FILE computes what the PyTorch model computes, on real inputs.

    Exits 1 when the max abs difference exceeds the tolerance.
    """
    from exporters.onnx import read_metadata
    from exporters.verify import format_report, verify_onnx

    meta = read_metadata(onnx_file)  # missing / corrupt file -> one-line error first
    model, _record, spec = load_target(run_dir, model_name, checkpoint, random_init)
    onnx_base = (meta.get("base_model") or {}).get("name") if isinstance(meta.get("base_model"), dict) else None
    if onnx_base and onnx_base != spec.name:
        click.echo(f"warning: {onnx_file} was exported from {onnx_base}, comparing against {spec.name}",
                   err=True)
    inputs = spec.eval_inputs(n, str(data) if data else None)
    report = verify_onnx(onnx_file, model, inputs, atol=atol, rtol=rtol,
                         output_kind=getattr(spec, "output_kind", None), batch_size=batch_size)
    click.echo(format_report(report))
    if json_out is not None:
        from runners.report import to_json

        to_json(report, json_out)
    if not report["passed"]:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# bench


def make_runner(target: str, backend: str = "auto", *, provider: str = "cpu", device: str = "cpu",
                threads: int | None = None, random_init: bool = False):
    """The runner for one bench target, dispatched on its type (the one place to extend).

    * ``*.onnx`` file -> :class:`runners.onnxruntime_runner.OrtRunner` (backend onnxruntime);
    * run directory -> :class:`runners.torch_runner.TorchRunner` (backend torch);
    * a model name (no such path) -> dense TorchRunner (backend torch);
    * ``*.engine`` / ``*.plan`` -> :class:`runners.tensorrt_runner.TrtRunner` (backend tensorrt;
      ``device`` may name the device profile whose bench settings apply, e.g. ``orin-nx``).

    Raises:
        UserError: missing file, a target the backend cannot run, ...
    """
    p = Path(target)
    suffix = p.suffix.lower()
    if suffix in (".engine", ".plan", ".trt"):
        if backend not in ("auto", "tensorrt"):
            raise UserError(f"{target} is a TensorRT engine; use --backend tensorrt (or auto)")
        from runners.tensorrt_runner import TrtRunner

        cuda_graphs = False
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            from devices import load_profile

            profile = load_profile(device)
            if not profile.uses_tensorrt:
                raise UserError(f"device profile {profile.name!r} does not use TensorRT")
            cuda_graphs = bool(profile.bench.cuda_graphs)
        return TrtRunner(p, cuda_graphs=cuda_graphs, model=p.name)
    if suffix == ".onnx":
        if backend not in ("auto", "onnxruntime"):
            raise UserError(f"{target} is an ONNX file; the {backend} backend runs run directories "
                            "or model names (use --backend onnxruntime)")
        if not p.exists():
            raise UserError(f"ONNX file not found: {target}")
        from runners.onnxruntime_runner import OrtRunner

        return OrtRunner(p, providers=provider, threads=threads, label=p.name)
    if p.is_dir():
        if backend not in ("auto", "torch"):
            raise UserError(f"{target} is a run directory; export it first "
                            f"(edgeprune export {target} -o model.onnx) or use --backend torch")
        from runners.torch_runner import TorchRunner

        model, _rec, spec = load_target(p, None)
        return TorchRunner(model, device=device, threads=threads, label=p.name,
                           input_shape=spec.input_size)
    if p.exists():
        raise UserError(f"{target}: not an .onnx file or a run directory")
    looks_like_path = "/" in target or suffix in (".onnx", ".safetensors", ".json", ".pt", ".pth")
    if backend == "onnxruntime" or looks_like_path:
        raise UserError(f"no such file or directory: {target}")
    from runners.torch_runner import TorchRunner

    model, _rec, spec = load_target(None, target, None, random_init)
    return TorchRunner(model, device=device, threads=threads, label=target, input_shape=spec.input_size)


def _parse_batch_sizes(ctx, param, value: str) -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"batch sizes must be positive integers, got {value!r}")
    return sizes


@click.command("bench")
@click.argument("a")
@click.option("--vs", "b", default=None, metavar="B", help="compare against B (interleaved A B A B ...)")
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "torch", "tensorrt"]), default="auto",
              show_default=True, help="auto: .onnx -> onnxruntime, .engine -> tensorrt, run dir / model name -> torch")
@click.option("--provider", default="cpu", show_default=True,
              help="ONNX Runtime provider: cpu, cuda, tensorrt")
@click.option("--device", default="cpu", show_default=True,
              help="torch device (cpu, cuda), or for .engine files a device profile (rtx3090, orin-nx)")
@click.option("--batch-sizes", default="1,8", show_default=True, callback=_parse_batch_sizes)
@click.option("--iterations", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(min=0))
@click.option("--threads", default=None, type=click.IntRange(min=1), help="intra-op threads (default: backend's)")
@click.option("--random-init", is_flag=True, help="model names without weights (latency only)")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="write all results as JSON")
@click.option("--plot", "plot_out", type=click.Path(path_type=Path), help="plot latency vs batch size (PNG)")
@_user_errors
def bench_cmd(a: str, b: str | None, backend: str, provider: str, device: str, batch_sizes: list[int],
              iterations: int, warmup: int, threads: int | None, random_init: bool,
              json_out: Path | None, plot_out: Path | None) -> None:
    """Latency and throughput of A (an .onnx file, a run directory or a model name), optionally
    against B, per batch size.

    With --vs, A and B run interleaved on the same input and the table reports the per-pair
    latency ratio A/B (median, p10-p90): > 1 means B is faster.
    """
    from runners.compare import bench_pair
    from runners.report import markdown_table, pair_markdown_table, plot_latency, to_json

    runner_a = make_runner(a, backend, provider=provider, device=device, threads=threads,
                           random_init=random_init)
    runner_b = None
    if b is not None:
        runner_b = make_runner(b, backend, provider=provider, device=device, threads=threads,
                               random_init=random_init)
    if runner_a.input_shape is None:
        raise UserError(f"{a}: the ONNX input has symbolic image dims; re-export with a fixed size")
    try:
        if runner_b is not None:
            pairs = bench_pair(runner_a, runner_b, batch_sizes, iterations, warmup)
            click.echo(pair_markdown_table(pairs))
            click.echo("")
            click.echo(markdown_table([r for p in pairs for r in (p.a, p.b)]))
            results: Any = pairs
        else:
            results = runner_a.benchmark(batch_sizes, iterations, warmup)
            click.echo(markdown_table(results))
    finally:
        runner_a.close()
        if runner_b is not None:
            runner_b.close()
    if json_out is not None:
        to_json(results, json_out, extra={"command": "edgeprune bench", "argv": sys.argv[1:],
                                          "a": a, "b": b})
        click.echo(f"wrote {json_out}")
    if plot_out is not None:
        try:
            plot_latency(results, plot_out, title=f"{a}" + (f" vs {b}" if b else ""))
        except ImportError:
            raise UserError("--plot needs matplotlib (pip install matplotlib)") from None
        click.echo(f"wrote {plot_out}")


__all__ = ["export_cmd", "verify_cmd", "bench_cmd", "make_runner", "load_target", "DeployError"]
