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
from edgeprune.settings import SettingError
from exporters.agreement import SALIENCY_THRESHOLD, infer_output_kind  # noqa: F401  (re-exported)
from exporters.agreement import compare_outputs as output_agreement
from exporters.ort_session import load_session
from exporters.arrays import source_to_array


def as_input_batch(inputs: Any) -> np.ndarray:
    """``inputs`` (N, C, H, W) tensor or array as a contiguous float32 array.

    Raises:
        UserError: not 4-d, or no inputs.
    """
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


def run_onnx(session: Any, x: np.ndarray, fixed_batch: int | None, chunk: int) -> np.ndarray:
    """Outputs of an ORT ``session`` on ``x`` (N, C, H, W) in chunks of ``fixed_batch`` or ``chunk``
    inputs (the last chunk of a fixed-batch model padded by repeating its last image)."""
    name = session.get_inputs()[0].name
    step = fixed_batch or chunk
    outs = []
    for start in range(0, x.shape[0], step):
        part = x[start:start + step]
        n = part.shape[0]
        if fixed_batch and n < fixed_batch:  # pad the last chunk of a fixed-batch model
            pad = np.repeat(part[-1:], fixed_batch - n, axis=0)
            part = np.concatenate([part, pad], axis=0)
        outs.append(flat_outputs(session.run(None, {name: part}), n))
    return np.concatenate(outs, axis=0)


def flat_outputs(outputs: Sequence[Any], n: int | None = None) -> np.ndarray:
    """One output as it is (its first ``n`` rows); several (a network's tuple or dict, issue 55) flattened per input
    and concatenated into one (n, F) array in the graph's output order."""
    arrs = [np.asarray(o) for o in outputs]
    if n is not None:
        arrs = [a[:n] for a in arrs]
    return arrs[0] if len(arrs) == 1 else np.concatenate([a.reshape(a.shape[0], -1) for a in arrs], axis=1)


def run_torch(model: nn.Module, x: np.ndarray, chunk: int) -> np.ndarray:
    """Outputs of ``model`` on ``x`` (N, C, H, W) float32 in chunks of ``chunk`` inputs, flattened as
    :func:`flat_outputs` (eval mode, no grad, on the model's device and dtype).

    Raises:
        UserError: the model does not take the input, or returns something other than tensors.
    """
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
                values = list(out.values()) if isinstance(out, dict) else out
                if isinstance(values, torch.Tensor):
                    values = [values]
                if not (isinstance(values, (tuple, list)) and values
                        and all(isinstance(v, torch.Tensor) for v in values)):
                    raise UserError(f"the PyTorch model returns {type(out).__name__}, not a tensor or a tuple/dict "
                                    "of tensors")
                outs.append(flat_outputs([v.detach().float().cpu().numpy() for v in values]))
    finally:
        model.train(was_training)
    return np.concatenate(outs, axis=0)


def compare_outputs(onnx_out: np.ndarray, torch_out: np.ndarray, *, output_kind: str | None = None,
                    atol: float = 1e-4, rtol: float = 0.0) -> dict[str, Any]:
    """Differences and agreement between two output batches (``torch_out`` is the reference).

    :func:`exporters.agreement.compare_outputs` as a dict (the keys of ``edgeprune verify``'s report).

    Raises:
        UserError: the shapes differ.
    """
    return output_agreement(onnx_out, torch_out, output_kind=output_kind, atol=atol, rtol=rtol).to_dict()


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
    path = Path(onnx_path)
    x = as_input_batch(inputs)
    session = load_session(path, providers=["cpu"], threads=threads)
    fixed_batch = check_input_shape(session, x.shape)
    if output_kind is None:
        meta = session.get_modelmeta().custom_metadata_map
        declared = meta.get("output_kind")
        output_kind = declared if declared in ("logits", "saliency") else None
    chunk = max(1, int(batch_size))
    onnx_out = run_onnx(session, x, fixed_batch, chunk)
    torch_out = run_torch(torch_model, x, chunk)
    if len(session.get_outputs()) > 1:
        output_kind = "dense"  # several outputs, compared flattened side by side
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
        f"inputs within tolerance: {report.get('inputs_within_tolerance', report['n'])} of {report['n']}",
        *([f"note:          {report['note']}"] if report.get("note") else []),
        *([report["merge_replay_line"]] if report.get("merge_replay_line") else []),
        f"{verdict} ({tol}" + (", ONNX Runtime's merge choices replayed)" if report.get("merge_replay") else ")"),
    ])


# ---------------------------------------------------------------------------------------------
# quantized models: verification by metric (top-1, agreement), not by allclose


def _outputs_of(reference: Any, x: np.ndarray, batch_size: int, threads: int | None) -> np.ndarray:
    """Outputs of an ONNX file (path) or a PyTorch module on ``x`` (N, C, H, W) float32."""
    if isinstance(reference, nn.Module):
        return run_torch(reference, x, batch_size)
    session = load_session(Path(reference), providers=["cpu"], threads=threads)
    fixed = check_input_shape(session, x.shape)
    return run_onnx(session, x, fixed, batch_size).astype(np.float32)


