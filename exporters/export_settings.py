"""The settings of an ONNX export and of its verification, declared once (issue 53): ``[export]`` and ``[verify]``.

``edgeprune export``'s and ``edgeprune verify``'s setting options are generated from :class:`ExportSection` and
:class:`VerifySection` (``edgeprune.cli.generate``); the field names are the keywords of
:func:`edgeprune.jobs.export.export` and :func:`edgeprune.jobs.verify.verify` (``--static-batch`` = ``static_batch``,
``--no-check`` sets ``check=False``). The jobs' own inputs (the run or model, the output file, ``--force``, the
evaluation data, the JSON report, the devices) are not settings.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprune.settings import Declared, Section, declared_of, setting
from exporters.attention_pattern import ATTENTION_CHOICES


@dataclasses.dataclass(frozen=True)
class ExportSection(Section):
    """How a model is written to ONNX: the opset, the batch axis, the attention layout and the quick check."""

    name: ClassVar[str] = "export"
    title: ClassVar[str] = "Export"

    opset: int = setting(17, "ONNX opset (17: TensorRT 10.x; attention as MatMul/Softmax).")
    static_batch: int | None = setting(None, "Fixed batch size B instead of a dynamic batch axis.", metavar="B")
    check: bool = setting(True, "Skip the ONNX Runtime vs PyTorch check on 2 noise images.", switch="negated",
                          flag="no-check")
    attention: str = setting("packed", "Attention in the graph: separate q/k/v MatMuls that ONNX Runtime's "
                             "transformer optimizer fuses (fusible), the model's packed qkv (packed), or ONNX's own "
                             "Attention op (standard: --opset 23, needs onnxscript).",
                             choices=ATTENTION_CHOICES)


@dataclasses.dataclass(frozen=True)
class VerifySection(Section):
    """How an ONNX file is judged against its PyTorch model: the inputs, the tolerances, the quantized gate."""

    name: ClassVar[str] = "verify"
    title: ClassVar[str] = "Verify"

    n: int = setting(64, "Number of evaluation inputs.", minimum=1)
    atol: float = setting(1e-4, "Max abs difference allowed.")
    rtol: float = setting(0.0, "Plus rtol x |PyTorch output|.")
    batch_size: int = setting(16, "Images per batch.", minimum=1)
    max_drop: float | None = setting(None, "Quantized files: fail (exit 1) if top-1 (or top-1 agreement) drops by "
                                     "more than POINTS.", metavar="POINTS", unit="points")


#: the sections of an export / a verify, in help order
EXPORT_SECTIONS: tuple[type[Section], ...] = (ExportSection,)
VERIFY_SECTIONS: tuple[type[Section], ...] = (VerifySection,)


def export_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every export setting."""
    return declared_of(EXPORT_SECTIONS)


def verify_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every verify setting."""
    return declared_of(VERIFY_SECTIONS)


__all__ = ["EXPORT_SECTIONS", "ExportSection", "VERIFY_SECTIONS", "VerifySection",
           "export_declared", "verify_declared"]
