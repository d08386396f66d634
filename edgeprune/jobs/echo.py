"""How a job says what it does: ``echo(line, err=False)`` (the CLI passes ``click.echo``)."""

from __future__ import annotations

import sys
from typing import Protocol


class Echo(Protocol):
    """``echo(message, err=False)``: one line to stdout, or to stderr with ``err``."""

    def __call__(self, message: str = "", err: bool = False) -> object: ...


def echo(message: str = "", err: bool = False) -> None:
    """Print ``message`` to stdout (stderr with ``err``), as ``click.echo`` does."""
    stream = sys.stderr if err else sys.stdout
    print(message, file=stream, flush=True)


def silent(message: str = "", err: bool = False) -> None:
    """Say nothing (a quiet job)."""


__all__ = ["Echo", "echo", "silent"]
