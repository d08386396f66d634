"""``edgeprune devices``: the device profiles, as a table or one in full (JSON).

``build`` and ``bench`` (:mod:`edgeprune.cli.device`) take a profile's name (or a .toml file) as ``--device``.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import click

from edgeprune import list_profiles, load_profile
from edgeprune.cli.device_options import json_flag_option


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
@json_flag_option("Print the profile(s) as JSON.")
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


__all__ = ["devices_cmd", "format_profiles_table"]
