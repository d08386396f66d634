"""Benchmark a TensorRT engine with a device profile's bench settings.

:func:`bench_engine` is the engine-only entry to the one bench path (:mod:`runners.bench`):
the profile's ``[bench]`` settings (or those recorded in the engine's sidecar) fill whatever
the caller leaves ``None``; the result is one :class:`runners.base.BenchResult` per batch size,
timed with CUDA events by :class:`~runners.tensorrt.runner.TrtRunner`.
:func:`~runners.tensorrt.backend.check_batch_range` (re-exported) refuses batch sizes outside the
engine's optimization profile.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from edgeprune.errors import UserError
from runners.bench import resolve_config, run_bench
from runners.tensorrt.backend import check_batch_range  # noqa: F401  (re-exported)


def bench_engine(engine_path: str | os.PathLike[str], device: Any = None,
                 batch_sizes: Sequence[int] | None = None, iterations: int | None = None,
                 warmup: int | None = None, cuda_graphs: bool | None = None,
                 inputs: Any = None) -> list[Any]:
    """Benchmark a TensorRT engine on the local GPU (through :func:`runners.bench.run_bench`).

    Args:
        engine_path: ``*.engine`` built by ``edgeprune build``.
        device: device profile (name, path or :class:`~devices.DeviceProfile`) whose ``[bench]``
            settings fill the arguments left ``None``; default: the profile recorded in the
            engine's sidecar. Must be a TensorRT profile.
        batch_sizes, iterations, warmup, cuda_graphs: override the profile's bench settings.
        inputs: optional real (N, C, H, W) inputs (default: seeded noise).

    Returns:
        list of :class:`runners.base.BenchResult`, one per batch size.

    Raises:
        UserError: no engine file, engine built for another GPU or TensorRT version, a batch
            size outside the engine's range, non-TensorRT profile.
        RuntimeFault: TensorRT, cuda-python or a GPU missing.
    """
    target = os.fspath(engine_path)
    if not Path(target).is_file():
        raise UserError(f"engine file not found: {target}")
    cfg, profile = resolve_config(device, targets=(target,), backend="tensorrt",
                                  batch_sizes=tuple(batch_sizes) if batch_sizes else None,
                                  iterations=iterations, warmup=warmup, cuda_graphs=cuda_graphs)
    return list(run_bench(target, None, cfg, profile, inputs=inputs).results)


__all__ = ["bench_engine", "check_batch_range"]
