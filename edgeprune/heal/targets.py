"""Calibration images and the dense model's block-output targets for STARFISH healing.

STARFISH (starfish §3.2) runs the dense model once over the calibration set and caches every
block's output; the pruned model is then trained towards those targets. Two providers:

* :class:`DenseTargets` (default) -- recompute the dense block outputs batch by batch, in the same
  shuffled order the trainer asks for. Memory: one batch of targets; cost: one dense forward per
  image per epoch.
* :class:`DiskTargetCache` -- one dense pass writes the targets to ``safetensors`` shards in a
  directory (each shard written atomically, a ``manifest.json`` last), later epochs -- and later
  heals of *other* pruned runs of the same dense model on the same calibration set -- read them
  back. The cache is keyed by a fingerprint of the dense weights and the calibration images; a
  mismatching cache is refused, a half-built one is completed. The memory held for targets never
  exceeds ``memory_budget_mb``: a shard holds at most half the budget while building; for
  training, the shards are loaded into memory only if all of them fit in the budget, otherwise the
  rows of each batch are read from disk (plain seeks and reads, no memory map) and freed after use.

Devices: both run the dense model on the device its parameters are on (the trainer moves it to
``HealConfig.device``); images are moved there batch by batch. :class:`DenseTargets` returns the
targets on that device; :class:`DiskTargetCache` copies them to host memory as they are made and
always returns host (CPU) tensors -- the cache, resident or not, lives on the host, never in GPU
memory -- and the trainer moves each batch's rows to the device.

:class:`CalibrationSet` gives random access to the calibration images (the trainer shuffles): an
in-memory tensor / :class:`~edgeprune.data.sources.TensorSource`, a lazily decoded
:class:`~edgeprune.data.sources.FolderSource`, or any source with ``batches()`` (materialised).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load_file

from edgeprune.anatomy import find_anatomy
from edgeprune.atomic import atomic_save_safetensors, atomic_write_text
from edgeprune.errors import UserError
from edgeprune.heal.alignment import BlockCapture
from edgeprune.progress import progress as progress_bar

CACHE_FORMAT = "edgeprune-heal-targets/1"
MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"
DEFAULT_MEMORY_BUDGET_MB = 1024


# ---- fingerprints ---------------------------------------------------------------------------------
def _update_tensor(h: "hashlib._Hash", t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(str((tuple(t.shape), str(t.dtype))).encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool
                 else t.numpy().tobytes())


def state_fingerprint(model: nn.Module) -> str:
    """sha256 (hex, 16 chars) over a model's state dict: names, shapes, dtypes and bytes."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        _update_tensor(h, t)
    return h.hexdigest()[:16]


