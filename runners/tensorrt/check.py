"""Agreement of a TensorRT engine with ONNX Runtime (FP32, CPU) on the same inputs.

:func:`compare_outputs` is pure (two arrays -> :class:`Agreement`: max/mean abs difference,
elementwise ``allclose``, top-1 agreement for (B, classes) outputs);
:func:`check_against_onnxruntime` runs both back ends on real inputs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

# Default tolerances for FP16 engines against FP32 ONNX Runtime: logits of a ViT differ by
# about 1e-3..1e-2 after FP16 accumulation; the relative term covers large logits.
FP16_ATOL = 2e-2
FP16_RTOL = 2e-2


@dataclasses.dataclass
class Agreement:
    """TensorRT vs ONNX Runtime on the same inputs."""

    max_abs_diff: float
    mean_abs_diff: float
    allclose: bool
    """``np.allclose(trt, ort, atol, rtol)`` elementwise."""
    top1_agreement: float | None
    """Fraction of samples with the same argmax (classification outputs (B, classes) only)."""
    atol: float
    rtol: float
    n_samples: int

    @property
    def agrees(self) -> bool:
        return self.allclose

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["agrees"] = self.agrees
        return d


def compare_outputs(trt_out: np.ndarray, ort_out: np.ndarray, *, atol: float = FP16_ATOL,
                    rtol: float = FP16_RTOL) -> Agreement:
    """Compare two outputs of the same shape (the first is the TensorRT one).

    Args:
        trt_out, ort_out: e.g. logits (B, classes); compared in float64.
        atol, rtol: ``np.allclose`` tolerances.

    Raises:
        ValueError: the shapes differ.
    """
    a = np.asarray(trt_out, dtype=np.float64)
    b = np.asarray(ort_out, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"output shapes differ: TensorRT {a.shape} vs ONNX Runtime {b.shape}")
    diff = np.abs(a - b)
    top1 = None
    if a.ndim == 2 and a.shape[1] > 1:
        top1 = float(np.mean(a.argmax(axis=1) == b.argmax(axis=1)))
    finite = bool(np.isfinite(a).all())
    return Agreement(
        max_abs_diff=float(diff.max()) if diff.size else 0.0,
        mean_abs_diff=float(diff.mean()) if diff.size else 0.0,
        allclose=finite and bool(np.allclose(a, b, atol=atol, rtol=rtol)),
        top1_agreement=top1, atol=atol, rtol=rtol,
        n_samples=int(a.shape[0]) if a.ndim else 1,
    )


def check_against_onnxruntime(engine_path: str | os.PathLike[str], onnx_path: str | os.PathLike[str],
                              inputs: np.ndarray, *, atol: float = FP16_ATOL,
                              rtol: float = FP16_RTOL) -> Agreement:
    """Run the engine and ONNX Runtime (CPU, FP32) on ``inputs`` and compare the first output.

    ``inputs`` (N, C, H, W) float32 is fed in chunks of at most the engine's largest batch.
    Defaults suit an FP16 engine; use e.g. ``atol=rtol=1e-4`` for FP32.

    Raises:
        RuntimeFault: TensorRT, cuda-python or a GPU missing.
        UserError: see :class:`runners.tensorrt.runner.TrtRunner`.
    """
    import onnxruntime as ort

    from runners.tensorrt.runner import TrtRunner

    x = np.ascontiguousarray(np.asarray(inputs, dtype=np.float32))
    sess = ort.InferenceSession(os.fspath(onnx_path), providers=["CPUExecutionProvider"])
    in_name = sess.get_inputs()[0].name
    with TrtRunner(engine_path) as runner:
        step = runner.max_batch
        trt_parts: list[np.ndarray] = []
        ort_parts: list[np.ndarray] = []
        for i in range(0, x.shape[0], step):
            chunk = x[i:i + step]
            if chunk.shape[0] < runner.min_batch:  # static-batch engine: pad the tail
                pad = np.zeros((runner.min_batch - chunk.shape[0], *chunk.shape[1:]), np.float32)
                trt_parts.append(runner.infer(np.concatenate([chunk, pad]))[:chunk.shape[0]])
            else:
                trt_parts.append(runner.infer(chunk))
            ort_parts.append(np.asarray(sess.run(None, {in_name: chunk})[0], dtype=np.float32))
    return compare_outputs(np.concatenate(trt_parts), np.concatenate(ort_parts), atol=atol, rtol=rtol)


__all__ = ["FP16_ATOL", "FP16_RTOL", "Agreement", "check_against_onnxruntime", "compare_outputs"]
