"""CUDA access for the TensorRT runner: device/pinned buffers, streams, events, CUDA graphs.

Two interchangeable back ends with the same small interface: cuda-python
(``cuda.bindings.runtime``, preferred; supports CUDA graphs) and pycuda (fallback, no graphs).
:func:`cuda_api` picks the first that works; with neither, a one-line
:class:`~edgeprune.errors.RuntimeFault` says what to install. :func:`pinned_array` views pinned
host memory as a numpy array. Byte counts are bytes, times are milliseconds.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np

from edgeprune.errors import RuntimeFault

CUDA_INSTALL_HINT = ("install cuda-python matching the CUDA driver (`pip install 'cuda-python>=12,<13'` "
                     "on CUDA 12 / JetPack 6)")


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


def cuda_api(device_index: int) -> _CudaPython | _PyCuda:
    """The CUDA interface for ``device_index``: cuda-python, else pycuda.

    Raises:
        RuntimeFault: neither is installed, or no CUDA GPU is visible.
    """
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
        raise RuntimeFault(f"cuda-python not found: {CUDA_INSTALL_HINT}")
    raise RuntimeFault("no CUDA GPU visible to this process: " + "; ".join(errors))


def pinned_array(ptr: int, shape: Sequence[int], dtype: np.dtype[Any]) -> np.ndarray:
    """A numpy view (``shape``, ``dtype``) of pinned host memory at address ``ptr``."""
    count = int(np.prod(shape)) if len(shape) else 1
    nbytes = count * dtype.itemsize
    raw = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), shape=(max(nbytes, 1),))
    return raw[:nbytes].view(dtype).reshape(tuple(shape))


CudaApi = _CudaPython | _PyCuda
__all__ = ["CUDA_INSTALL_HINT", "CudaApi", "cuda_api", "pinned_array"]
