"""Time one transformer sub-block (or a whole model) on a backend (issue 30, item 1).

Sub-blocks (built with random weights around copies of the model's own norms, activation and
LayerScales, so they run the same kernels as the model's blocks):

* attention: ``x + ls1(proj(attn(norm1(x))))`` with an :class:`~edgeprune.layers.PrunedAttention`
  of (kept heads, per-head Q/K dim, per-head V dim);
* MLP: ``x + ls2(fc2(act(fc1(norm2(x)))))`` of a kept width.

The input is ``(batch, tokens, D)``. Backends are a registry (:func:`register_timer`,
:func:`get_timer`, :func:`list_timers`): ``torch`` (CPU or CUDA, CUDA graphs where asked,
:class:`runners.torch_runner.TorchRunner`), ``onnxruntime`` (the module exported to a temporary
ONNX file with :func:`exporters.onnx.export_onnx` and timed with
:class:`runners.onnxruntime_runner.OrtRunner`), ``tensorrt`` (one small engine per entry,
:func:`exporters.tensorrt.build_engine` + :class:`runners.tensorrt.runner.TrtRunner`). Each times
``warmup`` untimed runs and then reports the median (p50) of ``iterations`` timed runs, in ms.

Spread check (issue 40, :func:`spread`): the timed runs of an entry are cut into ``repeats``
consecutive groups; when the groups' statistics disagree by more than ``spread`` (relative) the
entry is timed again on the same runner, up to ``retries`` times, and the attempt whose groups agree
best is kept (:meth:`Timer.measure`).

Blocks (issue 56 item 3): with :attr:`TimingSettings.min_block_ms` > 0 each timed run is a block of ``k`` back-to-back
runs (``k`` chosen from the warm-up so a block lasts at least that long, :func:`block_size`), read by one clock read
around the block; its latency is block time / ``k`` (:func:`time_once`).
"""

from __future__ import annotations

import dataclasses
import platform
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

from devices.gpu import local_gpu
from edgeprune.errors import UserError
from edgeprune.registry import Registry
from exporters.onnx import export_onnx
from exporters.ort_session import import_onnxruntime
from exporters.tensorrt import build_engine, tensorrt_version
from runners.base import Runner, summarize_latencies
from runners.clock import CPU, ThreadClock, block_runs, time_block
from runners.onnxruntime_runner import OrtRunner
from runners.tensorrt.runner import TrtRunner
from runners.torch_runner import TorchRunner
from edgeprune.latency.subblocks import (AttnSubBlock, MlpSubBlock, attn_subblock,  # noqa: F401 (handed on)
                                         mlp_subblock)