def model_device(model: nn.Module) -> torch.device:
    """The device of a model's first parameter (CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


# ---- calibration images ---------------------------------------------------------------------------
class CalibrationSet:
    """Random access to unlabeled calibration images.

    Args:
        calibration: a tensor (N, C, H, W); a source with ``.images`` (``TensorSource``); a
            ``FolderSource`` (decoded lazily, per batch); any object with ``batches(batch_size)``
            yielding ``(images, labels)`` or images; or a callable returning an iterable of
            batches. The last two are materialised into one tensor.

    Raises:
        UserError: unsupported type, or an empty calibration set.
    """

    def __init__(self, calibration: Any) -> None:
        self.images: torch.Tensor | None = None
        self._files: list[Any] = []
        self._load: Callable[[Any], torch.Tensor] | None = None
        self.description = getattr(calibration, "description", None)
        if isinstance(calibration, torch.Tensor):
            self.images = calibration
            self.description = self.description or f"tensor {tuple(calibration.shape)}"
        elif isinstance(getattr(calibration, "images", None), torch.Tensor):
            self.images = calibration.images
        elif hasattr(calibration, "files") and callable(getattr(calibration, "_load", None)):
            self._files = list(calibration.files)
            self._load = calibration._load
        elif hasattr(calibration, "batches") or callable(calibration):
            it = calibration.batches(256) if hasattr(calibration, "batches") else calibration()
            chunks = [b[0] if isinstance(b, (tuple, list)) else b for b in it]
            self.images = torch.cat(chunks) if chunks else torch.empty(0)
            self.description = self.description or "custom iterable"
        else:
            raise UserError("calibration must be a tensor, a data source or a callable returning batches")
        if len(self) == 0:
            raise UserError("the calibration set is empty")
        if self.images is not None and self.images.dim() != 4:
            raise UserError(f"calibration images must be (N, C, H, W), got {tuple(self.images.shape)}")
        self.description = self.description or type(calibration).__name__

    def __len__(self) -> int:
        return len(self.images) if self.images is not None else len(self._files)

    def get(self, indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Images at ``indices`` as one float32 batch (B, C, H, W)."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self.images is not None:
            return self.images[idx].float()
        assert self._load is not None
        return torch.stack([self._load(self._files[int(i)]) for i in idx]).float()

    def fingerprint(self) -> str:
        """sha256 (hex, 16 chars) of the images (tensors) or of the file list with sizes and
        modification times (folders)."""
        h = hashlib.sha256()
        if self.images is not None:
            _update_tensor(h, self.images.float())
        else:
            for f in self._files:
                st = Path(f).stat()
                h.update(f"{Path(f).resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        return h.hexdigest()[:16]


# ---- dense targets, on the fly --------------------------------------------------------------------
class DenseTargets:
    """Dense block outputs computed batch by batch (no cache), on the dense model's device.

    Args:
        dense: the dense model (eval mode; its parameters are not touched).
    """

    kind = "on-the-fly"

    def __init__(self, dense: nn.Module) -> None:
        self.dense = dense
        self.capture = BlockCapture(find_anatomy(dense))

    @torch.no_grad()
    def get(self, indices: torch.Tensor, images: torch.Tensor) -> list[torch.Tensor]:
        """The L dense block outputs (B, N, D) for ``images`` (``indices`` unused), on the dense
        model's device (``images`` are moved there)."""
        del indices
        return [t.detach() for t in self.capture.run(images.to(model_device(self.dense)))]

    def close(self) -> None:
        self.capture.remove()

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}


