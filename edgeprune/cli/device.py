"""``edgeprune build`` / ``bench`` / ``devices``: deploy to a device profile and measure it.

The commands parse options, build a :class:`runners.bench.BenchConfig` (or builder settings)
and call the library; errors are :class:`~edgeprune.errors.UserError` (exit 2) and
:class:`~edgeprune.errors.RuntimeFault` (exit 1, e.g. TensorRT missing), printed as one line by
the handler in ``edgeprune.cli.main``. ``edgeprune.cli.main`` registers them::

    from edgeprune.cli.device import bench_cmd, build_cmd, devices_cmd
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import click

from devices import list_profiles, load_profile
from edgeprune.cli.options import FiniteFloat
from edgeprune.jobs.bench import bench
from edgeprune.jobs.build import build, default_engine_path  # noqa: F401 (handed on)
from runners.registry import backend_names


# ---------------------------------------------------------------------------------------------
# devices


def _profile_row(p: Any) -> dict[str, str]:
    if p.build is not None:
        b = p.build
        build = (f"{b.precision}, batch {b.batch.min}/{b.batch.opt}/{b.batch.max}, "
                 f"ws {b.workspace_mib} MiB, opt {b.builder_optimization_level}")
    else:
        build = "- (no TensorRT build)"
    mem = "/".join(str(m) for m in p.memory_gb) + " GB" if p.memory_gb else "-"
    if p.shared_memory and p.memory_gb:
        mem += " shared"
    gpu = f"{p.architecture} {p.compute_capability_str}" if p.compute_capability else (p.architecture or "-")
    sw = ", ".join(x for x in (f"TensorRT {p.tensorrt}" if p.tensorrt else "",
                               f"JetPack {p.jetpack}" if p.jetpack else "") if x) or "-"
    bench = (f"batch {','.join(map(str, p.bench.batch_sizes))}, {p.bench.warmup}+{p.bench.iterations} it"
             + (", graphs" if p.bench.cuda_graphs else "") + f", {p.precision}"
             + (f", {p.threads} threads" if p.threads else ""))
    return {"name": p.name, "backend": p.backend, "gpu (arch, cc)": gpu, "memory": mem,
            "software": sw, "build": build, "bench": bench}


def format_profiles_table(profiles: Sequence[Any]) -> str:
    """A markdown table with one row per profile."""
    rows = [_profile_row(p) for p in profiles]
    if not rows:
        return "(no device profiles)"
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    line = "| " + " | ".join(c.ljust(widths[c]) for c in cols) + " |"
    sep = "|" + "|".join("-" * (widths[c] + 2) for c in cols) + "|"
    body = ["| " + " | ".join(r[c].ljust(widths[c]) for c in cols) + " |" for r in rows]
    return "\n".join([line, sep, *body])


@click.command("devices")
@click.argument("device", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the profile(s) as JSON.")
def devices_cmd(device: str | None, as_json: bool) -> None:
    """List the device profiles, or show one in full.

    DEVICE is a profile name or a .toml path.
    """
    profiles = [load_profile(device)] if device else [load_profile(n) for n in list_profiles()]
    if as_json or device:
        data = [p.to_dict() for p in profiles]
        click.echo(json.dumps(data[0] if device else data, indent=2))
        return
    click.echo(format_profiles_table(profiles))
    click.echo("\nBuild: edgeprune build model.onnx --device NAME|PROFILE.toml -o model.engine"
               "\nBench: edgeprune bench model.onnx --device NAME (the profile's bench settings)")


# ---------------------------------------------------------------------------------------------
# build



@click.command("build")
@click.argument("onnx_path", metavar="MODEL.onnx", type=click.Path(path_type=Path))
@click.option("--device", "profile_name", required=True, metavar="PROFILE",
              help="Device profile (not a torch device): a shipped name such as orin-nx (see "
                   "`edgeprune devices`) or a .toml file.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Engine file [MODEL.<device>.engine]; a JSON sidecar <engine>.json is written next to it.")
@click.option("--precision", type=click.Choice(["fp16", "fp32", "int8"]), default=None,
              help="Instead of the profile's build precision; int8 needs a Q/DQ model (edgeprune quantize).")
@click.option("--force-device", is_flag=True,
              help="Build even if this GPU's compute capability differs from the profile's.")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="Timing-cache file to reuse and update [the profile's].")
@click.option("--print-trtexec", is_flag=True,
              help="Only print the equivalent trtexec command line; build nothing (no TensorRT needed).")
def build_cmd(onnx_path: Path, profile_name: str, output: Path | None, precision: str | None, force_device: bool,
              timing_cache: Path | None, print_trtexec: bool) -> None:
    """Build a TensorRT engine from MODEL.onnx for a device profile (--device PROFILE).

    Here --device names a device profile (e.g. orin-nx), not the torch device that prune, heal
    and derive take.

    Run it on the target device (engines are specific to the GPU's compute capability and the
    TensorRT version). The equivalent trtexec command is printed first. An explicitly quantized
    (Q/DQ) model is built with INT8 + FP16 (TensorRT's explicit quantization).
    """
    build(onnx_path, device=profile_name, output=output, precision=precision, force_device=force_device,
          timing_cache=timing_cache, print_trtexec=print_trtexec, echo=click.echo)


# ---------------------------------------------------------------------------------------------
# bench


def _parse_batch_sizes(ctx: Any, param: Any, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"batch sizes must be positive integers, got {value!r}")
    return sizes


def _backend_choices() -> list[str]:
    return ["auto", *backend_names()]


@click.command("bench")
@click.argument("a")
@click.option("--vs", "b", default=None, metavar="B", help="compare against B (interleaved A B A B ...)")
@click.option("--device", "profile_name", default=None, metavar="PROFILE",
              help="device profile, not a torch device (see `edgeprune devices`; e.g. cpu, orin-nx, "
                   "rtx3090): its backend and bench settings apply [cpu; for an engine: the profile "
                   "it was built for]")
@click.option("--backend", type=click.Choice(_backend_choices()), default="auto", show_default=True,
              help="auto: .onnx -> the profile's backend, .engine -> tensorrt, run dir / model name -> torch")
@click.option("--provider", default=None, help="ONNX Runtime provider: cpu (default), cuda, tensorrt")
@click.option("--batch-sizes", default=None, callback=_parse_batch_sizes, help="e.g. 1,8 [profile's]")
@click.option("--iterations", default=None, type=click.IntRange(min=1), help="timed runs [profile's]")
@click.option("--warmup", default=None, type=click.IntRange(min=0), help="untimed runs first [profile's]")
@click.option("--threads", default=None, type=click.IntRange(min=1), help="intra-op threads [profile's]")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="TensorRT or torch on CUDA: replay CUDA graphs [profile's]")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8", "tf32", "bf16"]), default=None,
              help="TensorRT build precision for .onnx; for ONNX Runtime, int8 checks the file is "
                   "quantized (Q/DQ); torch on CUDA: fp32, tf32, fp16, bf16 [profile's]")
@click.option("--random-init", is_flag=True, help="model names without weights (latency only)")
@click.option("--min-block-ms", "min_block_ms", default=None, type=FiniteFloat(min=0), metavar="MS",
              help="each timed turn runs one model back to back for at least MS ms (runs per block chosen in "
                   "warm-up; latency = block time / runs); 0: one run per turn [25 on the CPU, 0 on a GPU]")
@click.option("--memory/--no-memory", "memory", default=None,
              help="per model its weights and its own peak memory, each model loaded and run in its own "
                   "process after the timing [on with --vs]")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="write all results as JSON")
@click.option("--markdown", "md_out", type=click.Path(path_type=Path), help="write the report as markdown")
@click.option("--plot", "plot_out", type=click.Path(path_type=Path), help="plot latency vs batch size (PNG)")
def bench_cmd(a: str, b: str | None, profile_name: str | None, backend: str, provider: str | None,
              batch_sizes: tuple[int, ...] | None, iterations: int | None, warmup: int | None,
              threads: int | None, cuda_graphs: bool | None, precision: str | None, random_init: bool,
              json_out: Path | None, md_out: Path | None, plot_out: Path | None, memory: bool | None = None,
              min_block_ms: float | None = None) -> None:
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
    bench(a, b, device=profile_name, backend=backend, provider=provider, batch_sizes=batch_sizes,
          iterations=iterations, warmup=warmup, threads=threads, cuda_graphs=cuda_graphs, precision=precision,
          random_init=random_init, memory=memory, min_block_ms=min_block_ms, json_out=json_out, md_out=md_out,
          plot_out=plot_out, echo=click.echo)


__all__ = ["bench_cmd", "build_cmd", "default_engine_path", "devices_cmd", "format_profiles_table"]
