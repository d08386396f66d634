"""The deploy pipeline (``edgeprune deploy``'s library): :func:`deploy` runs prune, (heal,) export, verify,
quantize, build and bench (:mod:`edgeprune.jobs`) into one folder, resumable (:mod:`.state`), summed up in
``report.md`` / ``report.json`` (:mod:`.report`, :mod:`.plot`). No click here: the command is a thin face.

    import edgeprune
    result = edgeprune.deploy("out/fm-cpu", device="cpu", sparsity=0.5, calib_size=64, eval_size=64)

``edgeprune.deploy`` is this package; it is callable (the call is :func:`deploy`), so that ``import
edgeprune.deploy`` and ``edgeprune.deploy(...)`` both work.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from edgeprune.deploy.pipeline import DeployResult, deploy
from edgeprune.deploy.state import STAGES, DeployState


class _CallablePackage(types.ModuleType):
    """This package, callable: ``edgeprune.deploy(...)`` is :func:`deploy`."""

    def __call__(self, *args: Any, **kwargs: Any) -> DeployResult:
        return deploy(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["DeployResult", "DeployState", "STAGES", "deploy"]
