"""TrtRunner: run and time a TensorRT engine (TensorRT 10 Python API + cuda-python).

:class:`TrtRunner` deserializes an engine built by :func:`exporters.tensorrt.build_engine`,
allocates device buffers for the engine's largest batch and pinned host buffers
(:mod:`runners.tensorrt.cuda`), runs ``execute_async_v3`` and times inferences with CUDA events
after warm-up, optionally replaying a captured CUDA graph.

Timing: one timed inference is host->device copy of the input, the engine, and device->host
copy of the outputs, all on one stream, between two CUDA events (from pinned memory, so the
copies are asynchronous and capturable in a CUDA graph). This matches :class:`runners.base.Runner`'s
"one synchronous inference of a whole batch". ``settings()["timing"]`` says so in each result.

Peak memory: device memory in use (``cudaMemGetInfo``: total - free) sampled before the engine
is loaded and after each run; the peak minus that baseline. On Jetson the GPU shares system
memory, so the figure includes other processes' allocations made meanwhile.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edgeprune.errors import UserError
from exporters.tensorrt import dims_tuple, read_sidecar, require_gpu, tensorrt_version
from runners.base import BenchResult, Runner
from runners.tensorrt.cuda import cuda_api, pinned_array
from runners.tensorrt.engine import check_engine_matches_gpu, load_engine


@dataclasses.dataclass
class _Tensor:
    """One engine I/O tensor: device and pinned host buffers sized for the largest batch."""

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
        RuntimeFault: TensorRT, cuda-python or a GPU missing.
        UserError: missing engine file; engine for another GPU/TensorRT; engine with other
            than one input.
    """

    backend = "tensorrt"

    def __init__(self, engine_path: str | os.PathLike[str], *, cuda_graphs: bool = False,
                 device_index: int = 0, model: str | None = None) -> None:
        self.engine_path = Path(engine_path)
        self.label = model or self.engine_path.name
        self._closed = True
        trt_version = tensorrt_version()
        if not self.engine_path.is_file():
            raise UserError(f"engine file {str(self.engine_path)!r} not found")
        self.gpu = require_gpu(device_index)
        self.sidecar = read_sidecar(self.engine_path)
        check_engine_matches_gpu(self.sidecar, self.gpu, trt_version)
        self.cuda = cuda_api(device_index)
        self.device = self.gpu.name
        self._baseline_mb = self.cuda.mem_used_mb()
        self._peak_mb = self._baseline_mb

        import tensorrt as trt

        self._runtime, self.engine, self.trt_version, self._logger = load_engine(self.engine_path)
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
        view = pinned_array(tin.host_ptr, (batch, *self.input_shape_tail), tin.dtype)
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
            out[name] = pinned_array(t.host_ptr, self._out_shape(name), t.dtype).copy()
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


__all__ = ["TrtRunner"]
