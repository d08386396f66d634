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

``import edgeprune`` does not import torch (issue 41: the command line must start in milliseconds to
handle Ctrl-C); it calls :func:`install_torchvision_hook`, an import hook that applies
:func:`import_torchvision` at the first ``import torchvision`` (or ``import timm``) of the process,
so that ``import edgeprune; import timm`` keeps working on CPU-only torch.
"""

from __future__ import annotations

import importlib.machinery
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


class _LoadedLoader:
    """Hands the import system the torchvision module :func:`import_torchvision` has loaded."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def create_module(self, spec):  # noqa: D102 - importlib protocol
        return self.module

    def exec_module(self, module) -> None:  # noqa: D102 - the module is loaded; keep its own spec
        module.__spec__ = self.module.__dict__.get("_edgeprune_real_spec", module.__spec__)


class _TorchvisionHook:
    """One-shot ``sys.meta_path`` finder: the first ``import torchvision`` goes through
    :func:`import_torchvision` (then the hook removes itself). Plain classes with the importlib
    protocol's methods (``importlib.abc`` would cost start-up time)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        if fullname != "torchvision":
            return None
        remove_torchvision_hook()
        try:
            module = import_torchvision()
        except ImportError:
            return None  # not installed: the normal machinery raises its own error
        real = module.__spec__
        module.__dict__["_edgeprune_real_spec"] = real
        spec = importlib.machinery.ModuleSpec(fullname, _LoadedLoader(module), origin=getattr(real, "origin", None),
                                              is_package=True)
        spec.submodule_search_locations = getattr(real, "submodule_search_locations", None)
        return spec


_HOOK = _TorchvisionHook()


def install_torchvision_hook() -> None:
    """Apply :func:`import_torchvision` when torchvision is first imported (nothing if it is already)."""
    if "torchvision" not in sys.modules and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def remove_torchvision_hook() -> None:
    """Remove the hook of :func:`install_torchvision_hook` (idempotent)."""
    while _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def import_timm():
    """Import timm after :func:`import_torchvision`; returns the ``timm`` module."""
    import_torchvision()
    import timm

    return timm
