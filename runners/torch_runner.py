"""PyTorch runner: eager inference of an ``nn.Module`` on CPU or CUDA.

Timing: on CPU, ``time.perf_counter`` around one forward pass; on CUDA, a pair of CUDA events
around it (``end.synchronize()`` then ``start.elapsed_time(end)``), so that the measurement
covers the GPU work and not just the kernel launches. The input is converted (and uploaded) once
per input array in :meth:`TorchRunner.prepare`, outside the timed region.

Peak memory: on CPU the process peak RSS (``VmHWM``, reset per batch size where the kernel
allows); on CUDA ``torch.cuda.max_memory_allocated`` (reset per batch size).

Precision (CUDA only; the CPU runs fp32): ``fp32`` (TF32 off: ``float32_matmul_precision
"highest"``), ``tf32`` (``"high"``: TF32 tensor-core matmuls), ``fp16`` / ``bf16`` (weights and
input cast, logits returned as float32). CUDA graphs (CUDA only): each batch size's forward is
captured once on a side stream (after 3 eager warm-up passes) and replayed, as in PyTorch's
"CUDA Graphs" notes (``torch.cuda.graph``).
"""

from __future__ import annotations

import contextlib
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn

from edgeprune.errors import RuntimeFault, UserError
from edgeprune.loading import load_run_or_model
from edgeprune.zoo.registry import MissingWeightsError
from runners.attention_kernels import attention_kernels, describe
from runners.base import Runner, peak_rss_mb
from runners.registry import Backend, RunnerOptions, make_runner, register_backend

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TorchRunner(Runner):
    """Runs ``model`` with PyTorch.

    Args:
        model: the module (moved to ``device``, put in eval mode).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        threads: intra-op threads (``torch.set_num_threads``; process-wide, re-applied before
            each timed call if another runner changed it); ``None`` keeps torch's setting.
        label: model name in reports.
        input_shape: (C, H, W) of one image (for :meth:`benchmark` without inputs).
        precision: ``fp32`` (default), ``tf32``, ``fp16``, ``bf16``; other than fp32 needs CUDA.
        cuda_graphs: replay a captured CUDA graph per batch size (needs CUDA).

    Raises:
        UserError: unsupported device or precision, bad threads.
        RuntimeFault: CUDA (device, precision other than fp32, or CUDA graphs) but no usable GPU.
    """

    backend = "torch"

    def __init__(self, model: nn.Module, *, device: str = "cpu", threads: int | None = None,
                 label: str = "torch-model", input_shape: Sequence[int] | None = None,
                 precision: str = "fp32", cuda_graphs: bool = False) -> None:
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise UserError(f"unsupported torch device {device!r} (cpu or cuda)") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeFault("CUDA was requested but this torch build has no usable GPU "
                               f"(torch {torch.__version__}); use --device cpu")
        if dev.type not in ("cpu", "cuda"):
            raise UserError(f"unsupported torch device {device!r} (cpu or cuda)")
        if precision not in PRECISIONS:
            raise UserError(f"unknown torch precision {precision!r} (one of {', '.join(PRECISIONS)})")
        if dev.type != "cuda" and (precision != "fp32" or cuda_graphs):
            what = f"precision {precision} needs" if precision != "fp32" else "CUDA graphs need"
            raise RuntimeFault(f"{what} a CUDA GPU and the torch runner is on {dev.type} "
                               "(use --precision fp32 without --cuda-graphs, or a GPU profile)")
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.want_graphs = bool(cuda_graphs)
        self._graphs: dict[tuple[int, ...], tuple[Any, torch.Tensor, torch.Tensor]] = {}
        if threads is not None and threads < 1:
            raise UserError(f"threads must be >= 1, got {threads}")
        self.torch_device = dev
        self.device = str(dev)
        self.threads = threads
        self.label = label
        self.input_shape = tuple(int(s) for s in input_shape) if input_shape is not None else None
        self.model = model.to(device=dev, dtype=self.dtype).eval()
        self._x_key: tuple | None = None
        #: SDPA backend -> calls per forward pass, measured at the first :meth:`prepare`
        self.attention: dict[str, int] | None = None
        self._x: torch.Tensor | None = None
        self._apply_threads()

    # -- helpers ---------------------------------------------------------------------------
    def _apply_threads(self) -> None:
        """Re-apply process-wide settings another runner may have changed (threads, TF32)."""
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self.torch_device.type == "cuda":
            # matmuls and cuDNN convolutions (the patch embedding) alike; the same (legacy) flags as
            # the statistics pass and heal use (mixing them with set_float32_matmul_precision makes
            # torch.get_float32_matmul_precision raise)
            tf32 = self.precision == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32

    def _on_device(self) -> Any:
        """``torch.cuda.device(dev)`` for a CUDA runner (so that events, streams and graph capture
        use ``cuda:N``'s streams, not the current device's), a null context otherwise."""
        if self.torch_device.type == "cuda":
            return torch.cuda.device(self.torch_device)
        return contextlib.nullcontext()

    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        key = (id(x), x.shape, x.__array_interface__["data"][0])
        if self._x_key != key or self._x is None:
            t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
            self._x = t.to(device=self.torch_device, dtype=self.dtype)
            self._x_key = key
        return self._x

    def _graph(self, t: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The captured graph for ``t``'s shape: (graph, static input, static output)."""
        key = tuple(t.shape)
        if key not in self._graphs:
            static_in = t  # the prepared input is the graph's input: replays need no copy
            side = torch.cuda.Stream(self.torch_device)
            side.wait_stream(torch.cuda.current_stream(self.torch_device))
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(3):  # warm-up on a side stream before capture
                    self.model(static_in)
            torch.cuda.current_stream(self.torch_device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.inference_mode():
                static_out = self.model(static_in)
            self._graphs[key] = (graph, static_in, static_out)
        graph, static_in, static_out = self._graphs[key]
        if static_in.data_ptr() != t.data_ptr():
            # the graph's input may be an inference tensor (prepared inside infer()'s inference_mode)
            # and prepare() writes it outside that mode: an in-place update of an inference tensor is
            # only allowed inside inference_mode (issue 29, item 1)
            with torch.inference_mode():
                static_in.copy_(t)
        return graph, static_in, static_out

    def _forward(self, t: torch.Tensor) -> torch.Tensor:
        if self.want_graphs:
            graph, _inp, out = self._graph(t)
            graph.replay()
            return out
        return self.model(t)

    def _sync(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    # -- Runner API ------------------------------------------------------------------------
    def prepare(self, x: np.ndarray) -> None:
        self._apply_threads()  # a graph captures the TF32 setting in force: this runner's
        with self._on_device():
            t = self._tensor(x)
            if self.attention is None:  # which SDPA kernel the model runs (one eager pass, first batch size)
                self.attention = attention_kernels(self.model, t)
            if self.want_graphs:
                self._graph(t)
        self._sync()

    def infer(self, x: np.ndarray) -> np.ndarray:
        self._apply_threads()
        with self._on_device(), torch.inference_mode():
            out = self._forward(self._tensor(x))
        self._sync()
        return out.detach().float().cpu().numpy()

    def time_once(self, x: np.ndarray) -> float:
        self._apply_threads()
        t = self._tensor(x)
        with self._on_device(), torch.inference_mode():
            if self.torch_device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                self._forward(t)
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
            "mode": f"eager, inference_mode, {self.precision}",
            "precision": self.precision,
            "cuda_graphs": self.want_graphs,
            "timing": "cuda events" if self.torch_device.type == "cuda" else "perf_counter",
        }
        if self.attention is not None:
            s["attention_kernel"] = describe(self.attention)
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
        self._graphs = {}
        self._x = None
        self._x_key = None


def bench_device(profile: Any) -> str:
    """The torch device a bench runs on for a device profile: CUDA for a GPU (TensorRT) profile,
    else the CPU."""
    return "cuda" if profile.uses_tensorrt else "cpu"


@register_backend("torch")
class TorchBackend(Backend):
    """Run directories and model names in eager PyTorch; bench: on CUDA for a GPU profile (which
    must see a GPU), precisions :data:`PRECISIONS`, CUDA graphs on CUDA."""

    runner = "runners.torch_runner:TorchRunner"
    kinds = ("run", "model")
    requires = ("torch",)
    precisions = PRECISIONS
    cuda_graphs = True

    def create(self, target: str, path: Path, kind: str, opts: RunnerOptions) -> Runner:
        if kind == "run":
            model, _rec, spec = load_run_or_model(path, None)
            label = path.name
        else:
            try:
                model, _rec, spec = load_run_or_model(None, target, None, opts.random_init)
            except MissingWeightsError:  # bench has no --checkpoint: name what it takes
                raise UserError(f"{target}: no weights to benchmark -- pass --random-init (latency only), or a "
                                "run directory or .onnx file") from None
            label = target
        kwargs: dict[str, Any] = {"cuda_graphs": bool(opts.cuda_graphs)}
        if opts.precision is not None:
            kwargs["precision"] = opts.precision
        return TorchRunner(model, device=opts.device, threads=opts.threads, label=label,
                           input_shape=spec.input_size, **kwargs)

    def bench_settings(self, target: str, cfg: Any, profile: Any) -> None:
        if bench_device(profile) == "cuda" and not torch.cuda.is_available():
            raise RuntimeFault(f"profile {profile.name} runs torch on a CUDA GPU, and none is visible "
                               "(run on the device, or use --device cpu)")
        if cfg.precision not in self.precisions:
            raise UserError(f"the torch runner runs {', '.join(self.precisions)}; for {cfg.precision} "
                            f"export to ONNX (`edgeprune quantize`) and bench the .onnx file")

    def bench_open(self, target: str, kind: str, cfg: Any, profile: Any, workdir: Path,
                   info: dict[str, Any]) -> Runner:
        return make_runner(target, self.name, provider=cfg.provider, device=bench_device(profile),
                           threads=cfg.threads, random_init=cfg.random_init, cuda_graphs=cfg.cuda_graphs,
                           precision=cfg.precision)

