"""Engine loading: deserialize a TensorRT engine and check it matches this GPU and TensorRT.

An engine only loads on the GPU model (compute capability) and TensorRT version that built it;
:func:`check_engine_matches_gpu` reads the build sidecar (``<engine>.json``, written by
:func:`exporters.tensorrt.build_engine`) and refuses a mismatch with a one-line error that says
to rebuild, before TensorRT fails with a less helpful message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from edgeprune.errors import UserError
from exporters.tensorrt import make_logger, tensorrt_version

if TYPE_CHECKING:
    import tensorrt as trt


def load_engine(engine_path: str | os.PathLike[str]
                ) -> tuple[trt.Runtime, trt.ICudaEngine, str, trt.ILogger]:
    """Deserialize an engine; returns (runtime, engine, TensorRT version, logger).

    The caller keeps the runtime and the logger alive as long as the engine (TensorRT holds
    raw pointers to them).

    Raises:
        RuntimeFault: TensorRT is not installed.
        UserError: missing engine file; TensorRT cannot deserialize it (other GPU/version).
    """
    version = tensorrt_version()
    path = Path(engine_path)
    if not path.is_file():
        raise UserError(f"engine file {str(path)!r} not found")

    import tensorrt as trt

    logger, errors = make_logger()
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        detail = errors[-1] if errors else "unknown error"
        raise UserError(f"TensorRT {version} cannot load {path.name} (engines only load on the GPU "
                        f"model and TensorRT version that built them): {detail}")
    return runtime, engine, version, logger


def check_engine_matches_gpu(sidecar: Mapping[str, Any] | None, gpu: Any, trt_version: str) -> None:
    """Refuse an engine whose sidecar names another GPU (compute capability) or TensorRT version.

    Args:
        sidecar: the engine's build sidecar (``None``: nothing to check).
        gpu: :class:`devices.gpu.GpuInfo` of this GPU.
        trt_version: the installed TensorRT version.

    Raises:
        UserError: a mismatch (the message says to rebuild on this device).
    """
    if not sidecar:
        return
    built_cc = (sidecar.get("gpu") or {}).get("compute_capability")
    if built_cc and gpu is not None and built_cc != gpu.compute_capability_str:
        raise UserError(
            f"engine was built on {sidecar['gpu'].get('name', '?')} (compute capability {built_cc}) "
            f"but this GPU is {gpu.name} ({gpu.compute_capability_str}): rebuild it here with "
            f"`edgeprune build ... --device <profile>`")
    built_trt = sidecar.get("tensorrt_version")
    if built_trt and built_trt != trt_version:
        raise UserError(f"engine was built with TensorRT {built_trt} but TensorRT {trt_version} is "
                        "installed: rebuild it with this version")


__all__ = ["check_engine_matches_gpu", "load_engine"]
