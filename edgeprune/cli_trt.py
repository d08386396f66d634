"""``edgeprune build`` / ``edgeprune devices``, and :func:`bench_engine` for ``edgeprune bench``.

``edgeprune build model.onnx --device orin-nx -o model.engine`` builds a TensorRT engine for a
device profile on that device (it refuses a GPU of another compute capability unless
``--force-device``), always printing the equivalent ``trtexec`` command first, so the build can
be repeated by hand or run where only ``trtexec`` is installed (``--print-trtexec`` prints it
and stops). ``edgeprune devices`` lists the device profiles.

Every user mistake, and a missing TensorRT, cuda-python or GPU, ends as one ``error: ...`` line
on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import click

from edgeprune.errors import UserError


class TrtCliError(click.ClickException):
    """A user mistake: printed as one ``error: <message>`` line, exit status 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True, file=file)


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            raise TrtCliError(str(err)) from None

    return wrapper


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
             + (", graphs" if p.bench.cuda_graphs else ""))
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
@_user_errors
def devices_cmd(device: str | None, as_json: bool) -> None:
    """List the device profiles, or show DEVICE (a profile name or a .toml path) in full."""
    from devices import list_profiles, load_profile

    profiles = [load_profile(device)] if device else [load_profile(n) for n in list_profiles()]
    if as_json or device:
        data = [p.to_dict() for p in profiles]
        click.echo(json.dumps(data[0] if device else data, indent=2))
        return
    click.echo(format_profiles_table(profiles))
    click.echo("\nBuild: edgeprune build model.onnx --device NAME|PROFILE.toml -o model.engine")


# ---------------------------------------------------------------------------------------------
# build


def default_engine_path(onnx_path: Path, device_name: str) -> Path:
    """``model.onnx`` + ``orin-nx`` -> ``model.orin-nx.engine`` next to the ONNX file."""
    return onnx_path.with_name(f"{onnx_path.stem}.{device_name}.engine")


@click.command("build")
@click.argument("onnx_path", metavar="MODEL.onnx", type=click.Path(path_type=Path))
@click.option("--device", "device", required=True, metavar="NAME|PATH",
              help="Device profile: a shipped name (see `edgeprune devices`) or a .toml file.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Engine file [MODEL.<device>.engine]; a JSON sidecar <engine>.json is written next to it.")
@click.option("--force-device", is_flag=True,
              help="Build even if this GPU's compute capability differs from the profile's.")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="Timing-cache file to reuse and update [the profile's].")
@click.option("--print-trtexec", is_flag=True,
              help="Only print the equivalent trtexec command line; build nothing (no TensorRT needed).")
@_user_errors
def build_cmd(onnx_path: Path, device: str, output: Path | None, force_device: bool,
              timing_cache: Path | None, print_trtexec: bool) -> None:
    """Build a TensorRT engine from MODEL.onnx for a device profile.

    Run it on the target device (engines are specific to the GPU's compute capability and the
    TensorRT version). The equivalent trtexec command is printed first.
    """
    from devices import load_profile
    from exporters.tensorrt import builder_settings, onnx_input, read_sidecar
    from exporters.trtexec import trtexec_args

    profile = load_profile(device)
    if not profile.uses_tensorrt:
        raise UserError(f"device profile {profile.name!r} runs {profile.backend}, not TensorRT: "
                        "nothing to build (benchmark the .onnx file directly)")
    out = output if output is not None else default_engine_path(onnx_path, profile.name)
    name, shape = onnx_input(onnx_path)
    settings = builder_settings(profile, shape, input_name=name, timing_cache=timing_cache)
    cmd = shlex.join(trtexec_args(onnx_path, settings, out))
    if print_trtexec:
        click.echo(cmd)
        return
    click.echo(f"trtexec equivalent:\n  {cmd}")

    from exporters.tensorrt import build_engine

    click.echo(f"building {out} for {profile.name} ({settings['precision']}, batch "
               f"{settings['shapes']['min'][0]}..{settings['shapes']['max'][0]}) ...")
    engine = build_engine(onnx_path, profile, out, force_device=force_device, timing_cache=timing_cache)
    meta = read_sidecar(engine) or {}
    size_mb = engine.stat().st_size / 2**20
    gpu = meta.get("gpu", {})
    click.echo(f"wrote {engine} ({size_mb:.1f} MiB) in {meta.get('build_time_s', float('nan')):.1f} s "
               f"on {gpu.get('name', '?')} (compute capability {gpu.get('compute_capability', '?')}), "
               f"TensorRT {meta.get('tensorrt_version', '?')}; sidecar {engine.name}.json")
    try:
        from runners.tensorrt_runner import attention_fusion_report

        click.echo(attention_fusion_report(engine).summary())
    except Exception as err:  # the build succeeded; the report is a bonus
        click.echo(f"(attention fusion report unavailable: {err})", err=True)


