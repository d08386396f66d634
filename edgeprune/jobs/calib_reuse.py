"""The calibration folder a run recorded, and its reuse by ``quantize``, ``heal`` and ``eval`` (issue 42).

``prune`` records, beside the calibration's size and seed, the folder given with ``--calib``
(``calibration.folder``, absolute) and a content hash of it (``calibration.folder_sha256``,
:func:`folder_sha256`), and the ``--eval-data`` folder the calibration was checked disjoint from
(``calibration.eval_folder``, absolute; issue 52). A later command on the run reuses the folder when it
is still there and its hash is unchanged; ``--calib`` overrides it; a changed folder is said in one line
and used as it is now. A folder that is gone is refused in one line (exit 2: calibrating on other data
than the run's would be silent; issue 52) unless it held the model's built-in data (a zoo model's
Fashion-MNIST copy with the same content hash as the built-in folder): then the built-in folder is used,
said in one line.

Without labeled evaluation data, a timm run's quantized or evaluated model is compared with the
float / dense model on the folder's *held-out* images (:func:`heldout_source`: the images of the
folder that the calibration did not use), by top-1 agreement; ``quantize`` first reuses the run's
recorded evaluation folder (:func:`recorded_eval_folder`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

from edgeprune.data import fashion_mnist
from edgeprune.data.sources import FolderSource, list_image_folder, subset
from edgeprune.errors import UserError
from edgeprune.jobs.echo import echo
from edgeprune.zoo.entries import zoo_entry

_CHUNK = 1 << 20


def folder_sha256(folder: str | os.PathLike, used: list[Path] | None = None) -> str:
    """Content hash of a calibration folder (hex sha256): the listing of every file under it
    (relative path and size, sorted) and the bytes of the files the calibration read (``used``: the
    selected images of an ImageFolder; None: every file, e.g. the four Fashion-MNIST idx files).

    Cost: one ``stat`` per file of the folder, one read of the used files.

    Raises:
        UserError: the folder or one of its files cannot be read.
    """
    root = Path(folder)
    h = hashlib.sha256()
    try:
        files = sorted(f for f in root.rglob("*") if f.is_file())
        for f in files:
            h.update(f"{f.relative_to(root).as_posix()}\0{f.stat().st_size}\n".encode())
        for f in sorted(used) if used is not None else files:
            h.update(b"\0" + Path(f).resolve().relative_to(root.resolve()).as_posix().encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    h.update(chunk)
    except OSError as err:
        raise UserError(f"cannot read the calibration folder {root}: {err.strerror or err}") from None
    return h.hexdigest()


def calibration_fields(calib_dir: str | os.PathLike | None, source: Any,
                       eval_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The run record's ``calibration.folder`` (absolute) and ``calibration.folder_sha256`` of a
    calibration drawn from ``calib_dir`` (``source``: the data source; its ``files``, when it has
    them, are the images hashed), and ``calibration.eval_folder`` (absolute) of the ``--eval-data``
    folder ``eval_dir`` it was checked disjoint from; ``{}`` without folders (the model's own data)."""
    out: dict[str, Any] = {}
    if eval_dir is not None and Path(eval_dir).is_dir():
        out["eval_folder"] = str(Path(eval_dir).resolve())
    if calib_dir is None or not Path(calib_dir).is_dir():
        return out
    folder = Path(calib_dir).resolve()
    used = [Path(f).resolve() for f in source.files] if isinstance(getattr(source, "files", None), list) else None
    return {"folder": str(folder), "folder_sha256": folder_sha256(folder, used), **out}


def _builtin_copy(cal: dict, spec: Any) -> str | None:
    """The model's built-in data folder when the run's (gone) calibration folder was a copy of it (the same
    content hash), else None. Only zoo models have built-in data (Fashion-MNIST for ``fmnist-vit`` and
    ``dinov2-s14-fmnist``); a timm model's folder is the user's own."""
    entry = zoo_entry(str(getattr(spec, "name", "")))
    if entry is None or entry.dataset != "Fashion-MNIST" or not cal.get("folder_sha256"):
        return None
    try:
        builtin = fashion_mnist.dataset_dir(None)
    except UserError:  # not installed either
        return None
    return str(builtin) if folder_sha256(builtin) == cal["folder_sha256"] else None


def recorded_folder(calibration: dict | None, spec: Any, say: Callable[[str], None] = echo,
                    option: str = "--calib DIR") -> str | None:
    """The run's calibration folder when it is still there (``calibration``: the record's entry),
    else None (the run recorded none: the model's own data). Unchanged: said in one line; changed
    (another hash): said in one warning line, and used as it is now; gone: refused, unless it held
    the model's built-in data (:func:`_builtin_copy`: that folder is used, said in one line).

    Raises:
        UserError: the folder is gone (the message names ``option``, the command's way to give
            another), or it cannot be read.
    """
    cal = calibration or {}
    folder = cal.get("folder")
    if not folder:
        return None
    if not Path(folder).is_dir():
        builtin = _builtin_copy(cal, spec)
        if builtin is None:
            raise UserError(f"the run's calibration folder {folder} is gone (moved or deleted): pass {option} "
                            "(the folder the run calibrated on, or other data on purpose)")
        say(f"calibration: the run's folder {folder} is gone; it held the built-in {spec.name} data (same "
            f"content hash): using {builtin}")
        return builtin
    n, seed = cal.get("num_images") or cal.get("size_requested"), cal.get("seed") or 0
    used = None
    if not spec.is_zoo:
        files, labels, _ = list_image_folder(folder)
        used = [Path(f).resolve() for f in subset(files, labels, n, seed)[0]]
    if folder_sha256(folder, used) != cal.get("folder_sha256"):
        say(f"warning: the run's calibration folder {folder} changed since the run (another content hash); "
            "using it as it is now (--calib DIR to choose)")
    else:
        say(f"calibration: the run's folder {folder} (unchanged)")
    return str(folder)


def heldout_source(spec: Any, folder: str, n: int, seed: int, eval_size: int | None = None) -> FolderSource:
    """Unlabeled held-out images of a calibration ImageFolder: its images that the calibration of
    ``n`` images with ``seed`` did not use (at most ``eval_size``, seeded), with the model's
    preprocessing.

    Raises:
        UserError: no image left (the calibration used them all).
    """
    files, labels, _ = list_image_folder(folder)
    used = set(subset(files, labels, n, seed)[0])
    rest = [f for f in files if f not in used]
    if not rest:
        raise UserError(f"no held-out images: the calibration uses all {len(files)} images of {folder} "
                        "(a smaller --calib-size, or --eval-data DIR)")
    rest = subset(rest, [-1] * len(rest), eval_size, seed + 1)[0]
    return FolderSource(rest, [-1] * len(rest), spec.transform(),
                        f"{folder}, {len(rest)} held-out images (unlabeled, not used by the calibration)")


def recorded_eval_folder(calibration: dict | None, say: Callable[[str], None] = echo) -> str | None:
    """The ``--eval-data`` folder the run's calibration was checked disjoint from
    (``calibration.eval_folder``) when it is still there (said in one line), else None (none
    recorded, or gone: said in one line; the caller falls back to held-out images or refuses)."""
    folder = (calibration or {}).get("eval_folder")
    if not folder:
        return None
    if not Path(folder).is_dir():
        say(f"the run's evaluation folder {folder} is gone (--eval-data DIR to give one)")
        return None
    say(f"evaluation: the run's folder {folder} (its --eval-data)")
    return str(folder)


__all__ = ["calibration_fields", "folder_sha256", "heldout_source", "recorded_eval_folder", "recorded_folder"]
