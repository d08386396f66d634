"""Build a TensorRT engine from an ONNX file for one device profile (TensorRT 10.x Python API).

:func:`build_engine` parses the ONNX file, configures the builder from the profile
(:func:`builder_settings` is the pure part, :func:`apply_settings` the part that talks to
TensorRT), reuses and updates the profile's timing cache, builds, and writes the engine
atomically with a JSON sidecar ``<engine>.json`` (TensorRT version, GPU, profile, ONNX sha256,
build time). It refuses to build when the local GPU's compute capability differs from the
profile's, unless ``force_device=True``. Before asking for TensorRT it says in one line when the
engine's attention will not be fused (head dims outside the profile's rule for the build precision,
:mod:`exporters.tensorrt_attention`); the forecast is kept in the sidecar (``attention_forecast``).

Only the batch dimension may be dynamic: ``edgeprune export`` fixes channels and image size.
An ONNX file with a static batch gets an engine for exactly that batch (the profile's batch
range is then ignored, with a note in the settings).

TensorRT is imported lazily; without it (or without a GPU) the functions raise
:class:`~edgeprune.errors.RuntimeFault` with one line that says what is missing. A Q/DQ
(explicitly quantized) ONNX is built with INT8 + FP16 (:mod:`exporters.tensorrt_settings`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devices import load_profile
from devices.gpu import check_compute_capability, local_gpu
from edgeprune.atomic import atomic_write_bytes  # noqa: F401  (re-exported)
from edgeprune.errors import RuntimeFault, UserError
from exporters.tensorrt_attention import attention_shapes, fusion_forecast
from exporters.tensorrt_settings import (  # noqa: F401  (re-exported: the pure half of a build)
    Shape,
    builder_settings,
    file_sha256,
    onnx_input,
    onnx_precision,
)

if TYPE_CHECKING:
    import tensorrt as trt

    from devices.profile import DeviceProfile

REQUIRED_TRT_MAJOR = 10
TRT_INSTALL_HINT = (
    "install TensorRT 10.x (JetPack 6 ships 10.3 as python3-libnvinfer; on x86 workstations "
    "`pip install tensorrt-cu12`) into this Python environment"
)
SIDECAR_SUFFIX = ".json"


# --------------------------------------------------------------------------------------------
# TensorRT availability


def tensorrt_version() -> str:
    """The installed TensorRT version, e.g. ``"10.3.0"``.

    Raises:
        RuntimeFault: the ``tensorrt`` package is missing, is only type stubs, does not load, or
            is not TensorRT 10.x.
    """
    try:
        import tensorrt as trt_mod
    except ImportError as err:
        raise RuntimeFault(f"TensorRT Python package not found: {TRT_INSTALL_HINT} ({err})") from None
    except Exception as err:  # e.g. OSError: libnvinfer.so.10 missing
        raise RuntimeFault(f"TensorRT Python package failed to load ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}): {TRT_INSTALL_HINT}") from None
    version = getattr(trt_mod, "__version__", None)
    if version is None or not hasattr(trt_mod, "Builder"):
        # `pip install tensorrt-stubs` without TensorRT leaves an importable, empty `tensorrt`.
        raise RuntimeFault(f"TensorRT Python package not found ('tensorrt' is only type stubs): "
                        f"{TRT_INSTALL_HINT}")
    major = str(version).split(".", 1)[0]
    if major != str(REQUIRED_TRT_MAJOR):
        raise RuntimeFault(f"TensorRT {version} found, but edgeprune needs TensorRT "
                        f"{REQUIRED_TRT_MAJOR}.x: {TRT_INSTALL_HINT}")
    return str(version)


def require_gpu(device_index: int = 0) -> Any:
    """The local :class:`~devices.gpu.GpuInfo`.

    Raises:
        RuntimeFault: no CUDA GPU is visible.
    """
    gpu = local_gpu(device_index)
    if gpu is None:
        raise RuntimeFault("no CUDA GPU visible: TensorRT needs an NVIDIA GPU and driver "
                           "(nvidia-smi finds none, or CUDA_VISIBLE_DEVICES hides it)")
    return gpu


# --------------------------------------------------------------------------------------------
# TensorRT side


def apply_settings(config: trt.IBuilderConfig, builder: trt.Builder,
                   network: trt.INetworkDefinition, settings: dict[str, Any]) -> None:
    """Configure a builder config from :func:`builder_settings` output.

    Sets the workspace pool limit, FP16 and INT8 (INT8 only for an explicitly quantized, Q/DQ
    model: TensorRT's explicit quantization; see :mod:`exporters.tensorrt_settings`), the
    builder optimization level, detailed profiling verbosity (layer names in the engine
    inspector) and, for a dynamic batch, one optimization profile.

    Raises:
        UserError: the network's input does not match ``settings``.
    """
    import tensorrt as trt

    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(settings["workspace_bytes"]))
    if settings["fp16"]:
        config.set_flag(trt.BuilderFlag.FP16)
    if settings.get("int8"):
        config.set_flag(trt.BuilderFlag.INT8)
    config.builder_optimization_level = int(settings["builder_optimization_level"])
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED

    if network.num_inputs != 1:
        raise UserError(f"the parsed network has {network.num_inputs} inputs; expected one image batch")
    tensor = network.get_input(0)
    net_shape = list(dims_tuple(tensor.shape))
    want = settings["shapes"]["opt"]
    if len(net_shape) != len(want) or any(d >= 0 and d != w for d, w in zip(net_shape, want)):
        raise UserError(f"network input {tensor.name!r} has shape {net_shape}, which does not fit "
                        f"the build shapes {settings['shapes']}")
    if any(d < 0 for d in net_shape):
        opt_profile = builder.create_optimization_profile()
        opt_profile.set_shape(tensor.name, trt.Dims(settings["shapes"]["min"]),
                              trt.Dims(settings["shapes"]["opt"]), trt.Dims(settings["shapes"]["max"]))
        config.add_optimization_profile(opt_profile)


def dims_tuple(dims: trt.Dims) -> tuple[int, ...]:
    """A TensorRT ``Dims`` as a tuple of ints (-1 for dynamic dimensions)."""
    return tuple(int(dims[i]) for i in range(len(dims)))


def make_logger() -> tuple[trt.ILogger, list[str]]:
    """A TensorRT logger that prints warnings and errors and keeps the errors."""
    import tensorrt as trt

    errors: list[str] = []

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                errors.append(msg)
                print(f"[TensorRT] ERROR: {msg}", file=sys.stderr)
            elif severity == trt.ILogger.Severity.WARNING:
                print(f"[TensorRT] warning: {msg}", file=sys.stderr)

    return _Logger(), errors


def sidecar_path(engine_path: str | os.PathLike[str]) -> Path:
    """``model.engine`` -> ``model.engine.json``."""
    p = Path(engine_path)
    return p.with_name(p.name + SIDECAR_SUFFIX)


def read_sidecar(engine_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The engine's JSON sidecar, or None if it has none, is unreadable, or is stale (its
    ``engine_bytes`` differs from the engine file's size)."""
    try:
        data = json.loads(sidecar_path(engine_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    size = data.get("engine_bytes")
    try:
        if size is not None and Path(engine_path).stat().st_size != int(size):
            print(f"warning: ignoring stale {sidecar_path(engine_path).name} (engine size differs)",
                  file=sys.stderr)
            return None
    except (OSError, ValueError, TypeError):
        return None
    return data


def _load_timing_cache(config: trt.IBuilderConfig, cache_path: Path) -> tuple[trt.ITimingCache, str]:
    """Create the config's timing cache from ``cache_path`` (or empty) and attach it."""
    data = b""
    state = "new"
    if cache_path.is_file():
        try:
            data = cache_path.read_bytes()
            state = "reused"
        except OSError as err:
            print(f"warning: cannot read timing cache {cache_path}: {err}; starting a new one", file=sys.stderr)
    cache = config.create_timing_cache(data)
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        # Written by another GPU or TensorRT version: start over rather than mix timings.
        print(f"warning: timing cache {cache_path} does not match this GPU/TensorRT; starting a new one",
              file=sys.stderr)
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
        state = "replaced"
    return cache, state


def build_engine(onnx_path: str | os.PathLike[str], profile: DeviceProfile | str | os.PathLike[str],
                 out_path: str | os.PathLike[str], *, force_device: bool = False,
                 timing_cache: str | os.PathLike[str] | None = None,
                 precision: str | None = None) -> Path:
    """Build a TensorRT engine for ``profile`` from ``onnx_path`` and write it to ``out_path``.

    Also writes ``<out_path>.json`` (see :func:`read_sidecar`) and updates the timing cache.

    Args:
        onnx_path: the ONNX model (one input, dynamic or fixed batch).
        profile: a :class:`~devices.profile.DeviceProfile`, a shipped profile's name or a path.
        out_path: engine file to write (replaced atomically).
        force_device: build even if the local GPU's compute capability differs from the profile's.
        timing_cache: timing-cache file to use instead of the profile's.
        precision: ``fp16``/``fp32``/``int8`` instead of the profile's (int8 needs Q/DQ nodes).

    Returns:
        ``Path(out_path)``.

    Raises:
        UserError: missing ONNX file, non-TensorRT profile, compute capability mismatch
            (without ``force_device``), int8 without Q/DQ nodes, ONNX parser errors, build failure.
        RuntimeFault: TensorRT or a GPU missing.
    """
    prof = load_profile(profile)
    onnx_file = Path(onnx_path)
    out = Path(out_path)
    input_name, input_shape = onnx_input(onnx_file)
    settings = builder_settings(prof, input_shape, input_name=input_name, timing_cache=timing_cache,
                                precision=precision, model_precision=onnx_precision(onnx_file))
    forecast = fusion_forecast(attention_shapes(onnx_file), settings["precision"], prof)
    if forecast:  # before TensorRT is even asked for: the profile's kernel rule (issue 40 item 6)
        print(f"warning: {forecast}", file=sys.stderr)
    trt_version = tensorrt_version()
    gpu = require_gpu()
    check = check_compute_capability(prof, gpu, force=force_device)
    if check.message:
        print(check.message, file=sys.stderr)
    for note in settings["notes"]:
        print(f"note: {note}", file=sys.stderr)

    import tensorrt as trt

    t0 = time.perf_counter()
    logger, errors = make_logger()
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)  # holds the weights the network points to: kept until built
    _parse_onnx(parser, onnx_file, trt_version)

    config = builder.create_builder_config()
    apply_settings(config, builder, network, settings)
    cache_path = Path(settings["timing_cache"])
    _cache, cache_state = _load_timing_cache(config, cache_path)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        detail = errors[-1] if errors else "see the TensorRT messages above"
        raise UserError(f"TensorRT engine build failed for {onnx_file.name} on {prof.name}: {detail}")
    build_s = time.perf_counter() - t0

    _write_engine(out, serialized, config, cache_path)
    sidecar = {
        "format": "edgeprune-trt-engine/1",
        "engine": out.name,
        "engine_bytes": out.stat().st_size,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tensorrt_version": trt_version,
        "gpu": gpu.to_dict(),
        "force_device": force_device and not check.matches,
        "profile": prof.to_dict(),
        "onnx": {"path": str(onnx_file.resolve()), "sha256": file_sha256(onnx_file),
                 "input_name": input_name, "input_shape": list(input_shape)},
        "settings": settings,
        "attention_forecast": forecast,
        "timing_cache_state": cache_state,
        "build_time_s": round(build_s, 3),
    }
    atomic_write_bytes(sidecar_path(out), (json.dumps(sidecar, indent=2) + "\n").encode())
    return out


def _parse_onnx(parser: trt.OnnxParser, onnx_file: Path, trt_version: str) -> None:
    """Parse ``onnx_file`` into the parser's network.

    Raises:
        UserError: the parser's first three errors, on one line.
    """
    if not parser.parse_from_file(str(onnx_file.resolve())):
        msgs = [str(parser.get_error(i)).strip().replace("\n", " ") for i in range(parser.num_errors)]
        shown = "; ".join(msgs[:3]) + (f"; ... ({len(msgs) - 3} more)" if len(msgs) > 3 else "")
        raise UserError(f"TensorRT {trt_version} cannot parse {onnx_file.name}: "
                        f"{shown or 'unknown parser error'}")


def _write_engine(out: Path, serialized: trt.IHostMemory, config: trt.IBuilderConfig, cache_path: Path) -> None:
    """Write the serialized engine to ``out`` (its old sidecar removed first) and the config's
    timing cache, with the builder's new timings, to ``cache_path`` (a failure there: a warning)."""
    # A stale sidecar must never describe the new engine: drop it before replacing the engine.
    sidecar_path(out).unlink(missing_ok=True)
    atomic_write_bytes(out, memoryview(serialized))
    try:
        # The builder added its new timings to the config's cache object.
        atomic_write_bytes(cache_path, memoryview(config.get_timing_cache().serialize()))
    except OSError as err:
        print(f"warning: cannot write timing cache {cache_path}: {err}", file=sys.stderr)
