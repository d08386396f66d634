"""The ``edgeprune`` command line: one module per command group, one error handler
(:func:`edgeprune.cli.main.main`). The console-script entry point ``edgeprune`` is
:func:`edgeprune.cli.entry.script`, which runs
:func:`edgeprune.cli.entry.main` (re-exported here as ``main``): it guards Ctrl-C before it imports
the command line, so this package's ``__init__`` imports nothing heavy (``cli``, the click group,
is imported on first access)."""

from __future__ import annotations

import importlib

from edgeprune.cli.entry import main


def __getattr__(name: str) -> object:
    """``cli`` (the click group of :mod:`edgeprune.cli.main`), imported on first access.

    Raises:
        AttributeError: any other name.
    """
    if name == "cli":
        return importlib.import_module("edgeprune.cli.main").cli
    raise AttributeError(f"module 'edgeprune.cli' has no attribute {name!r}")


__all__ = ["cli", "main"]
