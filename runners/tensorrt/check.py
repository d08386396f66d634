"""Agreement of a TensorRT engine with ONNX Runtime (FP32, CPU) on the same inputs.

:func:`compare_outputs` is pure (two arrays -> :class:`~exporters.agreement.OutputAgreement`, the
one comparison ``edgeprune verify`` uses too, with FP16 tolerances);
:func:`check_against_onnxruntime` runs both back ends on real inputs.
"""

from __future__ import annotations

import os

import numpy as np

from exporters.agreement import OutputAgreement
from exporters.agreement import compare_outputs as output_agreement
from runners.tensorrt.runner import TrtRunner

# Default tolerances for FP16 engines against FP32 ONNX Runtime: logits of a ViT differ by
# about 1e-3..1e-2 after FP16 accumulation; the relative term covers large logits.
FP16_ATOL = 2e-2
FP16_RTOL = 2e-2


#: the result of :func:`compare_outputs` (``agrees``, ``top1_agreement``, ``max_abs_diff``, ...)
Agreement = OutputAgreement


def compare_outputs(trt_out: np.ndarray, ort_out: np.ndarray, *, atol: float = FP16_ATOL,
                    rtol: float = FP16_RTOL) -> OutputAgreement:
    """Compare a TensorRT output with the ONNX Runtime one (the reference), same shape.

    :func:`exporters.agreement.compare_outputs` with FP16-engine tolerances: ``agrees`` iff
    ``|trt - ort| <= atol + rtol * |ort|`` everywhere and all values are finite.

    Raises:
        UserError: the shapes differ.
    """
    return output_agreement(trt_out, ort_out, atol=atol, rtol=rtol, names=("TensorRT", "ONNX Runtime"))


def check_against_onnxruntime(engine_path: str | os.PathLike[str], onnx_path: str | os.PathLike[str],
                              inputs: np.ndarray, *, atol: float = FP16_ATOL,
                              rtol: float = FP16_RTOL) -> OutputAgreement:
    """Run the engine and ONNX Runtime (CPU, FP32) on ``inputs`` and compare the first output.

    ``inputs`` (N, C, H, W) float32 is fed in chunks of at most the engine's largest batch.
    Defaults suit an FP16 engine; use e.g. ``atol=rtol=1e-4`` for FP32.

    Raises:
        RuntimeFault: TensorRT, cuda-python or a GPU missing.
        UserError: see :class:`runners.tensorrt.runner.TrtRunner`.
    """
    import onnxruntime as ort

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
