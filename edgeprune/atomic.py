"""Atomic file and directory writes: nothing a user already has is lost or half-written.

Every output goes to a temporary name in the destination's own folder (same filesystem) and is
moved into place with ``os.replace`` / ``os.rename`` only once complete; on any error, including
KeyboardInterrupt, the temporary is removed and the destination is left as it was. Temporaries
made by :mod:`tempfile` are private (0600 files, 0700 folders); the finished output gets the
permissions a plain ``open()`` / ``mkdir()`` would have given it under the current umask.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file under the current umask (e.g. 0o644)."""
    return 0o666 & ~_umask()


def default_dir_mode() -> int:
    """The mode ``mkdir`` gives a new folder under the current umask (e.g. 0o755)."""
    return 0o777 & ~_umask()


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike[str], *, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary file path next to ``dest``; the file there replaces ``dest`` on a clean exit.

    The caller writes the complete output to the yielded path (any writer that takes a path:
    ``safetensors.torch.save_file``, ``matplotlib savefig``, ...). The destination's folder is
    created if needed. ``suffix`` lets writers that look at the extension (matplotlib) see the
    right one.

    Raises:
        OSError: the folder cannot be created or written; ``dest`` is untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix, dir=dest.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(dest: str | os.PathLike[str], data: bytes | bytearray | memoryview,
                       *, fsync: bool = True) -> Path:
    """Write ``data`` to ``dest`` atomically (see :func:`atomic_path`); returns ``Path(dest)``.

    Args:
        fsync: flush the file to disk before the rename, so a crash cannot leave an empty file
            under the final name (engines, checkpoints); reports may skip it.
    """
    with atomic_path(dest) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
    return Path(dest)


def atomic_write_text(dest: str | os.PathLike[str], text: str, *, fsync: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``dest`` atomically; returns ``Path(dest)``."""
    return atomic_write_bytes(dest, text.encode("utf-8"), fsync=fsync)


def atomic_save_safetensors(dest: str | os.PathLike[str], tensors: dict, metadata: dict[str, str] | None = None
                            ) -> Path:
    """``safetensors.torch.save_file(tensors, dest, metadata)`` atomically (see :func:`atomic_path`).

    Args:
        tensors: name -> contiguous torch.Tensor (no shared storage); metadata: str -> str.
    """
    from safetensors.torch import save_file

    with atomic_path(dest) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(dest)


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary folder next to ``dest``, renamed to ``dest`` on a clean exit.

    ``dest`` must not exist when the rename happens (the caller decides beforehand whether an
    existing output may be replaced and removes it). On error the temporary folder and all
    it holds are removed.

    Raises:
        FileExistsError / OSError: ``dest`` appeared meanwhile, or the folder is not writable.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        os.chmod(tmp, default_dir_mode())
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
