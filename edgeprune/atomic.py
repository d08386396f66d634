"""Atomic file and directory writes: nothing a user already has is lost or half-written.

Every output goes to a temporary name in the destination's own folder (same filesystem) and is
moved into place with ``os.replace`` / ``os.rename`` only once complete; on any error, including
KeyboardInterrupt, the temporary is removed and the destination is left as it was. Temporaries
made by :mod:`tempfile` are private (0600 files, 0700 folders); the finished output gets the
permissions a plain ``open()`` / ``mkdir()`` would have given it under the current umask.

Temporaries are named ``.<dest name>.ep<host>-<pid>.<random><suffix>`` (suffix ``.tmp``) (:func:`temp_prefix`): a
process killed without a chance to clean up (SIGKILL, power loss) leaves one behind, and the next
write into the same folder removes those whose process is gone (:func:`remove_stale_temporaries`;
only this host's, only ours, never one of a live process). SIGTERM is handled like Ctrl-C by the
command line (``edgeprune.cli.main``), so the ``except BaseException`` clean-up below runs for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from edgeprune.phases import reached


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


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temp_prefix(dest: Path) -> str:
    """The prefix of ``dest``'s temporaries: ``.<name>.ep<host hash>-<pid>.`` (see module doc)."""
    return f".{dest.name}.ep{_host_tag()}-{os.getpid()}."


_TEMP = re.compile(r"\..+\.ep([0-9a-f]{8})-(\d+)\.[a-z0-9_]{8}\.[A-Za-z0-9]+")


def is_temporary(name: str) -> bool:
    """Whether a file or folder name is one of edgeprune's atomic-write temporaries (:func:`temp_prefix`)."""
    return _TEMP.fullmatch(name) is not None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def remove_stale_temporaries(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries (files and folders) that killed edgeprune processes of this host left
    in ``folder``; returns what was removed. A temporary of a live process, of another host, or not
    named by :func:`temp_prefix` is left alone; errors are ignored (it is tidying, not the write).
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    host = _host_tag()
    for e in entries:
        m = _TEMP.fullmatch(e.name)
        if m is None or m.group(1) != host or int(m.group(2)) == os.getpid() or _alive(int(m.group(2))):
            continue
        p = Path(e.path)
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
        removed.append(p)
    return removed


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
    remove_stale_temporaries(dest.parent)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(dest), suffix=suffix, dir=dest.parent)
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


#: torch dtype -> safetensors dtype name (the format's spec, safetensors/README "Format").
_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64",
}


def safetensors_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """Serialise tensors to the safetensors format, byte-identically for identical inputs.

    ``safetensors.torch.save`` keeps the metadata in a Rust ``HashMap`` whose iteration order
    changes from call to call, so two saves of the same tensors differ in their header bytes
    (issue 12, defect 7). This writer emits the same format deterministically: an 8-byte
    little-endian header length, a compact JSON header with ``__metadata__`` first (keys sorted)
    and the tensors ordered as safetensors orders them (larger element size first, then name), the
    header padded with spaces to a multiple of 8, then the raw little-endian tensor bytes.
    ``safetensors.torch.load_file`` reads the result.

    Args:
        tensors: name -> torch.Tensor (any device/layout; copied to contiguous CPU memory).
        metadata: str -> str, or None.

    Returns:
        The file contents.

    Raises:
        TypeError: a non-string metadata key/value or a dtype safetensors cannot store.
    """
    import json
    import sys

    import torch

    header: dict = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata must be str -> str, got {k!r}: {type(v).__name__}")
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    items = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: not a tensor ({type(t).__name__})")
        dtype = _ST_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise TypeError(f"{name}: safetensors cannot store dtype {t.dtype}")
        items.append((-t.element_size(), str(name), dtype, t))
    items.sort(key=lambda it: (it[0], it[1]))
    chunks: list[bytes] = []
    offset = 0
    for _, name, dtype, t in items:
        data = t.detach().to("cpu").contiguous().reshape(-1)
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        if sys.byteorder != "little" and t.element_size() > 1:  # pragma: no cover - big-endian hosts
            raw = data.numpy().byteswap().tobytes()
        header[name] = {"dtype": dtype, "shape": [int(s) for s in t.shape],
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + b"".join(chunks)


def write_safetensors(path: str | os.PathLike[str], tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """Write :func:`safetensors_bytes` to ``path`` directly (inside an :func:`atomic_dir`, say).

    Raises:
        OSError: the write failed; TypeError: see :func:`safetensors_bytes`.
    """
    data = safetensors_bytes(tensors, metadata)
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return Path(path)


def atomic_save_safetensors(dest: str | os.PathLike[str], tensors: dict, metadata: dict[str, str] | None = None
                            ) -> Path:
    """Save tensors as safetensors atomically (see :func:`atomic_path`), byte-identically for
    identical inputs (see :func:`safetensors_bytes`: sorted metadata keys, sorted tensor names,
    contiguous little-endian data).

    Args:
        tensors: name -> torch.Tensor; metadata: str -> str.

    Raises:
        OSError: the folder cannot be written (``dest`` untouched); TypeError: bad metadata/dtype.
    """
    return atomic_write_bytes(dest, safetensors_bytes(tensors, metadata))


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
    remove_stale_temporaries(dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(dest), suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        reached("saving")
        os.chmod(tmp, default_dir_mode())
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in ``chunk``-byte blocks (the one file hash of edgeprune:
    checkpoints, image overlap checks, ONNX and engine provenance).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
