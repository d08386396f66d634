"""One library function per job of the commands (issue 53): each takes plain keyword settings, says what it
does through ``echo(line, err=False)``, returns a small result (what it wrote, its report) and raises
:class:`~edgeprune.errors.UserError` (one line) for a user's mistake. The click commands are thin faces over
them; :mod:`edgeprune.deploy` runs them in order.

    export (export.py), verify (verify.py), quantize (quantize.py), build (build.py), bench (bench.py),
    prune_run (prune_run.py: prune with deploy's settings), heal_run (heal_run.py), derive_run (derive_run.py:
    NuWa), latency_table_run (latency_table_run.py), eval_run (eval_run.py), info_run (info_run.py)

Imported on first use (``quantize`` needs onnxruntime, ``build`` TensorRT at build time).
"""

from __future__ import annotations

import importlib

#: public name -> the module of this package that defines it
_NAMES = {"export": "export", "ExportResult": "export", "verify": "verify", "VerifyResult": "verify",
          "VerifyFailed": "verify", "quantize": "quantize", "QuantizeResult": "quantize", "build": "build",
          "BuildResult": "build", "bench": "bench", "BenchResult": "bench", "prune_run": "prune_run",
          "PruneRunResult": "prune_run", "heal_run": "heal_run", "HealRunResult": "heal_run",
          "derive_run": "derive_run", "DeriveRunResult": "derive_run", "latency_table_run": "latency_table_run",
          "LatencyTableRunResult": "latency_table_run", "eval_run": "eval_run", "info_run": "info_run"}


def __getattr__(name: str) -> object:
    """The public names of :data:`_NAMES`, imported on first access.

    Raises:
        AttributeError: not a public name of edgeprune.jobs.
    """
    if name not in _NAMES:
        raise AttributeError(f"module 'edgeprune.jobs' has no attribute {name!r}")
    return getattr(importlib.import_module(f"edgeprune.jobs.{_NAMES[name]}"), name)


__all__ = sorted(_NAMES)
