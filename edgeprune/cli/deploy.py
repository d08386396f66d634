"""``edgeprune export`` / ``edgeprune verify``: a run (or a dense model) to ONNX, and the check
that the ONNX file computes what the PyTorch model computes.

``verify`` exits 1 when the ONNX output differs from PyTorch beyond the tolerance (a failed
check, not a usage error). ``quantize`` lives in :mod:`edgeprune.cli.quantize`, ``build`` /
``bench`` / ``devices`` in :mod:`edgeprune.cli.device`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch

from edgeprune.artifact import check_writable
from edgeprune.calibration.collect import exact_fp32
from edgeprune.cli.options import FINITE, device_option, load_model, model_options, torch_device_of
from edgeprune.errors import UserError
from exporters.onnx import build_metadata, export_onnx, read_metadata
from exporters.verify import format_quantized_report, format_report, verify_onnx, verify_quantized
from runners.report import to_json


def _quick_check(path: Path, model, input_shape) -> dict:
    """ONNX Runtime vs PyTorch on 2 seeded noise images (also exercises the dynamic batch)."""
    x = torch.randn(2, *input_shape, generator=torch.Generator().manual_seed(1))
    return verify_onnx(path, model, x, atol=1e-3)


@click.command("export")
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@model_options()
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), metavar="FILE",
              help="The .onnx file to write.")
@click.option("--opset", default=17, show_default=True, type=int,
              help="ONNX opset (17: TensorRT 10.x; attention as MatMul/Softmax).")
@click.option("--static-batch", type=int, default=None, metavar="B",
              help="Fixed batch size B instead of a dynamic batch axis.")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--no-check", is_flag=True, help="Skip the ONNX Runtime vs PyTorch check on 2 noise images.")
def export_cmd(run_dir: Path | None, model_name: str | None, checkpoint: Path | None, random_init: bool,
               num_classes: int | None, img_size: int | None, model_kwargs: dict | None, output: Path, opset: int,
               static_batch: int | None, force: bool, no_check: bool) -> None:
    """Export a run or a dense model to ONNX.

    RUN_DIR (a pruned, healed or derived run) or --model NAME (dense).
    The file holds everything a deployer needs as metadata (base model, method, sparsities,
    per-block dims, input name/shape, preprocessing); read it with onnx or `edgeprune verify`.
    """
    if output.exists() and not force:
        raise UserError(f"{output} exists (use --force to overwrite)")
    if output.suffix != ".onnx":
        raise UserError(f"output must be a .onnx file, got {output}")
    if static_batch is not None and static_batch < 1:
        raise UserError(f"--static-batch must be >= 1, got {static_batch}")
    model, record, spec = load_model(run_dir, model_name, checkpoint, random_init, num_classes, img_size,
                                     model_kwargs)
    check_writable(output.parent)
    metadata = build_metadata(record=record, spec=spec, model=model,
                              model_name=spec.name, checkpoint=str(checkpoint) if checkpoint else None)
    if record is None and hasattr(spec, "to_record"):
        metadata["base_model"] = spec.to_record()
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


@click.command("verify")
@click.argument("onnx_file", type=click.Path(path_type=Path))
@click.option("--against", "run_dir", type=click.Path(path_type=Path), metavar="RUN_DIR",
              help="The run directory the file was exported from.")
@model_options()
@click.option("--n", "n", default=64, show_default=True, type=click.IntRange(min=1),
              help="Number of evaluation inputs.")
@click.option("--data", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Evaluation data (Fashion-MNIST dir or ImageFolder) [the model's own].")
@click.option("--atol", default=1e-4, show_default=True, type=FINITE, help="Max abs difference allowed.")
@click.option("--rtol", default=0.0, show_default=True, type=FINITE, help="Plus rtol x |PyTorch output|.")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1), help="Images per batch.")
@click.option("--max-drop", type=FINITE, default=None, metavar="POINTS",
              help="Quantized files: fail (exit 1) if top-1 (or top-1 agreement) drops by more than POINTS.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), metavar="FILE",
              help="Also write the report as JSON.")
@device_option
def verify_cmd(onnx_file: Path, run_dir: Path | None, model_name: str | None, checkpoint: Path | None,
               random_init: bool, num_classes: int | None, img_size: int | None, model_kwargs: dict | None,
               n: int, data: Path | None,
               atol: float, rtol: float, batch_size: int, max_drop: float | None, json_out: Path | None,
               device: str | None = None, torch_device: str | None = None) -> None:
    """Check an ONNX file against its PyTorch model.

    Runs ONNX_FILE and the model of --against RUN_DIR (or --model NAME) on real inputs. A float file
    must match within --atol/--rtol; a quantized one (int8/fp16) is judged by metric: top-1 and
    top-1 agreement with the float model on held-out images, gated by --max-drop.

    The PyTorch side runs on --torch-device (TF32 off on CUDA, so the comparison is with float32
    arithmetic); ONNX Runtime runs on the CPU.

    Exits 1 when the check fails.
    """
    device = torch_device_of(device, torch_device, default="cpu")  # --device is the deployment profile
    meta = read_metadata(onnx_file)  # missing / corrupt file -> one-line error first
    model, _record, spec = load_model(run_dir, model_name, checkpoint, random_init, num_classes, img_size,
                                      model_kwargs)
    if json_out is not None:
        check_writable(json_out.parent)
    base = meta.get("base_model")
    onnx_base = base.get("name") if isinstance(base, dict) else None
    if onnx_base and onnx_base != spec.name:
        click.echo(f"warning: {onnx_file} was exported from {onnx_base}, comparing against {spec.name}", err=True)
    model.to(device)
    click.get_current_context().with_resource(exact_fp32(torch.device(device)))  # TF32 off until exit
    if meta.get("precision") in ("int8", "fp16"):
        report = verify_quantized(onnx_file, model, spec.eval_source(str(data) if data else None, n=n),
                                  max_drop=max_drop, batch_size=batch_size,
                                  output_kind=getattr(spec, "output_kind", None))
        click.echo(format_quantized_report(report))
    else:
        if max_drop is not None:
            raise UserError(f"--max-drop applies to quantized files; {onnx_file} is float "
                            "(use --atol/--rtol, or quantize it with 'edgeprune quantize')")
        inputs = spec.eval_inputs(n, str(data) if data else None)
        report = verify_onnx(onnx_file, model, inputs, atol=atol, rtol=rtol,
                             output_kind=getattr(spec, "output_kind", None), batch_size=batch_size)
        click.echo(format_report(report))
    report["torch_device"] = device
    if device != "cpu":
        click.echo(f"PyTorch side on {device}")
    if json_out is not None:
        to_json(report, json_out)
    if not report["passed"]:
        sys.exit(1)
