"""Torch device names: check and resolve ``cpu``, ``cuda``, ``cuda:N`` and ``auto``.

Core code (the prune, heal and derive configs, :func:`edgeprune.api.prune`) and the command line's
``--device`` option (:func:`edgeprune.cli.options.device_option`) resolve torch devices here, so
that library code never imports :mod:`edgeprune.cli`. Deployment device *profiles* (``orin-nx``,
...) are a different thing and live in ``devices/``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from edgeprune.errors import UserError

_CUDA = re.compile(r"cuda(?::(\d+))?")


def resolve_device(device: Any) -> str:
    """Check a torch device string before any work: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``
    (``cuda`` when ``torch.cuda.is_available()``, else ``cpu``). Returns the device to use
    (lower case, never ``auto``).

    Raises:
        UserError: an unknown device, CUDA not available, or a CUDA index that does not exist.
    """
    d = str(device).strip().lower()
    if d == "cpu":
        return d
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    m = _CUDA.fullmatch(d)
    if m is None:
        raise UserError(f"unknown device {device!r} (use cpu, cuda, cuda:N or auto)")
    if not torch.cuda.is_available():
        raise UserError("CUDA is not available (use --device cpu)")
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise UserError(f"no CUDA device {m.group(1)}: {torch.cuda.device_count()} visible (use cuda:0)")
    return d
