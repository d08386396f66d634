"""The pure half of a TensorRT build: what the ONNX file holds and what the builder must be told.

No TensorRT needed: :func:`onnx_input` reads the single input's name and shape,
:func:`onnx_precision` tells an explicitly quantized (Q/DQ) model from a float one, and
:func:`builder_settings` turns a device profile plus those facts into the settings dict that
drives both :func:`exporters.tensorrt.apply_settings` and :mod:`exporters.trtexec`.

INT8 follows TensorRT's *explicit quantization* path (TensorRT developer guide, "Explicit
Versus Implicit Quantization"): the ONNX carries QuantizeLinear/DequantizeLinear pairs with
their scales (``edgeprune quantize --precision int8`` writes them), and the builder is given
the INT8 and FP16 flags so that layers outside the Q/DQ regions may run in FP16. There is no
implicit (calibrator-based) INT8 here: int8 asked for on a model without Q/DQ nodes is refused.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from edgeprune.atomic import file_sha256  # noqa: F401 (re-exported)
from edgeprune.errors import UserError
from edgeprune.settings import Declared, Section, declared_of, setting

if TYPE_CHECKING:
    from devices.profile import DeviceProfile

Shape = tuple[int | str, ...]
"""An ONNX input shape: ints for fixed dims, a name (or -1) for dynamic ones."""

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
QOPERATOR_OPS = frozenset({"QLinearConv", "QLinearMatMul", "QLinearAdd", "QLinearMul",
                           "MatMulInteger", "ConvInteger", "DynamicQuantizeLinear"})
#: ops of ONNX Runtime *dynamic* quantization (``edgeprune quantize --mode dynamic``)
DYNAMIC_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"})
BUILD_PRECISIONS = ("fp16", "fp32", "int8")


def _load_graph(onnx_path: str | os.PathLike[str]) -> Any:
    import onnx

    path = Path(onnx_path)
    if not path.is_file():
        raise UserError(f"ONNX file {str(path)!r} not found")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as err:
        raise UserError(f"cannot read ONNX file {str(path)!r}: {err}") from None


def onnx_input(onnx_path: str | os.PathLike[str]) -> tuple[str, Shape]:
    """Name and shape of the single graph input of an ONNX file (weights are not loaded).

    Raises:
        UserError: missing or unreadable file, or not exactly one input.
    """
    path = Path(onnx_path)
    model = _load_graph(path)
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise UserError(f"{path.name}: expected exactly one graph input (an image batch), "
                        f"found {len(inputs)}: {', '.join(i.name for i in inputs)}")
    inp = inputs[0]
    dims: list[int | str] = []
    for d in inp.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or -1)
    return inp.name, tuple(dims)


def onnx_precision(onnx_path: str | os.PathLike[str], *, for_tensorrt: bool = True) -> str:
    """The numeric format of an ONNX model, from its nodes and initializers.

    Args:
        onnx_path: the model.
        for_tensorrt: the caller builds a TensorRT engine from it; ``False`` for ONNX Runtime,
            which also runs dynamically quantized models (``edgeprune quantize --mode dynamic``).

    Returns:
        ``"int8"`` when it has QuantizeLinear/DequantizeLinear nodes (explicit quantization), or,
        with ``for_tensorrt=False``, dynamic-quantization nodes; ``"fp16"`` when its initializers
        are float16, else ``"fp32"``.

    Raises:
        UserError: missing or unreadable file; for TensorRT, a dynamically quantized model or a
            QOperator-format model (QLinearMatMul, ...), which it cannot build (re-quantize
            statically in QDQ format).
    """
    from onnx import TensorProto

    model = _load_graph(onnx_path)
    ops = {n.op_type for n in model.graph.node}
    if ops & QDQ_OPS:
        return "int8"
    if ops & DYNAMIC_OPS:
        if not for_tensorrt:
            return "int8"
        raise UserError(f"{Path(onnx_path).name} is dynamically quantized (DynamicQuantizeLinear: ONNX Runtime "
                        "CPU only); for TensorRT quantize the fp32 export with --mode static "
                        "(edgeprune quantize MODEL.onnx --precision int8 --mode static)")
    qop = sorted(ops & QOPERATOR_OPS)
    if qop:
        raise UserError(f"{Path(onnx_path).name} is quantized in QOperator format ({', '.join(qop)}); "
                        "re-quantize it in QDQ format (edgeprune quantize --precision int8)")
    if any(i.data_type == TensorProto.FLOAT16 for i in model.graph.initializer):
        return "fp16"
    return "fp32"


def require_quantized(onnx_path: str | os.PathLike[str], model_precision: str, precision: str) -> None:
    """UserError when ``precision`` is int8 but the model has no Q/DQ nodes."""
    if precision == "int8" and model_precision != "int8":
        name = Path(onnx_path).name
        raise UserError(f"int8 needs an explicitly quantized model, and {name} has no Q/DQ nodes "
                        f"(run `edgeprune quantize {name} --precision int8 -o model.int8.onnx` first)")




def _is_dynamic(d: int | str) -> bool:
    return isinstance(d, str) or d < 0


def builder_settings(profile: DeviceProfile, onnx_input_shape: Sequence[int | str], *,
                     input_name: str = "input",
                     timing_cache: str | os.PathLike[str] | None = None,
                     precision: str | None = None, model_precision: str = "fp32") -> dict[str, Any]:
    """Everything the builder needs, derived from a device profile and the ONNX input shape.

    Pure (no TensorRT): the same dict drives :func:`apply_settings` and
    :func:`exporters.trtexec.trtexec_command`.

    Args:
        profile: a TensorRT device profile.
        onnx_input_shape: e.g. ``("batch", 3, 224, 224)``, ``(-1, 3, 224, 224)`` or
            ``(1, 3, 224, 224)``; only the first (batch) dimension may be dynamic.
        input_name: the ONNX input's name.
        timing_cache: overrides the profile's timing-cache path.
        precision: overrides the profile's ``build.precision`` (``fp16``, ``fp32``, ``int8``).
        model_precision: what :func:`onnx_precision` says of the model; ``"int8"`` (Q/DQ nodes)
            always builds with the INT8 flag (explicit quantization), whatever ``precision``.

    Returns:
        dict with ``precision``, ``fp16`` (bool), ``int8`` (bool), ``explicit_quantization``
        (bool: the model has Q/DQ nodes), ``workspace_mib``, ``workspace_bytes``,
        ``builder_optimization_level``, ``profiling_verbosity`` (``"detailed"``),
        ``timing_cache`` (str path), ``input_name``, ``dynamic_batch`` (bool), ``shapes``
        (``{"min": [...], "opt": [...], "max": [...]}``) and ``notes`` (list of str).

    Raises:
        UserError: not a TensorRT profile; a non-batch dimension is dynamic; empty shape;
            unknown precision; int8 on a model without Q/DQ nodes.
    """
    if profile.build is None or not profile.uses_tensorrt:
        raise UserError(f"device profile {profile.name!r} has no TensorRT build settings "
                        f"(backend {profile.backend}); pick a TensorRT profile such as rtx3090 or orin-nx")
    shape = tuple(onnx_input_shape)
    if len(shape) == 0:
        raise UserError(f"ONNX input {input_name!r} is a scalar; expected (batch, C, H, W)")
    dyn_rest = [i for i, d in enumerate(shape[1:], start=1) if _is_dynamic(d)]
    if dyn_rest:
        raise UserError(
            f"ONNX input {input_name!r} has dynamic dimension(s) {dyn_rest} in shape {list(shape)}: "
            "only the batch dimension may be dynamic (re-export with a fixed image size)")
    rest = [int(d) for d in shape[1:]]
    b = profile.build.batch
    notes: list[str] = []
    dynamic = _is_dynamic(shape[0])
    if dynamic:
        shapes = {"min": [b.min, *rest], "opt": [b.opt, *rest], "max": [b.max, *rest]}
    else:
        fixed = int(shape[0])
        shapes = {k: [fixed, *rest] for k in ("min", "opt", "max")}
        if (b.min, b.opt, b.max) != (fixed, fixed, fixed):
            notes.append(f"ONNX batch dimension is fixed at {fixed}: the profile's batch range "
                         f"{b.min}/{b.opt}/{b.max} is ignored (export with a dynamic batch to use it)")
    cache = Path(timing_cache).expanduser() if timing_cache is not None else profile.build.timing_cache
    prec = precision or profile.build.precision
    if prec not in BUILD_PRECISIONS:
        raise UserError(f"unknown precision {prec!r} for a TensorRT build (one of {', '.join(BUILD_PRECISIONS)})")
    qdq = model_precision == "int8"
    if prec == "int8" and not qdq:
        raise UserError("int8 needs an explicitly quantized model, and this ONNX has no Q/DQ nodes "
                        "(run `edgeprune quantize MODEL.onnx --precision int8 -o MODEL.int8.onnx` first)")
    if qdq and prec != "int8":
        notes.append(f"the ONNX has Q/DQ nodes: building with INT8 + FP16 (explicit quantization) "
                     f"instead of {prec}")
        prec = "int8"
    return {
        "precision": prec,
        "fp16": prec in ("fp16", "int8"),
        "int8": prec == "int8",
        "explicit_quantization": qdq,
        "workspace_mib": profile.build.workspace_mib,
        "workspace_bytes": profile.build.workspace_mib * (1 << 20),
        "builder_optimization_level": profile.build.builder_optimization_level,
        "profiling_verbosity": "detailed",
        "timing_cache": str(cache),
        "input_name": input_name,
        "dynamic_batch": dynamic,
        "shapes": shapes,
        "notes": notes,
    }


@dataclasses.dataclass(frozen=True)
class BuildSection(Section):
    """What ``edgeprune build`` changes of a device profile's build (issue 53: declared once): the precision, the
    timing cache, and whether a GPU of another compute capability may build. ``edgeprune build``'s setting options
    are generated from it; the field names are :func:`edgeprune.jobs.build.build`'s keywords. The job's own inputs
    (the ONNX file, the profile, the engine file, ``--print-trtexec``) are not settings."""

    name: ClassVar[str] = "build"
    title: ClassVar[str] = "Build"

    precision: str | None = setting(None, "Instead of the profile's build precision; int8 needs a Q/DQ model "
                                    "(edgeprune quantize).", choices=BUILD_PRECISIONS)
    force_device: bool = setting(False, "Build even if this GPU's compute capability differs from the profile's.",
                                 switch="flag")
    timing_cache: str | None = setting(None, "Timing-cache file to reuse and update", metavar="PATH",
                                       shown_default="the profile's")


#: the sections of a build, in help order
BUILD_SECTIONS: tuple[type[Section], ...] = (BuildSection,)


def build_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every build setting."""
    return declared_of(BUILD_SECTIONS)


__all__ = ["BUILD_PRECISIONS", "BUILD_SECTIONS", "BuildSection", "QDQ_OPS", "Shape", "build_declared",
           "builder_settings", "file_sha256", "onnx_input", "onnx_precision", "require_quantized"]