def quantized_metrics(quant_out: np.ndarray, float_out: np.ndarray, labels: np.ndarray | None,
                      output_kind: str | None = None) -> dict[str, Any]:
    """Top-1 (when labels exist) and agreement of a quantized model's outputs with the float model's.

    Args:
        quant_out, float_out: (N, K) logits or (N, ...) saliency maps of the same N images.
        labels: (N,) int class indices, or ``None``.

    Returns:
        dict with ``n``, ``output_kind``, ``agreement`` (fraction of images whose top-1 class
        matches the float model's; for saliency maps the fraction of pixels on which the maps
        thresholded at 0.5 agree), ``agreement_metric``, ``top1`` / ``top1_float`` (fractions, or
        ``None`` without labels), ``drop_points`` and ``drop_metric``: the top-1 loss in
        percentage points (``100 * (top1_float - top1)``) when labels exist, otherwise the
        disagreement ``100 * (1 - agreement)``; ``max_abs_diff``.
    """
    cmp = compare_outputs(quant_out, float_out, output_kind=output_kind, atol=np.inf)
    top1 = top1_float = None
    if labels is not None and cmp["output_kind"] == "logits":
        y = np.asarray(labels).reshape(-1)
        top1 = float(np.mean(quant_out.argmax(1) == y))
        top1_float = float(np.mean(float_out.argmax(1) == y))
        drop, metric = 100.0 * (top1_float - top1), "top1_points"
    else:
        drop, metric = 100.0 * (1.0 - cmp["agreement"]), "disagreement_percent"
    return {"n": cmp["n"], "output_kind": cmp["output_kind"], "agreement": cmp["agreement"],
            "agreement_metric": cmp["agreement_metric"], "top1": top1, "top1_float": top1_float,
            "drop_points": float(drop), "drop_metric": metric, "max_abs_diff": cmp["max_abs_diff"]}


def verify_quantized(onnx_path: str | os.PathLike, float_reference: Any, eval_source: Any,
                     max_drop: float | None = None, *, batch_size: int = 64,
                     threads: int | None = None, output_kind: str | None = None) -> dict[str, Any]:
    """Check a quantized (int8 / fp16) ONNX model by task metric against its float model.

    ``allclose`` is the wrong test for a quantized model (int8 logits differ from fp32 by design);
    what matters is whether it still classifies like the float model. This runs both on the
    held-out images of ``eval_source`` (never the calibration images) and reports top-1 and top-1
    agreement (see :func:`quantized_metrics`).

    Args:
        onnx_path: the quantized file (run with ONNX Runtime, CPU).
        float_reference: the float model: a path to the fp32 ONNX file or the PyTorch module
            (e.g. ``load_run_or_model(run_dir, ...)[0]``).
        eval_source: held-out images: a data source with ``batches(b)`` yielding
            ``(images (B, C, H, W), labels (B,) or None)`` (``ModelSpec.eval_source``), or an
            ``(images, labels|None)`` pair of arrays.
        max_drop: gate, in points: fail when ``drop_points`` (top-1 loss with labels, else
            disagreement in percent) exceeds it; ``None`` = report only (always passes).
        batch_size, threads: ONNX Runtime batch and intra-op threads.
        output_kind: ``"logits"``/``"saliency"``; default: the file's ``output_kind`` metadata.

    Returns:
        dict of :func:`quantized_metrics` plus ``precision`` (from the file's metadata),
        ``max_drop``, ``passed`` and ``onnx_path``.

    Raises:
        UserError: missing / corrupt files, inputs the model does not take, empty source.
    """
    path = Path(onnx_path)
    if max_drop is not None and max_drop < 0:
        raise SettingError(f"{{max_drop}} must be >= 0 points, got {max_drop}")
    if isinstance(eval_source, tuple):
        x, labels = eval_source
        x = as_input_batch(x)
        labels = None if labels is None else np.asarray(labels)
    else:
        x, labels = source_to_array(eval_source)
        x = as_input_batch(x)
    session = load_session(path, providers=["cpu"], threads=threads)
    fixed = check_input_shape(session, x.shape)
    meta = session.get_modelmeta().custom_metadata_map
    if output_kind is None and meta.get("output_kind") in ("logits", "saliency"):
        output_kind = meta["output_kind"]
    chunk = max(1, int(batch_size))
    quant_out = run_onnx(session, x, fixed, chunk).astype(np.float32)
    del session
    float_out = _outputs_of(float_reference, x, chunk, threads)
    report = quantized_metrics(quant_out, float_out, labels, output_kind)
    report["precision"] = meta.get("precision", "fp32")
    report["max_drop"] = max_drop
    report["passed"] = max_drop is None or report["drop_points"] <= max_drop + 1e-9
    report["onnx_path"] = str(path)
    return report


def format_quantized_report(report: dict[str, Any]) -> str:
    """Human-readable lines for :func:`verify_quantized`'s report."""
    lines = [f"images:        {report['n']} held-out ({report.get('precision', '?')} vs float)"]
    if report.get("top1") is not None:
        lines.append(f"top-1:         {report['top1'] * 100:.2f}%  (float {report['top1_float'] * 100:.2f}%, "
                     f"drop {report['drop_points']:+.2f} points)")
    lines.append(f"{report['agreement_metric']}: {report['agreement'] * 100:.2f}% with the float model")
    if report.get("max_drop") is not None:
        what = "top-1 drop" if report["drop_metric"] == "top1_points" else "disagreement"
        verdict, cmp = ("PASS", "<=") if report["passed"] else ("FAIL", ">")
        lines.append(f"{verdict} ({what} {report['drop_points']:.2f} points {cmp} max {report['max_drop']:g})")
    return "\n".join(lines)
