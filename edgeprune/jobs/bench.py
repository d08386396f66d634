"""The job of ``edgeprune bench``: latency and throughput of a model or engine on a device profile,
optionally interleaved with a second one (``vs``), with each model's own peak memory (``memory``).

Its settings (backend, batch sizes, runs, blocks, memory ...) are declared once in
:class:`runners.bench_settings.BenchSection`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Sequence

from edgeprune.atomic import atomic_write_text
from edgeprune.errors import UserError
from edgeprune.jobs.echo import Echo, echo as _echo
from runners.bench import resolve_config, run_bench
from runners.report import plot_latency, to_json


@dataclasses.dataclass
class BenchResult:
    """Outcome of :func:`bench`: the results (one row per batch size), the markdown report, the report
    object of :func:`runners.bench.run_bench`, the profile, and the files written."""

    results: list[Any]
    markdown: str
    report: Any
    profile: Any
    written: list[Path]


def bench(a: str | Path, vs: str | Path | None = None, *, device: str | None = None, backend: str = "auto",
          provider: str | None = None, batch_sizes: Sequence[int] | None = None, iterations: int | None = None,
          warmup: int | None = None, threads: int | None = None, cuda_graphs: bool | None = None,
          precision: str | None = None, random_init: bool = False, memory: bool | None = None,
          min_block_ms: float | None = None,
          json_out: str | Path | None = None, md_out: str | Path | None = None, plot_out: str | Path | None = None,
          argv: Sequence[str] | None = None, echo: Echo = _echo) -> BenchResult:
    """Bench ``a`` (an .onnx file, an engine, a run directory or a model name) on the device profile
    ``device`` [cpu], interleaved with ``vs`` when given; settings given here override the profile's.

    ``memory`` (default: on with ``vs``) measures each model's weights and own peak memory in a process of
    its own. ``min_block_ms`` (ms, default 25; 0: one run per turn) is the least time of one timed block of
    back-to-back runs (:func:`runners.compare.bench_pair`). ``argv`` is recorded in the JSON file [``sys.argv[1:]``].

    Raises:
        UserError: a bad profile or setting, a missing backend, ``plot_out`` without matplotlib.
    """
    a, b = str(a), (None if vs is None else str(vs))
    targets = (a,) if b is None else (a, b)
    cfg, profile = resolve_config(device, targets=targets, backend=backend, provider=provider,
                                  threads=threads, batch_sizes=tuple(batch_sizes) if batch_sizes else None,
                                  warmup=warmup, iterations=iterations, cuda_graphs=cuda_graphs, precision=precision,
                                  random_init=random_init, min_block_ms=min_block_ms)
    if plot_out is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib (pip install matplotlib)") from None
    report = run_bench(a, b, cfg, profile, memory=(b is not None) if memory is None else memory)
    text = report.markdown()
    echo(text.replace("  \n", "\n"))
    written = []
    if md_out is not None:
        atomic_write_text(Path(md_out), text + "\n")
        echo(f"wrote {md_out}")
        written.append(Path(md_out))
    if json_out is not None:
        to_json(report.results, json_out, extra={"command": "edgeprune bench",
                                                 "argv": list(sys.argv[1:] if argv is None else argv),
                                                 "a": a, "b": b, **report.json_extra()})
        echo(f"wrote {json_out}")
        written.append(Path(json_out))
    if plot_out is not None:
        plot_latency(report.results, plot_out, title=f"{a}" + (f" vs {b}" if b else "") + f" ({profile.name})")
        echo(f"wrote {plot_out}")
        written.append(Path(plot_out))
    return BenchResult(results=report.results, markdown=text, report=report, profile=profile, written=written)


__all__ = ["BenchResult", "bench"]