class _AsImage(nn.Module):
    """Presents a (B, N, D) module as one taking (B, 1, N, D), so that the image exporter
    (:func:`exporters.onnx.export_onnx`, input (C, H, W)) exports it unchanged."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x[:, 0])


# ---------------------------------------------------------------------------------------------
# settings, registry


@dataclasses.dataclass
class TimingSettings:
    """How to time: the profile's backend settings.

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` (torch); ORT runs its CPU provider, TensorRT the GPU.
        threads: intra-op threads (``None``: the backend's default).
        precision: ``fp32``/``fp16``/... as the backend names it.
        warmup, iterations: untimed runs, then timed runs (p50 reported).
        max_seconds: stop the timed runs once they took this long (``None``: no limit), after at
            least ``min_iterations`` of them.
        clock: ``wall`` (the runner's timing) or ``cpu`` (this thread's CPU time, for one thread
            on the CPU: steady on a machine shared with other jobs; :func:`time_once`).
        statistic: what an entry reports of its timed runs: ``p50`` (default) or ``min`` (on a
            machine shared with other work, contention only adds time: the minimum is steadier).
        cuda_graphs: torch on CUDA / TensorRT: replay CUDA graphs.
        profile: the :class:`~devices.DeviceProfile` (TensorRT builds follow it).
        repeats: groups the timed runs are cut into for the spread check (1: no check); at least
            2 runs per group are timed.
        spread: the largest relative disagreement ``(max - min) / median`` of the groups'
            statistics an entry may show before it is timed again.
        retries: at most this many more attempts for an entry whose spread is too large.
        min_block_ms: each timed run is a block of back-to-back runs lasting at least this long (ms; runs per
            block from the warm-up, :func:`block_size`); 0 (default): one run per timed run, as before.
    """

    device: str = "cpu"
    threads: int | None = None
    precision: str = "fp32"
    warmup: int = 5
    iterations: int = 20
    cuda_graphs: bool = False
    profile: Any = None
    max_seconds: float | None = None
    min_iterations: int = 5
    statistic: str = "p50"
    clock: str = "wall"
    repeats: int = 3
    spread: float = 0.05
    retries: int = 2
    min_block_ms: float = 0.0


#: a whole entry (a model, a chain: :data:`edgeprune.latency.schema.WHOLE_KINDS`) is timed this many times
#: ``max_seconds`` (issue 52: at the default 1 s the deit_small models got the 6 rounds of the spread check's
#: minimum on the idle 2-core box, and every one of its 16 whole entries needed all 3 attempts, spreads 4-12%)
WHOLE_SECONDS = 4.0


def for_whole(s: TimingSettings) -> TimingSettings:
    """``s`` for a whole entry: :data:`WHOLE_SECONDS` x its ``max_seconds`` (unchanged without a limit)."""
    return s if s.max_seconds is None else dataclasses.replace(s, max_seconds=s.max_seconds * WHOLE_SECONDS)


@dataclasses.dataclass
class Sample:
    """An entry's ``value`` (ms, or a ratio), its groups' :func:`spread`, attempts and (interleaved) reference ms."""

    value: float
    spread: float
    attempts: int
    reference_ms: float | None = None


def groups(values: Sequence[float], repeats: int) -> list[list[float]]:
    """``values`` cut into ``min(repeats, len(values))`` consecutive, nearly equal groups."""
    n = max(1, min(int(repeats), len(values)))
    return [list(g) for g in np.array_split(np.asarray(values, dtype=np.float64), n)]


def spread(stats: Sequence[float]) -> float:
    """``(max - min) / median`` of per-group statistics (0 for one group or a zero median)."""
    if len(stats) < 2:
        return 0.0
    mid = float(np.median(stats))
    return 0.0 if mid <= 0 else (max(stats) - min(stats)) / mid


def time_once(r: Runner, x: np.ndarray, s: TimingSettings, k: int = 1) -> float:
    """One timed run of ``r`` in ms: the runner's own (wall-clock) timing, or with
    ``s.clock == "cpu"`` the CPU time of this thread around it (``time.thread_time``: a
    single-threaded CPU backend computes on the calling thread, so this is its compute time
    without the time other jobs held the core). With ``k > 1``: a block of ``k`` back-to-back runs read by that
    clock once around the whole block (:func:`runners.clock.time_block`), divided by ``k`` (ms per run)."""
    clocked = ThreadClock(r) if s.clock == CPU else r
    if k == 1:
        return clocked.time_once(x)
    return time_block(clocked, x, k) / k


def block_size(warm_ms: Sequence[float], s: TimingSettings) -> int:
    """Runs per block for ``s.min_block_ms`` from the warm-up runs' latencies ``warm_ms`` (ms, their minimum, as
    :func:`runners.base.choose_block_runs`): :func:`runners.clock.block_runs`; 1 with ``min_block_ms == 0`` or no
    warm-up.

    Raises:
        ValueError: ``s.min_block_ms < 0``.
    """
    warm = [float(v) for v in warm_ms]
    if s.min_block_ms <= 0 or not warm:
        return block_runs(1.0, s.min_block_ms)
    return block_runs(min(warm), s.min_block_ms)


class Timer:
    """One backend's way to time a module. Subclasses (registered with :func:`register_timer`)
    implement :meth:`version` and :meth:`open`; :meth:`time` does the rest."""

    name = "?"

    def unavailable(self, s: TimingSettings) -> str | None:
        """Why this backend cannot time here (``None``: it can): a fault of the environment."""
        return None

    def refuses(self, s: TimingSettings) -> str | None:
        """Why these settings are a usage mistake for this backend anywhere (``None``: they are not),
        e.g. a precision it cannot time; checked before :meth:`unavailable` (issue 41: exit 2, not 1)."""
        return None

    def version(self) -> str:
        """The backend library's version (part of a table's key)."""
        raise NotImplementedError

    def device_name(self, s: TimingSettings) -> str:
        """The CPU model or GPU name timings are taken on (part of a table's key)."""
        return cpu_name()

    def open(self, module: nn.Module, x: np.ndarray, s: TimingSettings, workdir: Path) -> tuple[Runner, np.ndarray]:
        """A :class:`~runners.base.Runner` for ``module`` and the input it takes for ``x``
        (batch first; a (B, N, D) sub-block exported as an image takes (B, 1, N, D))."""
        raise NotImplementedError

    def time(self, module: nn.Module, input_shape: Sequence[int], s: TimingSettings) -> float:
        """ms of ``module`` on a seeded random input of ``input_shape`` (batch first): the
        ``s.statistic`` (p50 or min) of the timed runs (after the spread check, :meth:`measure`)."""
        return self.measure(module, input_shape, s).value

    def measure(self, module: nn.Module, input_shape: Sequence[int], s: TimingSettings) -> Sample:
        """Time ``module`` (as :meth:`time`) with the spread check (module doc): the ``s.statistic`` of
        the timed runs of the attempt whose groups agree best."""
        x = np.random.default_rng(0).standard_normal(tuple(input_shape), dtype=np.float32)
        with tempfile.TemporaryDirectory(prefix="edgeprune-latency-") as tmp:
            r, x = self.open(module, x, s, Path(tmp))
            try:
                r.prepare(x)
                warm = [time_once(r, x, s) for _ in range(max(s.warmup, 1 if s.min_block_ms > 0 else 0))]
                k = block_size(warm, s)
                best: Sample | None = None
                for attempt in range(1, s.retries + 2):
                    lat = timed_runs(lambda: time_once(r, x, s, k), s, runs_per_call=k)
                    sp = spread([summarize_latencies(g)[s.statistic] for g in groups(lat, s.repeats)])
                    if best is None or sp < best.spread:
                        best = Sample(summarize_latencies(lat)[s.statistic], sp, attempt)
                    best.attempts = attempt
                    if sp <= s.spread:
                        break
            finally:
                r.close()
        assert best is not None
        return best


def timed_runs(run: Callable[[], float], s: TimingSettings, runs_per_call: int = 1) -> list[float]:
    """Up to ``s.iterations`` results of ``run()`` (ms), fewer once their time reaches ``s.max_seconds``
    (at least ``s.min_iterations`` and two per spread group, :attr:`TimingSettings.repeats`). A ``run()`` that
    times a block of ``runs_per_call`` runs and returns ms per run counts ``runs_per_call`` times its result."""
    lat: list[float] = []
    least = max(s.min_iterations, 2 * s.repeats if s.repeats > 1 else 1)
    for _ in range(s.iterations):
        lat.append(run())
        if (s.max_seconds is not None and len(lat) >= least
                and sum(lat) * runs_per_call >= 1000.0 * s.max_seconds):
            break
    return lat


#: timing backend name -> its Timer (registering a name again replaces it)
TIMERS: Registry[Timer] = Registry("latency backend")


def register_timer(name: str) -> Callable[[type[Timer]], type[Timer]]:
    """Class decorator: register a :class:`Timer` under ``name`` (replacing one of that name)."""
    def deco(cls: type[Timer]) -> type[Timer]:
        cls.name = name
        TIMERS.register(name, cls(), replace=True)
        return cls
    return deco


def unregister_timer(name: str) -> None:
    """Remove a registered timing backend (tests); an unknown name is ignored."""
    TIMERS.unregister(name, missing_ok=True)


def list_timers() -> list[str]:
    """Names of the registered timing backends, sorted."""
    return sorted(TIMERS)


def get_timer(name: str) -> Timer:
    """The timing backend ``name``.

    Raises:
        UserError: unknown name; one line listing the known ones.
    """
    return TIMERS.get(name)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()`` / machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def export_for_timing(module: nn.Module, x: np.ndarray, path: Path) -> tuple[Path, np.ndarray]:
    """Export ``module`` (image (B, C, H, W) input, or a (B, N, D) sub-block) to ``path`` with the
    project's exporter (dynamic batch, the graph clean-up of ``edgeprune export``).

    Returns:
        ``(path, input)``: ``x``, reshaped to (B, 1, N, D) for a sub-block.
    """
    if x.ndim == 3:
        module, x = _AsImage(module), x[:, None]
    export_onnx(module.cpu().float(), path, x.shape[1:], batch_size=int(x.shape[0]))
    return path, x


@register_timer("torch")
class TorchTimer(Timer):
    """Eager PyTorch on the CPU or CUDA (:class:`~runners.torch_runner.TorchRunner`; CUDA graphs
    when the settings ask for them)."""

    def refuses(self, s: TimingSettings) -> str | None:
        if not s.device.startswith("cuda") and s.precision != "fp32":
            return (f"--precision {s.precision} with --backend torch needs a GPU profile (torch times fp32 on the "
                    "CPU): use --precision fp32, or a GPU profile")
        return None

    def unavailable(self, s: TimingSettings) -> str | None:
        if s.device.startswith("cuda") and not torch.cuda.is_available():
            return f"no CUDA GPU is visible to torch {torch.__version__}"
        return None

    def version(self) -> str:
        return torch.__version__

    def device_name(self, s: TimingSettings) -> str:
        if s.device.startswith("cuda"):
            return torch.cuda.get_device_name(torch.device(s.device))
        return cpu_name()

    def open(self, module: nn.Module, x: np.ndarray, s: TimingSettings, workdir: Path) -> tuple[Runner, np.ndarray]:
        return TorchRunner(module, device=s.device, threads=s.threads, precision=s.precision,
                           cuda_graphs=s.cuda_graphs, label="latency-entry"), x


@register_timer("onnxruntime")
class OrtTimer(Timer):
    """ONNX Runtime's CPU provider on the module exported to a temporary ONNX file
    (:class:`~runners.onnxruntime_runner.OrtRunner`); fp32 only (fp16 / int8 ONNX files are
    made by ``edgeprune quantize``, which a table cannot run per entry)."""

    def unavailable(self, s: TimingSettings) -> str | None:
        try:
            import_onnxruntime()
        except UserError as err:
            return str(err)
        return None

    def refuses(self, s: TimingSettings) -> str | None:
        if s.precision != "fp32":
            return (f"latency tables on onnxruntime time fp32 only, got --precision {s.precision} "
                    "(use --precision fp32, or a TensorRT profile for fp16 / int8)")
        return None

    def version(self) -> str:
        return str(import_onnxruntime().__version__)

    def open(self, module: nn.Module, x: np.ndarray, s: TimingSettings, workdir: Path) -> tuple[Runner, np.ndarray]:
        path, x = export_for_timing(module, x, workdir / "entry.onnx")
        return OrtRunner(path, providers="cpu", threads=s.threads, label="latency-entry"), x


@register_timer("tensorrt")
class TensorRTTimer(Timer):
    """TensorRT: one small engine per entry, built for the profile (:func:`exporters.tensorrt.
    build_engine`, the profile's precision and timing cache) and timed with
    :class:`~runners.tensorrt.runner.TrtRunner` (CUDA graphs where the profile says so)."""

    def unavailable(self, s: TimingSettings) -> str | None:
        try:
            tensorrt_version()
        except UserError as err:
            return str(err)
        if local_gpu() is None:
            return "no NVIDIA GPU found"
        return None

    def version(self) -> str:
        return tensorrt_version()

    def device_name(self, s: TimingSettings) -> str:
        gpu = local_gpu()
        return gpu.name if gpu is not None else "?"

    def open(self, module: nn.Module, x: np.ndarray, s: TimingSettings, workdir: Path) -> tuple[Runner, np.ndarray]:
        path, x = export_for_timing(module, x, workdir / "entry.onnx")
        engine = build_engine(path, s.profile, workdir / "entry.engine", precision=s.precision)
        return TrtRunner(engine, cuda_graphs=s.cuda_graphs, model="latency-entry"), x
