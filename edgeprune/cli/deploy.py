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

from edgeprune.cli.options import FINITE, device_option, model_options, torch_device_of
from edgeprune.jobs.export import export, quick_check as _quick_check  # noqa: F401 (handed on)
from edgeprune.jobs.verify import verify


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
@click.option("--attention", type=click.Choice(["fusible", "packed"]), default="packed", show_default=True,
              help="Attention in the graph: separate q/k/v MatMuls that ONNX Runtime's transformer optimizer fuses "
                   "(fusible), or the model's packed qkv (packed).")
def export_cmd(run_dir: Path | None, model_name: str | None, checkpoint: Path | None, random_init: bool,
               num_classes: int | None, img_size: int | None, model_kwargs: dict | None, output: Path, opset: int,
               static_batch: int | None, force: bool, no_check: bool, attention: str) -> None:
    """Export a run or a dense model to ONNX.

    RUN_DIR (a pruned, healed or derived run) or --model NAME (dense).
    The file holds everything a deployer needs as metadata (base model, method, sparsities,
    per-block dims, input name/shape, preprocessing); read it with onnx or `edgeprune verify`.
    """
    export(output, run_dir=run_dir, model_name=model_name, checkpoint=checkpoint, random_init=random_init,
           num_classes=num_classes, img_size=img_size, model_kwargs=model_kwargs, opset=opset,
           static_batch=static_batch, force=force, check=not no_check, echo=click.echo, attention=attention)


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
    result = verify(onnx_file, run_dir=run_dir, model_name=model_name, checkpoint=checkpoint,
                    random_init=random_init, num_classes=num_classes, img_size=img_size,
                    model_kwargs=model_kwargs, n=n, data=data, atol=atol, rtol=rtol, batch_size=batch_size,
                    max_drop=max_drop, json_out=json_out, torch_device=device, echo=click.echo)
    if not result.passed:
        sys.exit(1)
