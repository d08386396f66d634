"""Import-time compatibility shims.

torchvision on CPU-only torch
-----------------------------
PyPI's Linux torchvision wheels are CUDA builds. Installed next to a CPU build of torch
(``torch==2.13.0+cpu``), torchvision's compiled extension ``torchvision/_C.so`` fails to load,
its operators (``torchvision::nms``, ``roi_align``, ...) are never registered, and
``torchvision/_meta_registrations.py`` then raises at import time::

    RuntimeError: operator torchvision::nms does not exist

(pytorch/vision#9085). ``import timm`` imports torchvision, so it fails too.

edgeprune never calls torchvision's compiled operators; it needs only the pure-Python
``torchvision.transforms`` that timm's preprocessing uses. :func:`import_torchvision` therefore
imports torchvision normally and, only if that import fails with exactly this error, removes the
half-imported modules, registers an empty stand-in for ``torchvision._meta_registrations``
(the module that registers fake kernels for the missing operators) and imports again. The
operators stay unavailable (calling ``torchvision.ops.nms`` still fails), everything else works.
:data:`TORCHVISION_OPS_MISSING` records whether the workaround was applied.
"""

from __future__ import annotations

import sys
import types

TORCHVISION_OPS_MISSING: bool = False


def _purge(prefix: str) -> None:
    for name in list(sys.modules):
        if name == prefix or name.startswith(prefix + "."):
            del sys.modules[name]


def import_torchvision():
    """Import torchvision, working around pytorch/vision#9085 on CPU-only torch.

    Returns:
        The ``torchvision`` module.

    Raises:
        RuntimeError: any torchvision import error other than the missing-operator one.
    """
    global TORCHVISION_OPS_MISSING
    try:
        import torchvision
    except RuntimeError as err:
        if "torchvision::" not in str(err) or "does not exist" not in str(err):
            raise
        _purge("torchvision")
        stub = types.ModuleType("torchvision._meta_registrations")
        stub.__doc__ = "edgeprune stand-in: torchvision's compiled ops did not load (pytorch/vision#9085)."
        sys.modules["torchvision._meta_registrations"] = stub
        import torchvision
        TORCHVISION_OPS_MISSING = True
    return torchvision


def import_timm():
    """Import timm after :func:`import_torchvision`; returns the ``timm`` module."""
    import_torchvision()
    import timm

    return timm
