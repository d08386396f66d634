"""Torch device names: check and resolve ``cpu``, ``cuda``, ``cuda:N`` and ``auto``.

Core code (the prune, heal and derive configs, :func:`edgeprune.api.prune`) and the command line's
``--torch-device`` option (:func:`edgeprune.cli.options.device_option`) resolve torch devices here, so
that library code never imports :mod:`edgeprune.cli`. Deployment device *profiles* (``orin-nx``,
...) are a different thing and live in ``devices/``: ``--device`` names one in every command, so a
message's advice names ``--torch-device`` (:data:`CUDA_MISSING`, issue 52).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from edgeprune.errors import UserError

_CUDA = re.compile(r"cuda(?::(\d+))?")

#: the one message of a CUDA device asked for where there is none: the advice is the option that names torch
#: devices (``--device`` names the deployment profile in every command, issue 42)
CUDA_MISSING = "CUDA is not available (use --torch-device cpu)"


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
        raise UserError(CUDA_MISSING)
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise UserError(f"no CUDA device {m.group(1)}: {torch.cuda.device_count()} visible (use --torch-device cuda:0)")
    return d