# ---------------------------------------------------------------------------------------------
# bench (called by `edgeprune bench model.engine --device ...`)


def bench_engine(engine_path: str | os.PathLike[str], device: Any = None,
                 batch_sizes: Sequence[int] | None = None, iterations: int | None = None,
                 warmup: int | None = None, cuda_graphs: bool | None = None,
                 inputs: Any = None) -> list[Any]:
    """Benchmark a TensorRT engine on the local GPU.

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
        UserError: no engine file, TensorRT/cuda-python/GPU missing, engine built for another
            GPU or TensorRT version, a batch size outside the engine's range, non-TensorRT profile.
    """
    from devices import load_profile
    from exporters.tensorrt import read_sidecar

    path = Path(engine_path)
    if not path.is_file():
        raise UserError(f"engine file not found: {path}")
    sidecar = read_sidecar(path) or {}
    bench: dict[str, Any] = dict((sidecar.get("profile") or {}).get("bench") or {})
    if device is not None:
        profile = load_profile(device)
        if not profile.uses_tensorrt:
            raise UserError(f"device profile {profile.name!r} is for {profile.backend}; "
                            f"{path.name} is a TensorRT engine (use a TensorRT profile, e.g. rtx3090, orin-nx)")
        built_for = (sidecar.get("profile") or {}).get("name")
        if built_for and built_for != profile.name:
            print(f"warning: {path.name} was built for profile {built_for!r}, benchmarking with "
                  f"{profile.name!r} settings", file=sys.stderr)
        bench = {"batch_sizes": list(profile.bench.batch_sizes), "warmup": profile.bench.warmup,
                 "iterations": profile.bench.iterations, "cuda_graphs": profile.bench.cuda_graphs}
    sizes = list(batch_sizes) if batch_sizes else list(bench.get("batch_sizes") or [1])
    iters = int(iterations if iterations is not None else bench.get("iterations", 100))
    warm = int(warmup if warmup is not None else bench.get("warmup", 10))
    graphs = bool(cuda_graphs if cuda_graphs is not None else bench.get("cuda_graphs", False))
    if iters < 1 or warm < 0:
        raise UserError(f"need iterations >= 1 and warmup >= 0, got {iters}, {warm}")

    from runners.tensorrt_runner import TrtRunner

    runner = TrtRunner(path, cuda_graphs=graphs)
    try:
        bad = [b for b in sizes if not runner.min_batch <= b <= runner.max_batch]
        if bad:
            raise UserError(f"batch size(s) {bad} outside {path.name}'s range "
                            f"{runner.min_batch}..{runner.max_batch} (rebuild with a wider build.batch)")
        return list(runner.benchmark(sizes, iters, warm, inputs=inputs))
    finally:
        runner.close()


__all__ = ["build_cmd", "devices_cmd", "bench_engine", "format_profiles_table", "default_engine_path",
           "TrtCliError"]
