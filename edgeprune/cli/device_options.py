"""``--device PROFILE`` and ``--torch-device DEVICE`` of the torch commands (issue 42: one meaning of
``--device``).

``--device`` names a deployment profile everywhere (``cpu``, ``orin-nx``, ``rtx3090`` or a profile
``.toml``), as ``build`` / ``bench`` / ``latency-table`` use it; where the calibration, heal and
evaluation passes of prune / heal / derive / eval / verify run is ``--torch-device``. The old
``--device cuda`` (``cuda``, ``cuda:N``, ``auto``: a torch device that is not a profile name) keeps
working for a deprecation period with a one-line warning; ``--device cpu`` is the CPU profile,
whose torch device is the CPU.
"""

from __future__ import annotations

import re
from typing import Callable

import click

from devices import list_profiles, load_profile
from edgeprune.errors import UserError
from edgeprune.jobs.models import is_profile, torch_device_of  # noqa: F401 (handed on)


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
    as given, or the old torch spelling) and ``torch_device``, and calls :func:`torch_device_of`
    first. ``default``: the torch device without a profile (prune, heal, derive: auto; eval,
    verify: cpu)."""
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




__all__ = ["device_option", "torch_device_of"]
