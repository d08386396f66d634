"""What the jobs share: a model from its options or a run directory, the torch device of a job,
the check that a data folder can be read, the one-line quality of a model (moved here from
``edgeprune.cli.options`` / ``device_options``, which hand them on)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Callable

from devices import is_profile, load_profile
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.loading import load_run_or_model
from edgeprune.torch_device import resolve_device
from edgeprune.zoo.registry import get_model_spec


def _supports(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _extra(fn: Callable, img_size: int | None, model_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for name, value in (("img_size", img_size), ("model_kwargs", model_kwargs)):
        if value is not None:
            if not _supports(fn, name):
                raise UserError(f"--{name.replace('_', '-')} is not supported by this edgeprune")
            kw[name] = value
    return kw


def make_spec(model_name: str, checkpoint: Any = None, random_init: bool = False, num_classes: int | None = None,
              img_size: int | None = None, model_kwargs: dict[str, Any] | None = None) -> Any:
    """The ``ModelSpec`` of the model options (``img_size`` / ``model_kwargs`` passed on where the
    registry takes them).

    Raises:
        UserError: unknown model, a checkpoint for a zoo model, ...
    """
    kw = _extra(get_model_spec, img_size, model_kwargs)
    return get_model_spec(model_name, str(checkpoint) if checkpoint else None, random_init, num_classes, **kw)


def load_model(run_dir: Any, model_name: str | None, checkpoint: Any = None, random_init: bool = False,
               num_classes: int | None = None, img_size: int | None = None,
               model_kwargs: dict[str, Any] | None = None) -> tuple[Any, dict | None, Any]:
    """``(model, record or None, spec)`` of a run directory or the model options
    (:func:`edgeprune.loading.load_run_or_model`).

    Raises:
        UserError: neither or both given, a missing run directory, an unknown model.
    """
    if run_dir is not None and (img_size is not None or model_kwargs):
        raise SettingError("{img_size}/{model_kwargs} go with {model_name}, not a run directory (it records its own)")
    kw = _extra(load_run_or_model, img_size, model_kwargs)
    return load_run_or_model(run_dir, model_name, checkpoint, random_init, num_classes, **kw)


def torch_device_of(device: str | None, torch_device: str | None, default: str = "auto") -> str:
    """The torch device of a command from ``--device`` / ``--torch-device`` (resolved: never "auto").

    ``--torch-device`` when given; else the old ``--device cuda`` spelling; else ``cpu`` for a
    profile whose backend is the CPU (onnxruntime), else ``default``.

    Raises:
        UserError: both the old spelling and --torch-device, an unknown device, CUDA not available.
    """
    legacy = device is not None and not is_profile(device.strip())
    if legacy and torch_device is not None:
        raise SettingError(f"{{device}} {SettingError.literal(device)} (the old spelling of {{torch_device}}) and "
                           f"{{torch_device}} {SettingError.literal(torch_device)}: give {{torch_device}} only")
    if torch_device is None:
        if legacy:
            torch_device = device
        elif device is not None and load_profile(device.strip()).backend == "onnxruntime":
            torch_device = "cpu"
        else:
            torch_device = default
    return resolve_device(torch_device)


def check_readable_dir(path: Any, what: str) -> None:
    """A data path given on the command line can be read (checked before work). A missing path
    is left to the data loader, whose message says where the data is expected.

    Raises:
        UserError: the path exists but cannot be listed or read.
    """
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        return
    if p.is_dir():
        try:
            os.listdir(p)
        except OSError as err:
            raise UserError(f"cannot read {what} {p}: {err.strerror}") from None
    elif not os.access(p, os.R_OK):
        raise UserError(f"cannot read {what} {p}")


def fmt_metric(m: dict | None, kind: str) -> str:
    """One-line quality summary: top-1 / agreement (classifiers) or saliency fidelity, comma-separated (it is
    one cell of the prune and heal tables: a ``|`` would split it into columns the header does not have)."""
    if not m:
        return "-"
    if kind == "dense":
        maps = (f", IoU@0.5 {m['iou@0.5']:.4f}, Pearson {m['pearson']:.4f}" if "iou@0.5" in m else "")
        return f"rel. error {m['rel_error']:.3g}, PSNR {m['psnr_db']:.1f} dB{maps}"
    if kind == "saliency":
        return (f"MAE {m['mae']:.4f}, Pearson {m['pearson']:.4f}, IoU@0.5 {m['iou@0.5']:.4f}, "
                f"feat cos {m['feature_cosine']:.4f}")
    parts = []
    if "top1" in m:
        parts.append(f"top-1 {m['top1'] * 100:.2f}%")
    if "agreement" in m:
        parts.append(f"agreement {m['agreement'] * 100:.2f}%")
    return ", ".join(parts) or "-"


__all__ = ["check_readable_dir", "fmt_metric", "load_model", "make_spec", "torch_device_of"]
