"""ONNX Runtime runner: CPU, and the CUDA / TensorRT execution providers when installed.

Providers are named ``cpu``, ``cuda``, ``tensorrt`` (or by their full ORT names). A provider
the installed onnxruntime does not list (``onnxruntime.get_available_providers()``), or one that
fails to initialise (ORT then silently falls back to CPU), is a :class:`UserError`.

Timing: ``time.perf_counter`` around one ``InferenceSession.run`` on CPU (ORT reads the numpy
input in place). On CUDA / TensorRT the input is copied to the GPU once (I/O binding, outside the
timed region), outputs stay on the GPU, and the timed region is ``run_with_iobinding`` followed by
``synchronize_outputs``, so it covers the GPU work and no host transfers. ORT exposes no CUDA
events; this is wall time with a device sync.

Peak memory: on CPU the process peak RSS (``VmHWM``, reset per batch size). On GPU, the memory
NVML attributes to this process after the run when ``pynvml`` is installed, else ``None``.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edgeprune.errors import UserError
from exporters.ort_session import (  # noqa: F401  (load_session, resolve_providers re-exported)
    GPU_PROVIDERS, PROVIDER_ALIASES, import_onnxruntime, load_session, resolve_providers,
)
from runners.base import Runner, peak_rss_mb
from runners.registry import Backend, RunnerOptions, register_backend


def _nvml_process_memory_mb() -> float | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        pid = os.getpid()
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if proc.pid == pid and proc.usedGpuMemory:
                    total += proc.usedGpuMemory
        return total / 2**20 if total else None
    except Exception:
        return None


class OrtRunner(Runner):
    """Runs an ONNX file with ONNX Runtime.

    Args:
        path: the ``.onnx`` file.
        providers: ``"cpu"`` (default), ``"cuda"``, ``"tensorrt"`` (full ORT names also accepted);
            a list gives the priority order. CPU is always appended as fallback for unsupported
            nodes.
        threads: intra-op threads (``None``: ORT's default).
        label: model name in reports (default: the file name).
        trt_fp16: TensorRT EP only: allow FP16 kernels.
        trt_cache_dir: TensorRT EP only: engine cache directory (saves rebuilds across runs).

    Raises:
        UserError: see :func:`load_session`.
    """

    backend = "onnxruntime"

    def __init__(self, path: str | os.PathLike, *, providers: Sequence[str] | str | None = ("cpu",),
                 threads: int | None = None, label: str | None = None, trt_fp16: bool = False,
                 trt_cache_dir: str | os.PathLike | None = None) -> None:
        self.path = Path(path)
        self.label = label or self.path.name
        self.threads = threads
        names = resolve_providers(providers)
        options: list[dict] = []
        for n in names:
            if n == "TensorrtExecutionProvider":
                o: dict[str, Any] = {"trt_fp16_enable": bool(trt_fp16)}
                if trt_cache_dir is not None:
                    o.update(trt_engine_cache_enable=True, trt_engine_cache_path=str(trt_cache_dir))
                options.append(o)
            else:
                options.append({})
        self.trt_fp16 = trt_fp16
        self.session = load_session(self.path, names, threads, provider_options=options)
        self.providers = self.session.get_providers()
        self.on_gpu = self.providers[0] in GPU_PROVIDERS
        self.device = "cuda:0" if self.on_gpu else "cpu"
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.output_names = [o.name for o in self.session.get_outputs()]
        dims = list(inp.shape)
        self.fixed_batch = dims[0] if dims and isinstance(dims[0], int) and dims[0] > 0 else None
        static = [d for d in dims[1:] if isinstance(d, int) and d > 0]
        self.input_shape = tuple(dims[1:]) if len(static) == len(dims) - 1 else None
        if inp.type != "tensor(float)":
            raise UserError(f"{self.path}: input {inp.name!r} is {inp.type}; edgeprune runs float32 models")
        self._binding = None
        self._bound_key: tuple | None = None

    # -- helpers ---------------------------------------------------------------------------
    def _check(self, x: np.ndarray) -> None:
        if self.input_shape is not None and tuple(x.shape[1:]) != tuple(self.input_shape):
            raise UserError(f"{self.label}: takes {self.input_shape} images, got {tuple(x.shape[1:])}")
        if self.fixed_batch is not None and x.shape[0] != self.fixed_batch:
            raise UserError(f"{self.label}: exported with a fixed batch of {self.fixed_batch}; "
                            f"batch size {x.shape[0]} needs a dynamic-batch export")

    def _bind(self, x: np.ndarray):
        ort = import_onnxruntime()
        key = (id(x), x.shape, x.__array_interface__["data"][0])
        if self._binding is None or self._bound_key != key:
            binding = self.session.io_binding()
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x, dtype=np.float32),
                                                     "cuda", 0)
            binding.bind_ortvalue_input(self.input_name, value)
            for name in self.output_names:
                binding.bind_output(name, "cuda", 0)
            self._binding, self._bound_key, self._bound_value = binding, key, value
        return self._binding

    # -- Runner API ------------------------------------------------------------------------
    def prepare(self, x: np.ndarray) -> None:
        self._check(x)
        if self.on_gpu:
            self._bind(x)

    def infer(self, x: np.ndarray) -> np.ndarray:
        self._check(x)
        x = np.ascontiguousarray(x, dtype=np.float32)
        return self.session.run(self.output_names[:1], {self.input_name: x})[0]

    def time_once(self, x: np.ndarray) -> float:
        if self.on_gpu:
            binding = self._bind(x)
            t0 = time.perf_counter()
            self.session.run_with_iobinding(binding)
            binding.synchronize_outputs()
            return (time.perf_counter() - t0) * 1000.0
        feed = {self.input_name: x}
        t0 = time.perf_counter()
        self.session.run(self.output_names, feed)
        return (time.perf_counter() - t0) * 1000.0

    def reset_peak_memory(self) -> None:
        if self.on_gpu:
            self._peak_reset = False
        else:
            super().reset_peak_memory()

    def memory_scope(self) -> str:
        if self.on_gpu:
            return "GPU memory held by this process after the run (NVML), not a peak"
        return super().memory_scope()

    def peak_memory_mb(self) -> float | None:
        if self.on_gpu:
            return _nvml_process_memory_mb()
        return peak_rss_mb()

    def settings(self) -> dict[str, Any]:
        so = self.session.get_session_options()
        s: dict[str, Any] = {
            "providers": list(self.providers),
            "intra_op_threads": so.intra_op_num_threads or "ort default (physical cores)",
            "threads_requested": self.threads,
            "inter_op_threads": so.inter_op_num_threads,
            "graph_optimization": str(so.graph_optimization_level).split(".")[-1],
            "execution_mode": str(so.execution_mode).split(".")[-1],
            "timing": "perf_counter around run_with_iobinding + sync" if self.on_gpu else "perf_counter",
            "cpu_count": os.cpu_count(),
        }
        if "TensorrtExecutionProvider" in self.providers:
            s["trt_fp16"] = self.trt_fp16
        return s

    def versions(self) -> dict[str, str]:
        ort = import_onnxruntime()
        v = {"onnxruntime": ort.__version__, "numpy": np.__version__,
             "python": platform.python_version()}
        try:
            import onnx

            v["onnx"] = onnx.__version__
        except ImportError:
            pass
        return v

    def close(self) -> None:
        self._binding = None
        self._bound_value = None
        self.session = None  # type: ignore[assignment]


@register_backend("onnxruntime")
class OrtBackend(Backend):
    """ONNX files on ONNX Runtime (CPU, or the CUDA / TensorRT providers); bench: the defaults
    (an ``int8`` request needs a Q/DQ file; no CUDA graphs)."""

    runner = "runners.onnxruntime_runner:OrtRunner"
    kinds = ("onnx",)
    requires = ("onnxruntime",)

    def create(self, target: str, path: Path, kind: str, opts: RunnerOptions) -> Runner:
        if not path.exists():
            raise UserError(f"ONNX file not found: {target}")
        return OrtRunner(path, providers=opts.provider, threads=opts.threads, label=path.name)