# ---- dense targets, disk cache --------------------------------------------------------------------
def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """safetensors header (dict) and the byte offset where tensor data starts."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise UserError(f"{path} is not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise UserError(f"{path} is not a safetensors file")
        try:
            header = json.loads(fh.read(n))
        except json.JSONDecodeError:
            raise UserError(f"{path} has a corrupt safetensors header") from None
    return header, 8 + n


class DiskTargetCache:
    """Dense block-output targets in ``safetensors`` shards under ``directory``.

    Layout: ``shard-NNNNN.safetensors`` with one tensor ``block.<l>`` (count, N, D) float32 per
    block, for images ``start .. start+count-1`` of the calibration set (in its own order); shard
    metadata holds the fingerprint, start and count. ``manifest.json`` (written last) lists the
    shards. Call :meth:`prepare` before :meth:`get`.

    Args:
        directory: the cache directory (created if missing).
        memory_budget_mb: the most memory (MiB) held for targets at any time (see module doc).
    """

    kind = "disk-cache"

    def __init__(self, directory: str | os.PathLike, memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB) -> None:
        if memory_budget_mb is None or memory_budget_mb <= 0:
            raise UserError(f"--memory-budget-mb must be > 0, got {memory_budget_mb}")
        self.dir = Path(directory)
        self.budget = int(memory_budget_mb * 2 ** 20)
        self.manifest: dict[str, Any] | None = None
        self._resident: list[torch.Tensor] | None = None  # whole cache in memory, per block
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}
        self.built_shards = 0
        self.reused = False

    # -- building ---------------------------------------------------------------------------------
    def prepare(self, dense: nn.Module, calib: CalibrationSet, batch_size: int = 32,
                progress: bool = False) -> None:
        """Make sure the cache holds the dense targets of ``calib``; compute what is missing.

        The dense forward passes run on the device of ``dense``'s parameters (images moved there
        batch by batch); the targets are copied to host memory as they are made.

        Raises:
            UserError: the directory holds a cache of another model / calibration set, or is not a
                directory.
        """
        if self.dir.exists() and not self.dir.is_dir():
            raise UserError(f"target cache {self.dir} exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        anatomy = find_anatomy(dense)
        dev = model_device(dense)
        fingerprint = f"{state_fingerprint(dense)}-{calib.fingerprint()}-{len(calib)}"
        n = len(calib)
        # probe one image for the token shape
        with torch.no_grad(), BlockCapture(anatomy) as cap:
            probe = cap.run(calib.get([0]).to(dev))
        num_blocks = len(probe)
        token_shape = list(probe[0].shape[1:])
        per_image = num_blocks * int(np.prod(token_shape)) * 4
        mpath = self.dir / MANIFEST
        if mpath.is_file():
            try:
                manifest = json.loads(mpath.read_text())
            except json.JSONDecodeError:
                raise UserError(f"target cache {self.dir}: corrupt {MANIFEST}; delete the directory") from None
            if manifest.get("format") != CACHE_FORMAT or manifest.get("fingerprint") != fingerprint:
                raise UserError(f"target cache {self.dir} holds targets of a different dense model or "
                                "calibration set; use another --cache-targets directory or delete it")
            if all((self.dir / s["file"]).is_file() for s in manifest["shards"]):
                self.manifest, self.reused = manifest, True
                self._maybe_load_resident(per_image)
                return
        shard_images = max(1, (self.budget // 2) // per_image)
        shards: list[dict[str, Any]] = [
            {"file": SHARD_PATTERN.format(i), "start": s, "count": min(shard_images, n - s)}
            for i, s in enumerate(range(0, n, shard_images))]
        todo = []
        for s in shards:
            p = self.dir / s["file"]
            if p.is_file():
                meta = _read_header(p)[0].get("__metadata__", {})
                if meta.get("fingerprint") == fingerprint and int(meta.get("start", -1)) == s["start"] \
                        and int(meta.get("count", -1)) == s["count"]:
                    continue  # built by an earlier, interrupted run
                if meta.get("fingerprint") != fingerprint:
                    raise UserError(f"target cache {self.dir} holds targets of a different dense model or "
                                    "calibration set; use another --cache-targets directory or delete it")
            todo.append(s)
        bar = progress_bar(None, "dense targets", enabled=progress, total=sum(s["count"] for s in todo),
                           unit="img")
        with torch.no_grad(), BlockCapture(anatomy) as cap:
            for s in todo:
                bufs = [torch.empty(s["count"], *token_shape) for _ in range(num_blocks)]
                for j in range(0, s["count"], batch_size):
                    m = min(batch_size, s["count"] - j)
                    outs = cap.run(calib.get(torch.arange(s["start"] + j, s["start"] + j + m)).to(dev))
                    for b, o in zip(bufs, outs):
                        b[j:j + m] = o.to("cpu", torch.float32)
                    bar.update(m)
                atomic_save_safetensors(
                    self.dir / s["file"], {f"block.{l}": b for l, b in enumerate(bufs)},
                    {"fingerprint": fingerprint, "start": str(s["start"]), "count": str(s["count"]),
                     "format": CACHE_FORMAT})
                del bufs
                self.built_shards += 1
        bar.close()
        manifest = {"format": CACHE_FORMAT, "fingerprint": fingerprint, "num_images": n,
                    "num_blocks": num_blocks, "token_shape": token_shape, "dtype": "float32",
                    "bytes_per_image": per_image, "shards": shards,
                    "calibration": calib.description}
        atomic_write_text(mpath, json.dumps(manifest, indent=2) + "\n")
        self.manifest = manifest
        self._maybe_load_resident(per_image)

    def _maybe_load_resident(self, per_image: int) -> None:
        m = self.manifest
        assert m is not None
        if per_image * m["num_images"] > self.budget:
            self._resident = None
            return
        parts: list[list[torch.Tensor]] = [[] for _ in range(m["num_blocks"])]
        for s in m["shards"]:
            sd = load_file(str(self.dir / s["file"]))
            for l in range(m["num_blocks"]):
                parts[l].append(sd[f"block.{l}"])
        self._resident = [torch.cat(p) for p in parts]

    # -- reading ----------------------------------------------------------------------------------
    @property
    def resident(self) -> bool:
        """Whether the whole cache is held in memory (it fits the budget)."""
        return self._resident is not None

    def _rows_from_disk(self, indices: torch.Tensor) -> list[torch.Tensor]:
        m = self.manifest
        assert m is not None
        token_shape = m["token_shape"]
        row_elems = int(np.prod(token_shape))
        out = [torch.empty(len(indices), *token_shape) for _ in range(m["num_blocks"])]
        starts = [s["start"] for s in m["shards"]]
        by_file: dict[str, list[tuple[int, int]]] = {}
        for pos, i in enumerate(indices.tolist()):
            k = int(np.searchsorted(starts, i, side="right")) - 1
            s = m["shards"][k]
            by_file.setdefault(s["file"], []).append((pos, i - s["start"]))
        for fname, rows in by_file.items():
            path = self.dir / fname
            if fname not in self._headers:
                self._headers[fname] = _read_header(path)
            header, data_start = self._headers[fname]
            with open(path, "rb") as fh:
                for l in range(m["num_blocks"]):
                    info = header[f"block.{l}"]
                    if info["dtype"] != "F32" or list(info["shape"][1:]) != list(token_shape):
                        raise UserError(f"target cache {path}: unexpected tensor block.{l} {info}")
                    base = data_start + info["data_offsets"][0]
                    for pos, r in rows:
                        fh.seek(base + r * row_elems * 4)
                        buf = fh.read(row_elems * 4)
                        if len(buf) != row_elems * 4:
                            raise UserError(f"target cache {path} is truncated; delete the directory")
                        out[l][pos] = torch.frombuffer(bytearray(buf), dtype=torch.float32).reshape(token_shape)
        return out

    def get(self, indices: torch.Tensor, images: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The L cached dense block outputs (B, N, D) of calibration images ``indices`` (host
        memory, float32)."""
        del images
        if self.manifest is None:
            raise RuntimeError("DiskTargetCache.prepare() was not called")
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self._resident is not None:
            return [t[idx] for t in self._resident]
        return self._rows_from_disk(idx)

    def close(self) -> None:
        self._resident = None
        self._headers = {}

    def describe(self) -> dict[str, Any]:
        m = self.manifest or {}
        return {"kind": self.kind, "dir": str(self.dir), "reused": self.reused,
                "shards": len(m.get("shards", [])), "bytes": m.get("bytes_per_image", 0) * m.get("num_images", 0),
                "resident": self.resident, "memory_budget_mb": self.budget / 2 ** 20}


def make_targets(dense: nn.Module, calib: CalibrationSet, target_cache: Any = None,
                 memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB, batch_size: int = 32,
                 progress: bool = False):
    """The target provider: :class:`DenseTargets` when ``target_cache`` is None, else a prepared
    :class:`DiskTargetCache` (``target_cache`` is its directory, or a ``DiskTargetCache``)."""
    if target_cache is None:
        return DenseTargets(dense)
    cache = (target_cache if isinstance(target_cache, DiskTargetCache)
             else DiskTargetCache(target_cache, memory_budget_mb))
    cache.prepare(dense, calib, batch_size=batch_size, progress=progress)
    return cache


def iter_batches(n: int, batch_size: int, order: torch.Tensor | None = None) -> Iterable[torch.Tensor]:
    """Index batches over ``range(n)`` (or over ``order``), the last one possibly smaller."""
    order = torch.arange(n) if order is None else order
    for i in range(0, n, batch_size):
        yield order[i:i + batch_size]
