"""PyTorch runner: eager inference of an ``nn.Module`` on CPU or CUDA.

Timing: on CPU, ``time.perf_counter`` around one forward pass; on CUDA, a pair of CUDA events
around it (``end.synchronize()`` then ``start.elapsed_time(end)``), so that the measurement
covers the GPU work and not just the kernel launches. The input is converted (and uploaded) once
per input array in :meth:`TorchRunner.prepare`, outside the timed region.

Peak memory: on CPU the process peak RSS (``VmHWM``, reset per batch size where the kernel
allows); on CUDA ``torch.cuda.max_memory_allocated`` (reset per batch size).
"""

from __future__ import annotations

import platform
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn

from edgeprune.errors import UserError
from runners.base import Runner, peak_rss_mb


class TorchRunner(Runner):
    """Runs ``model`` with PyTorch.

    Args:
        model: the module (moved to ``device``, put in eval mode).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        threads: intra-op threads (``torch.set_num_threads``; process-wide, re-applied before
            each timed call if another runner changed it); ``None`` keeps torch's setting.
        label: model name in reports.
        input_shape: (C, H, W) of one image (for :meth:`benchmark` without inputs).

    Raises:
        UserError: CUDA requested but not available.
    """

    backend = "torch"

    def __init__(self, model: nn.Module, *, device: str = "cpu", threads: int | None = None,
                 label: str = "torch-model", input_shape: Sequence[int] | None = None) -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError("CUDA was requested but this torch build has no usable GPU "
                            f"(torch {torch.__version__}); use --device cpu")
        if dev.type not in ("cpu", "cuda"):
            raise UserError(f"unsupported torch device {device!r} (cpu or cuda)")
        if threads is not None and threads < 1:
            raise UserError(f"threads must be >= 1, got {threads}")
        self.torch_device = dev
        self.device = str(dev)
        self.threads = threads
        self.label = label
        self.input_shape = tuple(int(s) for s in input_shape) if input_shape is not None else None
        self.model = model.to(dev).eval()
        self._x_key: tuple | None = None
        self._x: torch.Tensor | None = None
        self._apply_threads()

    # -- helpers ---------------------------------------------------------------------------
    def _apply_threads(self) -> None:
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        key = (id(x), x.shape, x.__array_interface__["data"][0])
        if self._x_key != key or self._x is None:
            self._x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(self.torch_device)
            self._x_key = key
        return self._x

    def _sync(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    # -- Runner API ------------------------------------------------------------------------
    def prepare(self, x: np.ndarray) -> None:
        self._tensor(x)
        self._sync()

    def infer(self, x: np.ndarray) -> np.ndarray:
        self._apply_threads()
        with torch.inference_mode():
            out = self.model(self._tensor(x))
        return out.detach().float().cpu().numpy()

    def time_once(self, x: np.ndarray) -> float:
        self._apply_threads()
        t = self._tensor(x)
        with torch.inference_mode():
            if self.torch_device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                self.model(t)
                end.record()
                end.synchronize()
                return float(start.elapsed_time(end))
            t0 = time.perf_counter()
            self.model(t)
            return (time.perf_counter() - t0) * 1000.0

    def reset_peak_memory(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.torch_device)
            self._peak_reset = True
        else:
            super().reset_peak_memory()

    def memory_scope(self) -> str:
        if self.torch_device.type == "cuda":
            return "torch.cuda.max_memory_allocated since the batch size started"
        return super().memory_scope()

    def peak_memory_mb(self) -> float | None:
        if self.torch_device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.torch_device) / 2**20
        return peak_rss_mb()

    def settings(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "threads": torch.get_num_threads(),
            "threads_requested": self.threads,
            "interop_threads": torch.get_num_interop_threads(),
            "mode": "eager, inference_mode, float32",
            "timing": "cuda events" if self.torch_device.type == "cuda" else "perf_counter",
        }
        if self.torch_device.type == "cuda":
            s["gpu"] = torch.cuda.get_device_name(self.torch_device)
        else:
            s["cpu"] = platform.processor() or platform.machine()
        return s

    def versions(self) -> dict[str, str]:
        v = {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()}
        if torch.version.cuda:
            v["cuda"] = str(torch.version.cuda)
        return v

    def close(self) -> None:
        self._x = None
        self._x_key = None
