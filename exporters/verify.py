"""Check that an exported ONNX file computes what its PyTorch model computes (METHODS.md §4).

:func:`verify_onnx` runs ONNX Runtime (CPUExecutionProvider) and PyTorch on the same inputs --
real images from the model's evaluation data in the CLI -- and reports the max and mean absolute
output difference and a task-level agreement: top-1 agreement for logits, or for saliency maps
the fraction of pixels on which the maps thresholded at 0.5 agree. It passes when the max
absolute difference is within ``atol`` (+ ``rtol`` x |reference|).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn

from edgeprune.errors import UserError

SALIENCY_THRESHOLD = 0.5


def _as_numpy(inputs: Any) -> np.ndarray:
    if isinstance(inputs, torch.Tensor):
        arr = inputs.detach().cpu().numpy()
    else:
        arr = np.asarray(inputs)
    if arr.ndim != 4:
        raise UserError(f"inputs must be a (N, C, H, W) batch, got shape {tuple(arr.shape)}")
    if arr.shape[0] == 0:
        raise UserError("no inputs to verify with")
    return np.ascontiguousarray(arr, dtype=np.float32)


def check_input_shape(session, shape: Sequence[int]) -> int | None:
    """Raise :class:`UserError` unless ``shape`` (N, C, H, W) fits the session's input.

    Returns:
        The fixed batch size of the ONNX input, or ``None`` if the batch axis is dynamic.
    """
    inp = session.get_inputs()[0]
    dims = list(inp.shape)
    if len(dims) != len(shape):
        raise UserError(f"the ONNX model takes {len(dims)}-d input {dims}, "
                        f"got {len(shape)}-d input of shape {tuple(shape)}")
    for axis, (want, got) in enumerate(zip(dims[1:], shape[1:]), start=1):
        if isinstance(want, int) and want > 0 and want != got:
            expected = "x".join(str(d) for d in dims[1:])
            actual = "x".join(str(d) for d in shape[1:])
            raise UserError(f"input shape mismatch: the ONNX model takes {expected} images "
                            f"(C x H x W), got {actual}")
    batch = dims[0]
    return batch if isinstance(batch, int) and batch > 0 else None


def infer_output_kind(output: np.ndarray, declared: str | None = None) -> str:
    """``"logits"`` for (N, K) outputs, ``"saliency"`` otherwise (unless ``declared``)."""
    if declared in ("logits", "saliency"):
        return declared
    return "logits" if output.ndim == 2 else "saliency"


def _run_onnx(session, x: np.ndarray, fixed_batch: int | None, chunk: int) -> np.ndarray:
    name = session.get_inputs()[0].name
    step = fixed_batch or chunk
    outs = []
    for start in range(0, x.shape[0], step):
        part = x[start:start + step]
        n = part.shape[0]
        if fixed_batch and n < fixed_batch:  # pad the last chunk of a fixed-batch model
            pad = np.repeat(part[-1:], fixed_batch - n, axis=0)
            part = np.concatenate([part, pad], axis=0)
        outs.append(session.run(None, {name: part})[0][:n])
    return np.concatenate(outs, axis=0)


def _run_torch(model: nn.Module, x: np.ndarray, chunk: int) -> np.ndarray:
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    was_training = model.training
    model.eval()
    outs = []
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], chunk):
                t = torch.from_numpy(x[start:start + chunk]).to(device=device, dtype=dtype)
                try:
                    out = model(t)
                except Exception as err:
                    msg = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
                    raise UserError(f"the PyTorch model does not take input of shape "
                                    f"{tuple(t.shape)} ({msg})") from None
                if not isinstance(out, torch.Tensor):
                    raise UserError(f"the PyTorch model returns {type(out).__name__}, not a tensor")
                outs.append(out.detach().float().cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(outs, axis=0)


def compare_outputs(onnx_out: np.ndarray, torch_out: np.ndarray, *, output_kind: str | None = None,
                    atol: float = 1e-4, rtol: float = 0.0) -> dict[str, Any]:
    """Differences and agreement between two output batches (``torch_out`` is the reference)."""
    if onnx_out.shape != torch_out.shape:
        raise UserError(f"output shape mismatch: ONNX {tuple(onnx_out.shape)} vs "
                        f"PyTorch {tuple(torch_out.shape)}")
    a = onnx_out.astype(np.float64)
    b = torch_out.astype(np.float64)
    diff = np.abs(a - b)
    kind = infer_output_kind(torch_out, output_kind)
    if kind == "logits":
        flat_a = a.reshape(a.shape[0], -1)
        flat_b = b.reshape(b.shape[0], -1)
        agreement = float(np.mean(flat_a.argmax(1) == flat_b.argmax(1)))
        agreement_name = "top1_agreement"
    else:
        agreement = float(np.mean((a > SALIENCY_THRESHOLD) == (b > SALIENCY_THRESHOLD)))
        agreement_name = f"mask_agreement@{SALIENCY_THRESHOLD}"
    within = diff <= atol + rtol * np.abs(b)
    nonfinite = bool(~np.isfinite(a).all() or ~np.isfinite(b).all())
    return {
        "n": int(a.shape[0]),
        "output_shape": list(torch_out.shape[1:]),
        "output_kind": kind,
        "max_abs_diff": float(diff.max()) if diff.size else 0.0,
        "mean_abs_diff": float(diff.mean()) if diff.size else 0.0,
        "max_abs_reference": float(np.abs(b).max()) if b.size else 0.0,
        "agreement": agreement,
        "agreement_metric": agreement_name,
        "atol": float(atol),
        "rtol": float(rtol),
        "passed": bool(within.all()) and not nonfinite,
    }


def verify_onnx(onnx_path: str | os.PathLike, torch_model: nn.Module, inputs: Any,
                atol: float = 1e-4, *, rtol: float = 0.0, output_kind: str | None = None,
                batch_size: int = 16, threads: int | None = None) -> dict[str, Any]:
    """Run ONNX Runtime (CPU) and PyTorch on ``inputs`` and compare.

    Args:
        onnx_path: the exported file.
        torch_model: the PyTorch model it was exported from (any device; put in eval mode).
        inputs: (N, C, H, W) tensor or array (real, preprocessed images).
        atol, rtol: pass iff ``|onnx - torch| <= atol + rtol * |torch|`` everywhere.
        output_kind: ``"logits"`` or ``"saliency"``; default: the file's ``output_kind`` metadata,
            else inferred from the output rank (2-d -> logits).
        batch_size: inputs per inference.
        threads: ONNX Runtime intra-op threads (default: ORT's).

    Returns:
        dict with ``n``, ``max_abs_diff``, ``mean_abs_diff``, ``agreement`` (top-1 agreement for
        logits, thresholded-map agreement for saliency), ``agreement_metric``, ``output_kind``,
        ``atol``, ``rtol``, ``passed``, ``onnx_path``, ``input_shape``.

    Raises:
        UserError: missing or corrupt ONNX file; inputs of a shape the model does not take.
    """
    from runners.onnxruntime_runner import load_session

    path = Path(onnx_path)
    x = _as_numpy(inputs)
    session = load_session(path, providers=["cpu"], threads=threads)
    fixed_batch = check_input_shape(session, x.shape)
    if output_kind is None:
        meta = session.get_modelmeta().custom_metadata_map
        declared = meta.get("output_kind")
        output_kind = declared if declared in ("logits", "saliency") else None
    chunk = max(1, int(batch_size))
    onnx_out = _run_onnx(session, x, fixed_batch, chunk)
    torch_out = _run_torch(torch_model, x, chunk)
    report = compare_outputs(onnx_out, torch_out, output_kind=output_kind, atol=atol, rtol=rtol)
    report["onnx_path"] = str(path)
    report["input_shape"] = list(x.shape[1:])
    return report


def format_report(report: dict[str, Any]) -> str:
    """One human-readable summary line per fact, for the CLI."""
    verdict = "PASS" if report["passed"] else "FAIL"
    tol = f"atol {report['atol']:g}" + (f" + rtol {report['rtol']:g}" if report.get("rtol") else "")
    return "\n".join([
        f"inputs:        {report['n']} x {tuple(report['input_shape'])}",
        f"output:        {report['output_kind']} {tuple(report['output_shape'])}",
        f"max abs diff:  {report['max_abs_diff']:.3e}  (max |ref| {report['max_abs_reference']:.3g})",
        f"mean abs diff: {report['mean_abs_diff']:.3e}",
        f"{report['agreement_metric']}: {report['agreement'] * 100:.2f}%",
        f"{verdict} ({tol})",
    ])
