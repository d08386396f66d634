"""The runner interface shared by the PyTorch, ONNX Runtime and TensorRT runners.

A runner loads one model on one backend and runs it on a fixed input; :func:`summarize_latencies`
turns per-iteration timings into the numbers every runner reports (:class:`BenchResult`).
Latency is wall time of one synchronous inference of a whole batch, in milliseconds; throughput
is images per second (batch size / mean latency).
"""

from __future__ import annotations

import abc
import dataclasses
import resource
import statistics
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from runners import clock as _clock


@dataclasses.dataclass
class BenchResult:
    """One model, one backend, one batch size.

    Attributes:
        model: label of the model (file name or run directory).
        backend: ``"torch"``, ``"onnxruntime"`` or ``"tensorrt"``.
        device: ``"cpu"``, ``"cuda:0"``, GPU name, ...
        batch_size: images per inference.
        iterations: number of timed inferences (after ``warmup`` untimed ones).
        warmup: untimed inferences run first.
        latency_ms: dict with ``p50``, ``p90``, ``p99``, ``mean``, ``std``, ``min``, ``max`` (ms).
        throughput: images per second, ``batch_size * 1000 / latency_ms["mean"]``.
        peak_memory_mb: peak process RSS (CPU) or device memory (GPU) in MiB; ``None`` if unknown.
        settings: backend settings (threads, providers, precision, CUDA graphs, ...).
        versions: library versions (torch, onnxruntime, tensorrt, ...).
        block_runs: runs per timed block (issue 56 item 3): each timed iteration ran the model this many
            times back to back and its latency is the block's time / ``block_runs``; 1: one run per iteration.
        block_ms: median time of one timed block, ms (``block_runs`` x the per-run latency); ``None`` if unknown.
    """

    model: str
    backend: str
    device: str
    batch_size: int
    iterations: int
    warmup: int
    latency_ms: dict[str, float]
    throughput: float
    peak_memory_mb: float | None = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    block_runs: int = 1
    block_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize_latencies(latencies_ms: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean/std/min/max of per-iteration latencies (ms).

    Raises:
        ValueError: empty input.
    """
    if len(latencies_ms) == 0:
        raise ValueError("no latencies to summarize")
    arr = np.asarray(latencies_ms, dtype=np.float64)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "mean": float(arr.mean()),
        "std": float(statistics.pstdev(arr.tolist())) if len(arr) > 1 else 0.0,
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


# ---------------------------------------------------------------------------------------------
# peak host memory


_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter of this process (``VmHWM``; Linux >= 4.0).

    Returns:
        ``True`` if reset (later :func:`peak_rss_mb` values are peaks since now), ``False`` if
        not possible (they are then peaks over the process lifetime).
    """
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB: ``VmHWM`` from ``/proc/self/status``,
    else ``getrusage`` (lifetime peak)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def make_batch(input_shape: Sequence[int], batch_size: int, inputs: Any = None,
               seed: int = 0) -> np.ndarray:
    """A float32 (B, C, H, W) batch: the first ``batch_size`` of ``inputs`` (cycled if fewer),
    else seeded standard-normal noise of ``input_shape`` (C, H, W)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if inputs is not None:
        arr = inputs.detach().cpu().numpy() if hasattr(inputs, "detach") else np.asarray(inputs)
        if arr.ndim != 4 or arr.shape[0] == 0:
            raise ValueError(f"inputs must be a non-empty (N, C, H, W) batch, got {arr.shape}")
        idx = np.arange(batch_size) % arr.shape[0]
        return np.ascontiguousarray(arr[idx], dtype=np.float32)
    rng = np.random.default_rng(seed)
    shape = (batch_size, *(int(s) for s in input_shape))
    return rng.standard_normal(shape, dtype=np.float32)


def with_blocks(result: BenchResult, k: int) -> BenchResult:
    """``result`` with its block size recorded: ``block_runs = k`` and ``block_ms = k x`` its p50 (ms); returned
    (a runner's own :meth:`Runner.result` override need not know about blocks)."""
    result.block_runs = int(k)
    result.block_ms = float(result.latency_ms["p50"]) * int(k)
    return result


def choose_block_runs(runner: Any, x: np.ndarray, warm_ms: Sequence[float], min_block_ms: float) -> int:
    """Runs per timed block for ``runner`` on ``x``: :func:`runners.clock.block_runs` of the fastest of the
    warm-up runs' latencies ``warm_ms`` (ms, read by the clock that times the blocks; load only adds time, so the
    minimum is the estimate a busy machine disturbs least and a block lasts at least ``min_block_ms`` whenever a
    run is no faster than its fastest warm-up). With ``min_block_ms > 0`` and no warm-up, one untimed run is timed
    to estimate it. 0 ms: 1."""
    if min_block_ms <= 0:
        return _clock.block_runs(1.0, min_block_ms)
    warm = [float(v) for v in warm_ms] or [float(runner.time_once(x))]
    return _clock.block_runs(min(warm), min_block_ms)


class Runner(abc.ABC):
    """One loaded model on one backend.

    Subclasses implement :meth:`infer` (one synchronous inference; inputs and outputs are numpy
    float32 arrays, input shape (B, C, H, W)), :meth:`time_once` (latency of one inference in
    ms, measured the backend's proper way: ``perf_counter`` on CPU, CUDA events on GPU) and
    :meth:`peak_memory_mb`.

    Shared machinery: :meth:`prepare` (once per input, untimed: upload to the device, bind
    buffers), :meth:`reset_peak_memory`, :meth:`result` (a :class:`BenchResult` from measured
    latencies) and :meth:`benchmark` (warm-up, then a latency distribution per batch size).
    ``label`` names the model in reports; ``input_shape`` is (C, H, W) or ``None`` if unknown.
    """

    backend: str = "?"
    device: str = "cpu"
    label: str = "model"
    input_shape: tuple[int, ...] | None = None

    def prepare(self, x: np.ndarray) -> None:
        """Untimed per-input setup (default: nothing)."""

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window (default: reset the process peak RSS)."""
        self._peak_reset = reset_peak_rss()

    def memory_scope(self) -> str:
        """What :meth:`peak_memory_mb` measures, for the report."""
        if getattr(self, "_peak_reset", False):
            return "process peak RSS since the batch size started"
        return "process peak RSS over the process lifetime"

    def result(self, batch_size: int, latencies_ms: Sequence[float], warmup: int) -> BenchResult:
        """A :class:`BenchResult` for ``latencies_ms`` measured at ``batch_size`` (blocks: :func:`with_blocks`)."""
        lat = summarize_latencies(latencies_ms)
        settings = dict(self.settings())
        settings.setdefault("peak_memory_scope", self.memory_scope())
        return BenchResult(
            model=self.label, backend=self.backend, device=self.device,
            batch_size=int(batch_size), iterations=len(latencies_ms), warmup=int(warmup),
            latency_ms=lat, throughput=batch_size * 1000.0 / lat["mean"] if lat["mean"] > 0 else 0.0,
            peak_memory_mb=self.peak_memory_mb(), settings=settings, versions=dict(self.versions()),
        )

    def benchmark(self, batch_sizes: Sequence[int], iterations: int = 50, warmup: int = 10,
                  inputs: Any = None, seed: int = 0, min_block_ms: float = 0.0) -> list[BenchResult]:
        """Per batch size: ``warmup`` untimed inferences, then ``iterations`` timed blocks.

        Args:
            batch_sizes: e.g. ``[1, 8]``.
            inputs: optional (N, C, H, W) real inputs (see :func:`make_batch`); default noise.
            min_block_ms: each timed iteration is a block of ``k`` back-to-back runs, ``k`` chosen from the
                warm-up so that a block lasts at least this long (ms; :func:`runners.clock.block_runs`); its
                latency is the block's time / ``k``. 0: one run per iteration.

        Raises:
            ValueError: ``iterations < 1``, ``warmup < 0``, ``min_block_ms < 0``, or no ``input_shape`` and no
                inputs.
        """
        if iterations < 1 or warmup < 0:
            raise ValueError(f"need iterations >= 1 and warmup >= 0, got {iterations}, {warmup}")
        _clock.block_runs(1.0, min_block_ms)  # validates
        if inputs is None and self.input_shape is None:
            raise ValueError(f"{self.label}: input shape unknown; pass inputs")
        out = []
        for bs in batch_sizes:
            x = make_batch(self.input_shape or (), int(bs), inputs, seed)
            self.prepare(x)
            self.reset_peak_memory()
            warm = [float(self.time_once(x)) for _ in range(warmup)]
            k = choose_block_runs(self, x, warm, min_block_ms)
            lat = [_clock.time_block(self, x, k) / k for _ in range(iterations)]
            out.append(with_blocks(self.result(int(bs), lat, warmup), k))
        return out

    def time_block(self, x: np.ndarray, k: int) -> float:
        """``k`` back-to-back runs as one block, ms: :meth:`time_once` for ``k == 1``, else one wall-clock
        (``perf_counter``) read before the block and one after (on a GPU this includes each run's sync)."""
        if k == 1:
            return float(self.time_once(x))
        t0 = _clock.wall_seconds()
        for _ in range(k):
            self.time_once(x)
        return (_clock.wall_seconds() - t0) * 1000.0

    def close(self) -> None:
        """Release the model (default: nothing)."""

    @abc.abstractmethod
    def infer(self, x: np.ndarray) -> np.ndarray: ...

    @abc.abstractmethod
    def time_once(self, x: np.ndarray) -> float: ...

    def peak_memory_mb(self) -> float | None:
        return None

    def settings(self) -> dict[str, Any]:
        return {}

    def versions(self) -> dict[str, str]:
        return {}
