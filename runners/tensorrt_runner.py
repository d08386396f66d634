"""Run and time a TensorRT engine (TensorRT 10 Python API + cuda-python).

:class:`TrtRunner` deserializes an engine built by :func:`exporters.tensorrt.build_engine`,
allocates device buffers for the engine's largest batch and pinned host buffers with
cuda-python (``cuda.bindings.runtime``; pycuda is a fallback, without CUDA graphs), runs
``execute_async_v3`` and times inferences with CUDA events after warm-up, optionally replaying
a captured CUDA graph.

Timing: one timed inference is host->device copy of the input, the engine, and device->host
copy of the outputs, all on one stream, between two CUDA events (from pinned memory, so the
copies are asynchronous and capturable in a CUDA graph). This matches :class:`runners.base.Runner`'s
"one synchronous inference of a whole batch". ``settings()["timing"]`` says so in each result.

Peak memory: device memory in use (``cudaMemGetInfo``: total - free) sampled before the engine
is loaded and after each run; the peak minus that baseline. On Jetson the GPU shares system
memory, so the figure includes other processes' allocations made meanwhile.

Pure helpers, testable without a GPU: :func:`detect_attention_fusion` (engine-inspector JSON ->
:class:`FusionReport`) and :func:`compare_outputs` (-> :class:`Agreement`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from edgeprune.errors import UserError
from exporters.tensorrt import dims_tuple
from runners.base import BenchResult, Runner, summarize_latencies

if TYPE_CHECKING:
    import tensorrt as trt

CUDA_INSTALL_HINT = ("install cuda-python matching the CUDA driver (`pip install 'cuda-python>=12,<13'` "
                     "on CUDA 12 / JetPack 6)")

# Default tolerances for FP16 engines against FP32 ONNX Runtime: logits of a ViT differ by
# about 1e-3..1e-2 after FP16 accumulation; the relative term covers large logits.
FP16_ATOL = 2e-2
FP16_RTOL = 2e-2


# ============================================================================================
# attention fusion (pure)

# Signs of a fused multi-head-attention kernel in a layer's type, name or tactic: TensorRT's
# fused MHA ("_gemm_mha_v2", "fmha", LayerType "mha"), FlashAttention-style kernels, and the
# BERT QKVToContext plugin. ONNX node names in "Metadata" are not searched (they name the
# source ops, e.g. "scaled_dot_product_attention", whether or not they were fused).
_FUSED_RE = re.compile(
    r"(fmha|fused_?mha|_mha\b|_mha_|\bmha_|mha_v2|flash_?att|qkvtocontext|multiheadattention)",
    re.IGNORECASE,
)
_FUSED_TYPES = {"mha", "fmha", "attention", "multiheadattention"}
_SOFTMAX_RE = re.compile(r"soft_?max", re.IGNORECASE)
_MYELIN_RE = re.compile(r"(\{ForeignNode\[|^__myl_|^__mye|_myl\d+_\d+$)")


@dataclasses.dataclass
class FusionReport:
    """What the engine inspector says about attention.

    Attributes:
        verdict: ``"fused"`` (fused MHA kernels, no separate softmax), ``"partial"`` (both),
            ``"unfused"`` (separate softmax layers, no fused MHA), ``"opaque"`` (attention sits
            in a Myelin region whose inside is not listed: build with detailed profiling
            verbosity), or ``"unknown"`` (no layer information).
        fused_layers: names of layers that look like fused attention.
        softmax_layers: names of stand-alone softmax layers.
        myelin_layers: number of Myelin-generated layers / foreign nodes.
        n_layers: number of layers listed.
        detailed: whether the listing had per-layer details (type, tactic).
    """

    verdict: str
    fused_layers: list[str]
    softmax_layers: list[str]
    myelin_layers: int
    n_layers: int
    detailed: bool

    @property
    def fused(self) -> bool:
        return self.verdict in ("fused", "partial")

    def summary(self) -> str:
        base = {
            "fused": f"attention fused: {len(self.fused_layers)} fused MHA layer(s), no separate softmax",
            "partial": (f"attention partly fused: {len(self.fused_layers)} fused MHA layer(s), "
                        f"{len(self.softmax_layers)} separate softmax layer(s)"),
            "unfused": (f"attention NOT fused: {len(self.softmax_layers)} separate softmax layer(s), "
                        "no fused MHA kernel"),
            "opaque": (f"attention inside {self.myelin_layers} Myelin region(s) not itemised: "
                       "rebuild with profiling verbosity DETAILED to tell"),
            "unknown": "no attention information in the engine's layer listing",
        }[self.verdict]
        return f"{base} ({self.n_layers} layers listed)"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["summary"] = self.summary()
        return d


def _layer_fields(layer: Any) -> tuple[str, str, str]:
    """(name, layer type, tactic name) of one inspector entry (a dict, or a bare name)."""
    if isinstance(layer, str):
        return layer, "", ""
    if isinstance(layer, Mapping):
        return (str(layer.get("Name", "")), str(layer.get("LayerType", "")),
                str(layer.get("TacticName", "") or ""))
    return str(layer), "", ""


def detect_attention_fusion(info: str | Mapping[str, Any]) -> FusionReport:
    """Classify attention fusion from ``EngineInspector.get_engine_information(JSON)`` output.

    Args:
        info: the JSON text or the parsed dict (``{"Layers": [...], "Bindings": [...]}``);
            layers are dicts (detailed verbosity) or names (layer-names-only verbosity).

    Raises:
        ValueError: text that is not JSON, or JSON without a ``Layers`` list.
    """
    data: Any = json.loads(info) if isinstance(info, str) else info
    if not isinstance(data, Mapping) or not isinstance(data.get("Layers"), list):
        raise ValueError("engine information has no 'Layers' list")
    layers: list[Any] = list(data["Layers"])
    fused: list[str] = []
    softmax: list[str] = []
    myelin = 0
    detailed = any(isinstance(layer, Mapping) and "LayerType" in layer for layer in layers)
    for layer in layers:
        name, ltype, tactic = _layer_fields(layer)
        if ltype.lower() == "myelin" or _MYELIN_RE.search(name):
            myelin += 1
        if ltype.lower() in _FUSED_TYPES or _FUSED_RE.search(ltype) or _FUSED_RE.search(tactic) \
                or _FUSED_RE.search(name):
            fused.append(name)
        elif ltype.lower() == "softmax" or _SOFTMAX_RE.search(name) or _SOFTMAX_RE.search(tactic):
            softmax.append(name)
    if fused and softmax:
        verdict = "partial"
    elif fused:
        verdict = "fused"
    elif softmax:
        verdict = "unfused"
    elif myelin and not detailed:
        verdict = "opaque"
    else:
        verdict = "unknown"
    return FusionReport(verdict=verdict, fused_layers=fused, softmax_layers=softmax,
                        myelin_layers=myelin, n_layers=len(layers), detailed=detailed)


# ============================================================================================
# output comparison (pure)


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
    """Compare two outputs of the same shape (the first is the TensorRT one)."""
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


# ============================================================================================
# CUDA access: cuda-python first, pycuda as a fallback


class _CudaPython:
    """The few CUDA runtime calls the runner needs, through ``cuda.bindings.runtime``."""

    name = "cuda-python"
    supports_graphs = True

    def __init__(self, device_index: int) -> None:
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            from cuda import cudart  # cuda-python < 12.6 layout
        self.rt: Any = cudart
        self._ok = cudart.cudaError_t.cudaSuccess
        self.call("cudaSetDevice", device_index)

    def call(self, fn: str, *args: Any) -> Any:
        out = getattr(self.rt, fn)(*args)
        err, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        if err != self._ok:
            _, text = self.rt.cudaGetErrorString(err)
            msg = text.decode() if isinstance(text, bytes) else str(text)
            raise RuntimeError(f"{fn} failed: {err} ({msg})")
        if len(rest) == 0:
            return None
        return rest[0] if len(rest) == 1 else rest

    def version(self) -> str:
        try:
            from cuda import bindings

            return str(getattr(bindings, "__version__", "?"))
        except Exception:
            return "?"

    def malloc(self, nbytes: int) -> int:
        return int(self.call("cudaMalloc", max(nbytes, 1)))

    def free(self, ptr: int) -> None:
        self.call("cudaFree", ptr)

    def malloc_host(self, nbytes: int) -> int:
        return int(self.call("cudaMallocHost", max(nbytes, 1)))

    def free_host(self, ptr: int) -> None:
        self.call("cudaFreeHost", ptr)

    def stream(self) -> Any:
        return self.call("cudaStreamCreate")

    def stream_handle(self, stream: Any) -> int:
        return int(stream)

    def destroy_stream(self, stream: Any) -> None:
        self.call("cudaStreamDestroy", stream)

    def sync(self, stream: Any) -> None:
        self.call("cudaStreamSynchronize", stream)

    def htod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.call("cudaMemcpyAsync", dst, src, nbytes,
                  self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream)

    def dtoh(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.call("cudaMemcpyAsync", dst, src, nbytes,
                  self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream)

    def event(self) -> Any:
        return self.call("cudaEventCreate")

    def record(self, event: Any, stream: Any) -> None:
        self.call("cudaEventRecord", event, stream)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        self.call("cudaEventSynchronize", end)
        return float(self.call("cudaEventElapsedTime", start, end))

    def destroy_event(self, event: Any) -> None:
        self.call("cudaEventDestroy", event)

    def mem_used_mb(self) -> float:
        free, total = self.call("cudaMemGetInfo")
        return (int(total) - int(free)) / 2**20

    def begin_capture(self, stream: Any) -> None:
        self.call("cudaStreamBeginCapture", stream,
                  self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)

    def end_capture(self, stream: Any) -> Any:
        graph = self.call("cudaStreamEndCapture", stream)
        try:
            return graph, self.call("cudaGraphInstantiate", graph, 0)
        except TypeError:  # very old cuda-python: (graph, log buffer, size)
            exec_, *_ = self.call("cudaGraphInstantiate", graph, b"", 0)
            return graph, exec_

    def launch_graph(self, graph_exec: Any, stream: Any) -> None:
        self.call("cudaGraphLaunch", graph_exec, stream)

    def destroy_graph(self, graph: Any, graph_exec: Any) -> None:
        self.call("cudaGraphExecDestroy", graph_exec)
        self.call("cudaGraphDestroy", graph)


class _PyCuda:
    """Fallback through pycuda (no CUDA graphs)."""

    name = "pycuda"
    supports_graphs = False

    def __init__(self, device_index: int) -> None:
        import pycuda.driver as drv

        drv.init()
        self.drv: Any = drv
        self.ctx = drv.Device(device_index).retain_primary_context()
        self.ctx.push()
        self._host: dict[int, Any] = {}
        self._dev: dict[int, Any] = {}

    def version(self) -> str:
        import pycuda

        return str(getattr(pycuda, "VERSION_TEXT", "?"))

    def malloc(self, nbytes: int) -> int:
        buf = self.drv.mem_alloc(max(nbytes, 1))
        self._dev[int(buf)] = buf
        return int(buf)

    def free(self, ptr: int) -> None:
        self._dev.pop(ptr).free()

    def malloc_host(self, nbytes: int) -> int:
        arr = self.drv.pagelocked_empty(max(nbytes, 1), dtype=np.uint8)
        ptr = int(arr.ctypes.data)
        self._host[ptr] = arr
        return ptr

    def free_host(self, ptr: int) -> None:
        self._host.pop(ptr, None)

    def stream(self) -> Any:
        return self.drv.Stream()

    def stream_handle(self, stream: Any) -> int:
        return int(stream.handle)

    def destroy_stream(self, stream: Any) -> None:
        pass

    def sync(self, stream: Any) -> None:
        stream.synchronize()

    def htod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.drv.memcpy_htod_async(dst, self._host_view(src, nbytes), stream)

    def dtoh(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.drv.memcpy_dtoh_async(self._host_view(dst, nbytes), src, stream)

    def _host_view(self, ptr: int, nbytes: int) -> np.ndarray:
        for base, arr in self._host.items():
            if base <= ptr and ptr + nbytes <= base + arr.nbytes:
                return arr[ptr - base: ptr - base + nbytes]
        raise RuntimeError("host pointer not allocated by this runner")

    def event(self) -> Any:
        return self.drv.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.time_till(end))

    def destroy_event(self, event: Any) -> None:
        pass

    def mem_used_mb(self) -> float:
        free, total = self.drv.mem_get_info()
        return (int(total) - int(free)) / 2**20

    def begin_capture(self, stream: Any) -> None:
        raise RuntimeError("CUDA graphs need cuda-python")

    def end_capture(self, stream: Any) -> Any:
        raise RuntimeError("CUDA graphs need cuda-python")

    def launch_graph(self, graph_exec: Any, stream: Any) -> None:
        raise RuntimeError("CUDA graphs need cuda-python")

    def destroy_graph(self, graph: Any, graph_exec: Any) -> None:
        pass


def _cuda_api(device_index: int) -> _CudaPython | _PyCuda:
    """cuda-python, else pycuda; UserError with one line when neither works."""
    errors: list[str] = []
    try:
        return _CudaPython(device_index)
    except ImportError as err:
        errors.append(f"cuda-python not installed ({err})")
    except Exception as err:
        errors.append(f"cuda-python: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    try:
        return _PyCuda(device_index)
    except ImportError:
        pass
    except Exception as err:
        errors.append(f"pycuda: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    if any("not installed" in e for e in errors) and len(errors) == 1:
        raise UserError(f"cuda-python not found: {CUDA_INSTALL_HINT}")
    raise UserError("no CUDA GPU visible to this process: " + "; ".join(errors))


def _pinned_array(ptr: int, shape: Sequence[int], dtype: np.dtype[Any]) -> np.ndarray:
    """A numpy view of pinned host memory at ``ptr``."""
    count = int(np.prod(shape)) if len(shape) else 1
    nbytes = count * dtype.itemsize
    raw = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), shape=(max(nbytes, 1),))
    return raw[:nbytes].view(dtype).reshape(tuple(shape))


# ============================================================================================
# engine loading


def _load_engine(engine_path: str | os.PathLike[str]
                 ) -> tuple[trt.Runtime, trt.ICudaEngine, str, trt.ILogger]:
    """Deserialize an engine; returns (runtime, engine, TensorRT version, logger).

    The caller keeps the runtime and the logger alive as long as the engine (TensorRT holds
    raw pointers to them).
    """
    from exporters.tensorrt import _make_logger, tensorrt_version

    version = tensorrt_version()
    path = Path(engine_path)
    if not path.is_file():
        raise UserError(f"engine file {str(path)!r} not found")

    import tensorrt as trt

    logger, errors = _make_logger()
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        detail = errors[-1] if errors else "unknown error"
        raise UserError(f"TensorRT {version} cannot load {path.name} (engines only load on the GPU "
                        f"model and TensorRT version that built them): {detail}")
    return runtime, engine, version, logger


def check_engine_matches_gpu(sidecar: Mapping[str, Any] | None, gpu: Any, trt_version: str) -> None:
    """UserError when the sidecar says the engine was built for another GPU or TensorRT."""
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


# ============================================================================================
# the runner


@dataclasses.dataclass
class _Tensor:
    name: str
    dtype: np.dtype[Any]
    max_shape: tuple[int, ...]
    device_ptr: int = 0
    host_ptr: int = 0
    nbytes: int = 0


class TrtRunner(Runner):
    """A TensorRT engine on one CUDA device.

    Args:
        engine_path: engine built by :func:`exporters.tensorrt.build_engine` (its JSON sidecar,
            when present, is checked against this GPU and TensorRT version).
        cuda_graphs: replay each batch size's copies + inference as a captured CUDA graph.
        device_index: CUDA device.
        model: label for results (default: the engine's file name).

    Raises:
        UserError: TensorRT, cuda-python or a GPU missing; engine for another GPU/TensorRT;
            engine with other than one input.
    """

    backend = "tensorrt"

    def __init__(self, engine_path: str | os.PathLike[str], *, cuda_graphs: bool = False,
                 device_index: int = 0, model: str | None = None) -> None:
        from exporters.tensorrt import read_sidecar, require_gpu, tensorrt_version

        self.engine_path = Path(engine_path)
        self.label = model or self.engine_path.name
        self._closed = True
        trt_version = tensorrt_version()
        if not self.engine_path.is_file():
            raise UserError(f"engine file {str(self.engine_path)!r} not found")
        self.gpu = require_gpu(device_index)
        self.sidecar = read_sidecar(self.engine_path)
        check_engine_matches_gpu(self.sidecar, self.gpu, trt_version)
        self.cuda = _cuda_api(device_index)
        self.device = self.gpu.name
        self._baseline_mb = self.cuda.mem_used_mb()
        self._peak_mb = self._baseline_mb

        import tensorrt as trt

        self._runtime, self.engine, self.trt_version, self._logger = _load_engine(self.engine_path)
        self.context = self.engine.create_execution_context()
        self.want_graphs = bool(cuda_graphs)
        self.graphs_used = False
        self.graph_note = ""
        self._graph: tuple[Any, Any] | None = None
        self._graph_batch = -1
        self._batch = -1
        self._out_nbytes: dict[str, int] = {}
        self._tensors: dict[str, _Tensor] = {}
        self.stream = self.cuda.stream()
        self._start = self.cuda.event()
        self._end = self.cuda.event()
        self._closed = False

        inputs: list[str] = []
        outputs: list[str] = []
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                inputs.append(name)
            else:
                outputs.append(name)
        if len(inputs) != 1 or not outputs:
            raise UserError(f"{self.engine_path.name}: expected one input and at least one output, "
                            f"found inputs {inputs} and outputs {outputs}")
        self.input_name = inputs[0]
        self.output_names = outputs

        in_shape = dims_tuple(self.engine.get_tensor_shape(self.input_name))
        if any(d < 0 for d in in_shape):
            mn, _opt, mx = self.engine.get_tensor_profile_shape(self.input_name, 0)
            self.min_batch, self.max_batch = int(mn[0]), int(mx[0])
            max_in = dims_tuple(mx)
        else:
            self.min_batch = self.max_batch = int(in_shape[0])
            max_in = in_shape
        self.input_shape_tail = max_in[1:]
        self.input_shape = self.input_shape_tail
        self._staged: np.ndarray | None = None

        # Allocate for the largest batch once; smaller batches use the front of each buffer.
        self.context.set_input_shape(self.input_name, trt.Dims(list(max_in)))
        for name in [self.input_name, *self.output_names]:
            shape = max_in if name == self.input_name else dims_tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise UserError(f"{self.engine_path.name}: output {name!r} has data-dependent shape "
                                f"{list(shape)}, which this runner does not support")
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            t = _Tensor(name=name, dtype=dtype, max_shape=shape)
            t.nbytes = int(np.prod(t.max_shape)) * dtype.itemsize
            t.device_ptr = self.cuda.malloc(t.nbytes)
            t.host_ptr = self.cuda.malloc_host(t.nbytes)
            self.context.set_tensor_address(name, t.device_ptr)
            self._tensors[name] = t
        self._sample_memory()

    # -- bookkeeping ---------------------------------------------------------------------

    @property
    def precision(self) -> str:
        if self.sidecar:
            return str((self.sidecar.get("settings") or {}).get("precision", "?"))
        return "?"

    def _sample_memory(self) -> None:
        try:
            self._peak_mb = max(self._peak_mb, self.cuda.mem_used_mb())
        except Exception:
            pass

    def _set_batch(self, batch: int) -> None:
        import tensorrt as trt

        if not self.min_batch <= batch <= self.max_batch:
            raise UserError(f"batch size {batch} is outside the engine's range "
                            f"{self.min_batch}..{self.max_batch} (rebuild with a wider build.batch)")
        if batch == self._batch:
            return
        if not self.context.set_input_shape(self.input_name,
                                            trt.Dims([batch, *self.input_shape_tail])):
            raise RuntimeError(f"set_input_shape({self.input_name}, batch={batch}) failed")
        self._batch = batch
        self._drop_graph()
        self._out_nbytes = {
            name: int(np.prod(self._out_shape(name))) * self._tensors[name].dtype.itemsize
            for name in self.output_names
        }

    def _out_shape(self, name: str) -> tuple[int, ...]:
        return dims_tuple(self.context.get_tensor_shape(name))

    def _enqueue(self, batch: int) -> None:
        """H2D input, execute, D2H outputs on the stream (no sync)."""
        tin = self._tensors[self.input_name]
        n_in = int(np.prod((batch, *self.input_shape_tail))) * tin.dtype.itemsize
        self.cuda.htod(tin.device_ptr, tin.host_ptr, n_in, self.stream)
        if not self.context.execute_async_v3(self.cuda.stream_handle(self.stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        for name in self.output_names:
            t = self._tensors[name]
            self.cuda.dtoh(t.host_ptr, t.device_ptr, self._out_nbytes[name], self.stream)

    def _stage_input(self, x: np.ndarray) -> int:
        """Copy ``x`` into the pinned input buffer and set the batch size; returns the batch."""
        if x is self._staged:
            return self._batch
        x = np.asarray(x)
        if x.ndim != 1 + len(self.input_shape_tail) or tuple(x.shape[1:]) != self.input_shape_tail:
            raise UserError(f"input shape {list(x.shape)} does not match the engine's "
                            f"(batch, {', '.join(map(str, self.input_shape_tail))})")
        batch = int(x.shape[0])
        self._set_batch(batch)
        tin = self._tensors[self.input_name]
        view = _pinned_array(tin.host_ptr, (batch, *self.input_shape_tail), tin.dtype)
        np.copyto(view, x, casting="same_kind")
        self._staged = None
        return batch

    # -- CUDA graphs -----------------------------------------------------------------------

    def _drop_graph(self) -> None:
        if self._graph is not None:
            try:
                self.cuda.destroy_graph(*self._graph)
            finally:
                self._graph = None
                self._graph_batch = -1

    def _ensure_graph(self, batch: int) -> bool:
        if not self.want_graphs or self.graph_note:
            return False
        if self._graph is not None and self._graph_batch == batch:
            return True
        if not self.cuda.supports_graphs:
            self.graph_note = f"CUDA graphs unavailable with {self.cuda.name}"
            return False
        self._drop_graph()
        # One plain run first: TensorRT finishes shape-dependent setup outside the capture.
        self._enqueue(batch)
        self.cuda.sync(self.stream)
        try:
            self.cuda.begin_capture(self.stream)
            try:
                self._enqueue(batch)
            finally:
                graph = self.cuda.end_capture(self.stream)
            self._graph = graph
            self._graph_batch = batch
            self.graphs_used = True
            return True
        except Exception as err:
            self.graph_note = f"CUDA graph capture failed, timing without graphs: {err}"
            print(f"warning: {self.graph_note}", file=sys.stderr)
            return False

    # -- Runner interface ----------------------------------------------------------------

    def infer_all(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """All outputs by name (copies), for input ``x`` of shape (B, C, H, W)."""
        self._staged = None
        batch = self._stage_input(x)
        self._enqueue(batch)
        self.cuda.sync(self.stream)
        self._sample_memory()
        out: dict[str, np.ndarray] = {}
        for name in self.output_names:
            t = self._tensors[name]
            out[name] = _pinned_array(t.host_ptr, self._out_shape(name), t.dtype).copy()
        return out

    def infer(self, x: np.ndarray) -> np.ndarray:
        """The first output, as float32."""
        return self.infer_all(x)[self.output_names[0]].astype(np.float32, copy=False)

    def prepare(self, x: np.ndarray) -> None:
        """Untimed: stage ``x`` in pinned memory, set the batch, capture the CUDA graph."""
        batch = self._stage_input(x)
        self._staged = x
        self._ensure_graph(batch)

    def time_once(self, x: np.ndarray) -> float:
        """One inference (H2D, engine, D2H) between two CUDA events, in ms."""
        batch = self._stage_input(x)
        use_graph = self._ensure_graph(batch)
        self.cuda.record(self._start, self.stream)
        if use_graph and self._graph is not None:
            self.cuda.launch_graph(self._graph[1], self.stream)
        else:
            self._enqueue(batch)
        self.cuda.record(self._end, self.stream)
        ms = self.cuda.elapsed_ms(self._start, self._end)
        return ms

    def reset_peak_memory(self) -> None:
        self._sample_memory()
        try:
            self._peak_mb = self.cuda.mem_used_mb()
        except Exception:
            pass

    def memory_scope(self) -> str:
        return ("device memory in use (cudaMemGetInfo total - free) above the level before the "
                "engine was loaded, peak sampled since the batch size started"
                + ("; shared with the CPU on this device" if self._shared_memory() else ""))

    def _shared_memory(self) -> bool:
        return bool(((self.sidecar or {}).get("profile") or {}).get("shared_memory", False))

    def result(self, batch_size: int, latencies_ms: Sequence[float], warmup: int) -> BenchResult:
        self._sample_memory()
        return super().result(batch_size, latencies_ms, warmup)

    def peak_memory_mb(self) -> float | None:
        return round(max(0.0, self._peak_mb - self._baseline_mb), 1)

    def settings(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "engine": str(self.engine_path),
            "precision": self.precision,
            "cuda_graphs": self.graphs_used,
            "cuda_graphs_requested": self.want_graphs,
            "timing": "CUDA events around H2D copy + execute_async_v3 + D2H copy (pinned memory)",
            "batch_range": [self.min_batch, self.max_batch],
            "engine_device_memory_mb": round(self._engine_device_memory() / 2**20, 1),
            "cuda_api": self.cuda.name,
        }
        if self.graph_note:
            s["cuda_graphs_note"] = self.graph_note
        if self.sidecar:
            s["profile"] = (self.sidecar.get("profile") or {}).get("name")
        return s

    def _engine_device_memory(self) -> int:
        try:
            return int(self.engine.device_memory_size_v2)  # TensorRT >= 10.1
        except AttributeError:
            return int(self.engine.device_memory_size)

    def versions(self) -> dict[str, str]:
        return {"tensorrt": self.trt_version, self.cuda.name: self.cuda.version()}

    def close(self) -> None:
        """Free device and pinned memory (also on garbage collection)."""
        if self._closed:
            return
        self._closed = True
        steps: list[Any] = [self._drop_graph]
        for t in self._tensors.values():
            steps += [lambda p=t.device_ptr: self.cuda.free(p), lambda p=t.host_ptr: self.cuda.free_host(p)]
        steps += [lambda: self.cuda.destroy_event(self._start), lambda: self.cuda.destroy_event(self._end),
                  lambda: self.cuda.destroy_stream(self.stream)]
        self._tensors = {}
        for step in steps:
            try:
                step()
            except Exception:
                pass

    def __enter__(self) -> TrtRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# ============================================================================================
# checks


def check_against_onnxruntime(engine_path: str | os.PathLike[str], onnx_path: str | os.PathLike[str],
                              inputs: np.ndarray, *, atol: float = FP16_ATOL,
                              rtol: float = FP16_RTOL) -> Agreement:
    """Run the engine and ONNX Runtime (CPU, FP32) on ``inputs`` and compare the first output.

    ``inputs`` (N, C, H, W) float32 is fed in chunks of at most the engine's largest batch.
    Defaults suit an FP16 engine; use e.g. ``atol=rtol=1e-4`` for FP32.
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


def engine_information(engine_path: str | os.PathLike[str]) -> str:
    """The engine inspector's JSON (layers in detail if built with DETAILED verbosity)."""
    import tensorrt as trt

    runtime, engine, _version, logger = _load_engine(engine_path)
    inspector = engine.create_engine_inspector()
    info = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
    del inspector, engine, runtime, logger  # in this order: the engine before what it points to
    return info


def attention_fusion_report(engine_path: str | os.PathLike[str]) -> FusionReport:
    """Whether TensorRT fused attention in this engine (see :func:`detect_attention_fusion`)."""
    return detect_attention_fusion(engine_information(engine_path))
