"""The job of ``edgeprune export``: a run (or a dense model) to an ONNX file with its metadata.

    import edgeprune
    edgeprune.export("model.onnx", run_dir="runs/fm-50")       # or model_name="fmnist-vit" (dense)

Its settings (``opset``, ``static_batch``, ``check``, ``attention``) are declared once in
:class:`exporters.export_settings.ExportSection` (the CLI's options; a test keeps the keywords equal).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from edgeprune.artifact import check_writable
from edgeprune.errors import UserError
from edgeprune.settings import SettingError
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import load_model
from exporters.onnx import build_metadata, export_onnx
from exporters.verify import verify_onnx


@dataclasses.dataclass
class ExportResult:
    """Outcome of :func:`export`: the file written, its metadata, the quick check (None: not run)."""

    path: Path
    metadata: dict[str, Any]
    check: dict[str, Any] | None


def quick_check(path: Path, model: Any, input_shape: Any) -> dict:
    """ONNX Runtime vs PyTorch on 2 seeded noise images (also exercises the dynamic batch)."""
    x = torch.randn(2, *input_shape, generator=torch.Generator().manual_seed(1))
    return verify_onnx(path, model, x, atol=1e-3)


def export(output: str | Path, *, run_dir: str | Path | None = None, model_name: str | None = None,
           checkpoint: str | Path | None = None, random_init: bool = False, num_classes: int | None = None,
           img_size: int | None = None, model_kwargs: dict | None = None, opset: int = 17,
           static_batch: int | None = None, force: bool = False, check: bool = True,
           echo: Echo = _echo, attention: str = "packed") -> ExportResult:
    """Export ``run_dir`` (a pruned, healed or derived run) or the dense ``model_name`` to ``output`` (.onnx).

    The file holds the deployer's metadata (base model, method, sparsities, per-block dims, input,
    preprocessing). ``check``: ONNX Runtime vs PyTorch on 2 noise images (with a dynamic batch or batch 2).
    ``attention``: ``"fusible"`` or ``"packed"`` (:func:`exporters.onnx.export_onnx`).

    Raises:
        UserError: ``output`` exists (without ``force``) or is not .onnx, ``static_batch`` < 1, neither or both
            of ``run_dir`` / ``model_name``, an unknown model.
    """
    output = Path(output)
    if output.exists() and not force:
        raise SettingError(f"{SettingError.literal(output)} exists (use {{force}} to overwrite)")
    if output.suffix != ".onnx":
        raise UserError(f"output must be a .onnx file, got {output}")
    if static_batch is not None and static_batch < 1:
        raise SettingError(f"{{static_batch}} must be >= 1, got {static_batch}")
    model, record, spec = load_model(run_dir, model_name, checkpoint, random_init, num_classes, img_size,
                                     model_kwargs)
    check_writable(output.parent)
    metadata = build_metadata(record=record, spec=spec, model=model,
                              model_name=spec.name, checkpoint=str(checkpoint) if checkpoint else None)
    if record is None and hasattr(spec, "to_record"):
        metadata["base_model"] = spec.to_record()
    path = export_onnx(model, output, tuple(spec.input_size), metadata, opset=opset,
                       dynamic_batch=static_batch is None, batch_size=static_batch or 1,
                       overwrite=force, attention=attention)
    size_mb = path.stat().st_size / 2**20
    echo(f"wrote {path} ({size_mb:.1f} MiB, opset {opset}, "
         f"{'dynamic batch' if static_batch is None else f'batch {static_batch}'}, "
         f"input {spec.input_size})")
    rep = None
    if check and static_batch in (None, 2):
        rep = quick_check(path, model, spec.input_size)
        echo(f"check: ONNX Runtime vs PyTorch on 2 noise images: max abs diff "
             f"{rep['max_abs_diff']:.2e} ({'ok' if rep['passed'] else 'LARGE'}); "
             f"run `edgeprune verify` for real inputs")
    return ExportResult(path=path, metadata=metadata, check=rep)


__all__ = ["ExportResult", "export", "quick_check"]
