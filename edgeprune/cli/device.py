"""``edgeprune bench``: latency and throughput on a device profile (``build``: :mod:`.build`, ``devices``:
:mod:`.devices`; this module hands them on).

The command is a face over :func:`edgeprune.jobs.bench.bench`: its setting options are generated from the declared
section ``[bench]`` of ``runners.bench_settings`` (``edgeprune.cli.generate``); the job's own inputs (the targets
A and ``--vs`` B, the profile, the report files) are the shared options of ``edgeprune.cli.device_options``.
Errors are one line (``edgeprune.cli.main``).
"""

from __future__ import annotations

from typing import Any

import click

from edgeprune.cli import generate
from edgeprune.cli.help import SettingsCommand
from edgeprune.cli.build import build_cmd  # noqa: F401 (handed on)
from edgeprune.cli.device_options import report_files_options, vs_option
from edgeprune.cli.options import profile_option
from edgeprune.cli.devices import devices_cmd, format_profiles_table  # noqa: F401 (handed on)
from edgeprune.cli.options import json_option
from edgeprune import bench
from runners.bench_settings import BENCH_SECTIONS


@click.command("bench", cls=SettingsCommand, settings_sections=BENCH_SECTIONS)
@click.argument("a")
@vs_option
@profile_option("device profile, not a torch device (see `edgeprune devices`; e.g. cpu, orin-nx, rtx3090): its "
                "backend and bench settings apply [cpu; for an engine: the profile it was built for]")
@generate.options(BENCH_SECTIONS)
@json_option("write all results as JSON")
@report_files_options
def bench_cmd(**opts: Any) -> None:
    """Latency and throughput of a model or engine, optionally against B.

    Here --device names a device profile (e.g. cpu, orin-nx), not the torch device that prune,
    heal and derive take; a run directory or model name runs on CUDA for a GPU profile.

    A is an .onnx file (quantized or not), an engine, a run directory or a model name; it runs on
    a device profile, per batch size, interleaved with B when given.

    The profile chooses backend, threads, batch sizes, warm-up, iterations, CUDA graphs and
    precision; options given here override it, and the report says which came from where. A
    profile whose backend is missing here (TensorRT, CUDA) is an error, not a CPU fallback.
    With --vs, A and B run interleaved on the same input and the table reports the per-pair
    latency ratio A/B (median, p10-p90): > 1 means B is faster. Each turn is a block of back-to-back
    runs of one model lasting at least --min-block-ms (the report says "blocks of k runs"); a p10-p90
    interval that straddles 1 is reported as no measurable difference.

    Both models of a --vs bench share one process, so its peak memory column is the same for
    both; --memory (on with --vs) adds per model its weights (MiB) and its own peak RSS, each
    model loaded and run on the bench's batch sizes in a fresh process of its own.
    """
    bench(opts.pop("a"), echo=click.echo, **opts)


__all__ = ["bench_cmd", "build_cmd", "devices_cmd", "format_profiles_table"]
