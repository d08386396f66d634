"""The ``edgeprune`` command line: one module per command group, one error handler
(:func:`edgeprune.cli.main.main`, the console-script entry point ``edgeprune``)."""

from edgeprune.cli.main import cli, main

__all__ = ["cli", "main"]
