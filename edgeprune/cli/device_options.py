"""``--device PROFILE`` and ``--torch-device DEVICE`` of the torch commands (issue 42: one meaning of
``--device``).

``--device`` names a deployment profile everywhere (``cpu``, ``orin-nx``, ``rtx3090`` or a profile
``.toml``), as ``build`` / ``bench`` / ``latency-table`` use it; where the calibration, heal and
evaluation passes of prune / heal / derive / eval / verify run is ``--torch-device``. The old
``--device cuda`` (``cuda``, ``cuda:N``, ``auto``: a torch device that is not a profile name) keeps
working for a deprecation period with a one-line warning; ``--device cpu`` is the CPU profile,
whose torch device is the CPU.

Below: the inputs of the device jobs (export, verify, build, bench, devices) that are not settings (issue 53:
their settings are declared in ``exporters.export_settings``, ``exporters.tensorrt_settings`` and
``runners.bench_settings``): the profile, the output file, ``--force``, the reports.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import click

from edgeprune import is_profile, list_profiles, load_profile
from edgeprune.errors import UserError



def _apply(f: Callable, *decorators: Callable) -> Callable:
    for d in reversed(decorators):
        f = d(f)
    return f


_TORCH = re.compile(r"auto|cuda(:\d+)?")


_is_profile = is_profile


def _device_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--device``: a deployment profile (checked here: a bad name or file is one line); a torch
    device name that is not a profile name (``cuda``, ``cuda:N``, ``auto``) is the old spelling of
    ``--torch-device``: a one-line warning, and it is used as the torch device (issue 42)."""
    if value is None or ctx.resilient_parsing:
        return value
    text = str(value).strip()
    if _is_profile(text):
        load_profile(text)  # a bad profile: one line (ProfileError is a UserError)
        return text
    if _TORCH.fullmatch(text.lower()):
        click.echo(f"warning: --device {text} is a torch device: use --torch-device {text} (--device now names a "
                   f"deployment profile: {', '.join(list_profiles())} or a .toml file)", err=True)
        return text
    raise UserError(f"unknown device {value!r}: not a device profile ({', '.join(list_profiles())} or a .toml "
                    "file) nor a torch device (--torch-device cpu|cuda|cuda:N|auto)")


def _torch_device_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None or ctx.resilient_parsing:
        return value
    if not re.fullmatch(r"cpu|auto|cuda(:.*)?", str(value).strip().lower()):
        raise UserError(f"unknown device {value!r} (--torch-device: cpu, cuda, cuda:N or auto)")
    return str(value).strip()


def device_option(f: Callable | None = None, *, default: str = "cpu") -> Callable:
    """``--device PROFILE`` (a deployment profile, as build / bench use it) and ``--torch-device
    cpu|cuda|cuda:N|auto`` (where the torch passes run); the command receives ``device`` (the profile
    as given, or the old torch spelling) and ``torch_device``, and hands both to its job (which resolves them:
    ``edgeprune.jobs.models.torch_device_of``). ``default``: the torch device without a profile (prune, heal,
    derive: auto; eval, verify: cpu)."""
    def deco(fn: Callable) -> Callable:
        return _apply(
            fn,
            click.option("--device", default=None, callback=_device_callback, metavar="PROFILE",
                         help="Deployment profile: " + ", ".join(list_profiles()) + " or a .toml file "
                              "(`edgeprune devices`) [none]."),
            click.option("--torch-device", "torch_device", default=None, callback=_torch_device_callback,
                         metavar="DEVICE",
                         help="Where the torch passes run: cpu, cuda, cuda:N or auto (cuda if available) "
                              + (f"[cpu with a CPU profile, else {default}]." if default != "cpu" else "[cpu]."),),
        )
    return deco if f is None else deco(f)


# ---- the inputs of the device jobs (export, verify, build, bench, devices): not settings (issue 53) ------------








def against_option(f: Callable) -> Callable:
    """verify's ``--against RUN_DIR`` (``run_dir``): the run the file was exported from."""
    return click.option("--against", "run_dir", type=click.Path(path_type=Path), metavar="RUN_DIR",
                        help="The run directory the file was exported from.")(f)


def data_option(help_text: str) -> Callable:
    """``--data DIR``: the job's evaluation images (``help_text`` says which and the default); ``data``."""
    return click.option("--data", type=click.Path(path_type=Path), default=None, metavar="DIR", help=help_text)


def print_trtexec_option(f: Callable) -> Callable:
    """build's ``--print-trtexec``: only print the equivalent trtexec line (``print_trtexec``)."""
    return click.option("--print-trtexec", is_flag=True,
                        help="Only print the equivalent trtexec command line; build nothing (no TensorRT needed).")(f)


def vs_option(f: Callable) -> Callable:
    """bench's ``--vs B``: the second target, interleaved with the first (``vs``)."""
    return click.option("--vs", "vs", default=None, metavar="B", help="compare against B (interleaved A B A B ...)")(f)


def report_files_options(f: Callable) -> Callable:
    """bench's reports besides ``--json``: ``--markdown FILE`` (``md_out``), ``--plot FILE`` (``plot_out``)."""
    return _apply(
        f,
        click.option("--markdown", "md_out", type=click.Path(path_type=Path), metavar="FILE",
                     help="write the report as markdown"),
        click.option("--plot", "plot_out", type=click.Path(path_type=Path), metavar="FILE",
                     help="plot latency vs batch size (PNG)"),
    )


def json_flag_option(help_text: str) -> Callable:
    """``--json`` as a flag (``as_json``): print JSON instead of a table."""
    return click.option("--json", "as_json", is_flag=True, help=help_text)


__all__ = ["against_option", "data_option", "device_option", "json_flag_option",
           "print_trtexec_option", "report_files_options", "vs_option"]
