"""One comparison of two output batches: differences, tolerance verdict, task-level agreement.

Used by ``edgeprune verify`` (ONNX Runtime vs PyTorch, :mod:`exporters.verify`), by the quantized
checks (int8/fp16 vs float) and by the TensorRT check (engine vs ONNX Runtime,
:mod:`runners.tensorrt.check`). ``reference`` is always the second argument: the tolerance is
``|out - reference| <= atol + rtol * |reference|`` elementwise (``np.allclose``'s rule), and any
non-finite value on either side fails. Agreement is top-1 agreement for (N, K) logits, or for
saliency maps the fraction of pixels on which the two maps thresholded at 0.5 agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from edgeprune.errors import UserError

SALIENCY_THRESHOLD = 0.5


def infer_output_kind(output: np.ndarray, declared: str | None = None) -> str:
    """``"logits"`` for (N, K) outputs, ``"saliency"`` otherwise (unless ``declared``: ``"dense"`` is a network's
    several outputs side by side, compared element by element)."""
    if declared in ("logits", "saliency", "dense"):
        return declared
    return "logits" if output.ndim == 2 else "saliency"


@dataclasses.dataclass
class OutputAgreement:
    """Two output batches of the same N inputs, compared (see the module doc).

    Attributes:
        n: number of inputs (first axis).
        output_shape: per-input output shape, e.g. ``[10]`` for (N, 10) logits.
        output_kind: ``logits``, ``saliency`` or ``dense`` (several outputs side by side).
        max_abs_diff, mean_abs_diff: of ``|out - reference|`` over all elements (float64).
        max_abs_reference: ``max |reference|`` (the scale the differences compare with).
        agreement: fraction in [0, 1] (see ``agreement_metric``).
        agreement_metric: ``top1_agreement``, ``mask_agreement@0.5`` or ``elements_within_tolerance``.
        atol, rtol: the tolerances of the verdict.
        passed: every element within tolerance and every value finite.
        inputs_within_tolerance: the inputs whose every output element is within tolerance (of ``n``).
    """

    n: int
    output_shape: list[int]
    output_kind: str
    max_abs_diff: float
    mean_abs_diff: float
    max_abs_reference: float
    agreement: float
    agreement_metric: str
    atol: float
    rtol: float
    passed: bool
    inputs_within_tolerance: int = 0

    @property
    def agrees(self) -> bool:
        """Same as :attr:`passed` (the name the TensorRT check uses)."""
        return self.passed

    @property
    def top1_agreement(self) -> float | None:
        """Top-1 agreement for (N, K > 1) logits, else ``None``."""
        if self.output_kind == "logits" and len(self.output_shape) == 1 and self.output_shape[0] > 1:
            return self.agreement
        return None

    @property
    def n_samples(self) -> int:
        """Same as :attr:`n`."""
        return self.n

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``edgeprune verify``'s report keys)."""
        return dataclasses.asdict(self)


def compare_outputs(out: np.ndarray, reference: np.ndarray, *, output_kind: str | None = None,
                    atol: float = 1e-4, rtol: float = 0.0,
                    names: tuple[str, str] = ("ONNX", "PyTorch")) -> OutputAgreement:
    """Compare ``out`` with ``reference`` (same shape, e.g. (N, K) logits), in float64.

    Args:
        out, reference: the two output batches; ``reference`` sets the rtol scale.
        output_kind: ``logits``/``saliency``; default inferred from the rank (2-d -> logits).
        atol, rtol: pass iff ``|out - reference| <= atol + rtol * |reference|`` everywhere.
        names: what ``out`` and ``reference`` are, for the error message.

    Raises:
        UserError: the shapes differ.
    """
    if np.shape(out) != np.shape(reference):
        raise UserError(f"output shape mismatch: {names[0]} {tuple(np.shape(out))} vs "
                        f"{names[1]} {tuple(np.shape(reference))}")
    a = np.asarray(out, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    diff = np.abs(a - b)
    kind = infer_output_kind(b, output_kind)
    if kind == "logits":
        flat_a = a.reshape(a.shape[0], -1)
        flat_b = b.reshape(b.shape[0], -1)
        agreement = float(np.mean(flat_a.argmax(1) == flat_b.argmax(1)))
        agreement_name = "top1_agreement"
    within = diff <= atol + rtol * np.abs(b)
    if kind == "dense":
        agreement = float(within.mean()) if within.size else 1.0
        agreement_name = "elements_within_tolerance"
    elif kind != "logits":
        agreement = float(np.mean((a > SALIENCY_THRESHOLD) == (b > SALIENCY_THRESHOLD)))
        agreement_name = f"mask_agreement@{SALIENCY_THRESHOLD}"
    nonfinite = bool(~np.isfinite(a).all() or ~np.isfinite(b).all())
    return OutputAgreement(
        n=int(a.shape[0]),
        output_shape=list(np.shape(reference)[1:]),
        output_kind=kind,
        max_abs_diff=float(diff.max()) if diff.size else 0.0,
        mean_abs_diff=float(diff.mean()) if diff.size else 0.0,
        max_abs_reference=float(np.abs(b).max()) if b.size else 0.0,
        agreement=agreement,
        agreement_metric=agreement_name,
        atol=float(atol),
        rtol=float(rtol),
        passed=bool(within.all()) and not nonfinite,
        inputs_within_tolerance=int(np.all(within, axis=tuple(range(1, within.ndim))).sum()) if within.ndim else 1,
    )


__all__ = ["OutputAgreement", "SALIENCY_THRESHOLD", "compare_outputs", "infer_output_kind"]
