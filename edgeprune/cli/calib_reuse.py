"""The calibration folder a run recorded, and its reuse by ``quantize``, ``heal`` and ``eval`` (issue 42).

``prune`` records, beside the calibration's size and seed, the folder given with ``--calib``
(``calibration.folder``, absolute) and a content hash of it (``calibration.folder_sha256``,
:func:`folder_sha256`). A later command on the run reuses the folder when it is still there and
its hash is unchanged; ``--calib`` overrides it; a changed folder is said in one line and used as it
is now; a folder that is gone is said in one line and not used.

Without labeled evaluation data, a timm run's quantized or evaluated model is compared with the
float / dense model on the folder's *held-out* images (:func:`heldout_source`: the images of the
folder that the calibration did not use), by top-1 agreement.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import click

from edgeprune.data.sources import FolderSource, list_image_folder, subset
from edgeprune.errors import UserError

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


def calibration_fields(calib_dir: str | os.PathLike | None, source: Any) -> dict[str, Any]:
    """The run record's ``calibration.folder`` (absolute) and ``calibration.folder_sha256`` of a
    calibration drawn from ``calib_dir`` (``source``: the data source; its ``files``, when it has
    them, are the images hashed); ``{}`` without a folder (the model's own data)."""
    if calib_dir is None or not Path(calib_dir).is_dir():
        return {}
    folder = Path(calib_dir).resolve()
    used = [Path(f).resolve() for f in source.files] if isinstance(getattr(source, "files", None), list) else None
    return {"folder": str(folder), "folder_sha256": folder_sha256(folder, used)}


def recorded_folder(calibration: dict | None, spec: Any, say: Callable[[str], None] = click.echo) -> str | None:
    """The run's calibration folder when it is still there (``calibration``: the record's entry),
    else None. Unchanged: said in one line; changed (another hash): said in one warning line, and
    used as it is now; gone: one line, not used.

    Raises:
        UserError: the folder cannot be read.
    """
    cal = calibration or {}
    folder = cal.get("folder")
    if not folder:
        return None
    if not Path(folder).is_dir():
        say(f"the run's calibration folder {folder} is gone (pass --calib DIR)")
        return None
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


__all__ = ["calibration_fields", "folder_sha256", "heldout_source", "recorded_folder"]
