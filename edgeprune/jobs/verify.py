"""The job of ``edgeprune verify``: an ONNX file against its PyTorch model on real inputs.

A float file must match within ``atol`` / ``rtol``; a quantized one (int8/fp16) is judged by metric
(top-1 and top-1 agreement with the float model), gated by ``max_drop``. :func:`verify` returns the
report (``passed`` says whether the check passed; the CLI exits 1 when it did not). Its settings (``n``, ``atol``,
``rtol``, ``batch_size``, ``max_drop``) are declared once in :class:`exporters.export_settings.VerifySection`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from edgeprune.artifact import check_writable
from edgeprune.calibration.collect import exact_fp32
from edgeprune.errors import RuntimeFault
from edgeprune.settings import SettingError
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import load_model, torch_device_of
from exporters.attention_pattern import fused_attention_line
from exporters.onnx import read_metadata
from exporters.merge_replay import format_replay, replay_compare
from exporters.verify import as_input_batch, format_quantized_report, format_report, verify_onnx, verify_quantized
from runners.report import to_json

class VerifyFailed(RuntimeFault):
    """The ONNX file does not compute what the PyTorch model computes (a failed check: exit 1)."""

    exit_code = 1


@dataclasses.dataclass
class VerifyResult:
    """Outcome of :func:`verify`: whether it passed, the report, the JSON file written (or None)."""

    passed: bool
    report: dict[str, Any]
    json_path: Path | None


def verify(onnx_file: str | Path, *, run_dir: str | Path | None = None, model_name: str | None = None,
           checkpoint: str | Path | None = None, random_init: bool = False, num_classes: int | None = None,
           img_size: int | None = None, model_kwargs: dict | None = None, n: int = 64,
           data: str | Path | None = None, atol: float = 1e-4, rtol: float = 0.0, batch_size: int = 16,
           max_drop: float | None = None, json_out: str | Path | None = None, device: str | None = None,
           torch_device: str | None = None, echo: Echo = _echo) -> VerifyResult:
    """Run ``onnx_file`` and the model of ``run_dir`` (or ``model_name``) on ``n`` evaluation inputs.

    The PyTorch side runs on the torch device of ``device`` / ``torch_device`` (a deployment profile or the old
    torch-device spelling, and the torch device: :func:`edgeprune.jobs.models.torch_device_of`, default cpu; TF32
    off on CUDA); ONNX Runtime on the CPU.

    Raises:
        UserError: a missing or corrupt file, no model, ``max_drop`` for a float file.
    """
    torch_device = torch_device_of(device, torch_device, default="cpu")
    onnx_file = Path(onnx_file)
    json_out = Path(json_out) if json_out is not None else None
    meta = read_metadata(onnx_file)  # missing / corrupt file -> one-line error first
    model, _record, spec = load_model(run_dir, model_name, checkpoint, random_init, num_classes, img_size,
                                      model_kwargs)
    if json_out is not None:
        check_writable(json_out.parent)
    base = meta.get("base_model")
    onnx_base = base.get("name") if isinstance(base, dict) else None
    if onnx_base and onnx_base != spec.name:
        echo(f"warning: {onnx_file} was exported from {onnx_base}, comparing against {spec.name}", err=True)
    model.to(torch_device)
    with exact_fp32(torch.device(torch_device)):  # TF32 off for the comparison
        report = _compare(onnx_file, meta, model, spec, n, data, atol, rtol, batch_size, max_drop, echo)
    if meta.get("precision") not in ("int8", "fp16"):
        echo(fused_attention_line(onnx_file))
    report["torch_device"] = torch_device
    if torch_device != "cpu":
        echo(f"PyTorch side on {torch_device}")
    if json_out is not None:
        to_json(report, json_out)
    return VerifyResult(passed=bool(report["passed"]), report=report, json_path=json_out)


def _compare(onnx_file: Path, meta: dict, model: Any, spec: Any, n: int, data: Any, atol: float, rtol: float,
             batch_size: int, max_drop: float | None, echo: Echo) -> dict[str, Any]:
    if meta.get("precision") in ("int8", "fp16"):
        report = verify_quantized(onnx_file, model, spec.eval_source(str(data) if data else None, n=n),
                                  max_drop=max_drop, batch_size=batch_size,
                                  output_kind=getattr(spec, "output_kind", None))
        echo(format_quantized_report(report))
        return report
    if max_drop is not None:
        raise SettingError(f"{{max_drop}} applies to quantized files; {SettingError.literal(onnx_file.name)} is float "
                           "(use {atol}/{rtol}, or quantize it with 'edgeprune quantize')")
    inputs = spec.eval_inputs(n, str(data) if data else None)
    report = verify_onnx(onnx_file, model, inputs, atol=atol, rtol=rtol,
                         output_kind=getattr(spec, "output_kind", None), batch_size=batch_size)
    if not report["passed"] and any(int(b.get("merge", 0)) for b in meta.get("blocks") or []):
        _replay(report, onnx_file, model, inputs, batch_size)
    echo(format_report(report))
    return report


def _replay(report: dict[str, Any], onnx_file: Path, model: Any, inputs: Any, batch_size: int) -> None:
    """A merged model that failed: compare again with ONNX Runtime's merge choices replayed in PyTorch (near-tied
    similarities can pair tokens differently in the two runtimes, issue 55); the verdict becomes the replay's
    (:func:`exporters.merge_replay.replay_compare`), the measured differences stay in the report."""
    rep = replay_compare(onnx_file, model, as_input_batch(inputs), atol=report["atol"], rtol=report["rtol"],
                         output_kind=report["output_kind"], batch_size=batch_size)
    if rep is None:
        return
    report["merge_replay"] = rep
    report["merge_replay_line"] = format_replay(rep)
    report["passed_without_replay"] = False
    report["passed"] = rep["passed"]


__all__ = ["VerifyFailed", "VerifyResult", "verify"]
