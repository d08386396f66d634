"""Token streams of the calibration set between blocks, in memory or spilled to disk.

A stream holds, for every calibration image, the (n, D) float32 token matrix at one depth of the
model (the input of the next block to process). Sequential calibration keeps two of them, the
dense and the pruned stream (METHODS.md §5): ``N * n * D * 4`` bytes each (e.g. 512 images of
fmnist-vit, n = 50, D = 128: 13 MB; 512 DeiT-S images at 224 px: 290 MB).

Storage is chunked by calibration batch. :class:`StreamStore` keeps chunks in memory while the
total stays under ``memory_limit_bytes`` and writes the rest to numpy memmaps in a temporary
directory (deleted by :meth:`StreamStore.close`, also on errors).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch


class StreamStore:
    """Owner of every stream chunk: the memory budget and the spill directory.

    Args:
        memory_limit_bytes: chunks beyond this total (over all streams) go to disk.
        spill_dir: parent of the temporary directory (default: the system's temp dir).

    Attributes:
        memory_bytes: bytes held in memory now; spilled_bytes: bytes written to memmaps so far.
    """

    def __init__(self, memory_limit_bytes: float, spill_dir: str | None = None) -> None:
        self.limit = float(memory_limit_bytes)
        self.memory_bytes = 0
        self.spilled_bytes = 0
        self._parent = spill_dir
        self._dir: tempfile.TemporaryDirectory | None = None
        self._files = 0

    def _path(self) -> str:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="edgeprune-streams-", dir=self._parent)
        self._files += 1
        return os.path.join(self._dir.name, f"chunk{self._files}.f32")

    def new_chunk(self, value: torch.Tensor):
        """A chunk holding a float32 copy of ``value`` (in memory if it fits, else a memmap)."""
        value = value.detach().to(torch.float32)
        nbytes = value.numel() * 4
        if self.memory_bytes + nbytes <= self.limit:
            self.memory_bytes += nbytes
            return value.clone()
        mm = np.memmap(self._path(), dtype=np.float32, mode="w+", shape=tuple(value.shape))
        mm[...] = value.numpy()
        self.spilled_bytes += nbytes
        return mm

    def close(self) -> None:
        """Delete the spill directory (idempotent)."""
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    @property
    def spill_path(self) -> str | None:
        """The temporary directory, while it exists."""
        return None if self._dir is None else self._dir.name


class Stream:
    """One stream: a list of chunks (one per calibration batch), each (B, n, D) float32."""

    def __init__(self, store: StreamStore) -> None:
        self.store = store
        self.chunks: list = []

    def append(self, value: torch.Tensor) -> None:
        """Add the next batch's tokens (B, n, D)."""
        self.chunks.append(self.store.new_chunk(value))

    def __len__(self) -> int:
        return len(self.chunks)

    def get(self, j: int) -> torch.Tensor:
        """Chunk j as a float32 tensor: the stored tensor itself when in memory (it changes with
        :meth:`set`; clone it to keep it), a copy when spilled."""
        c = self.chunks[j]
        return c if isinstance(c, torch.Tensor) else torch.from_numpy(np.array(c))

    def set(self, j: int, value: torch.Tensor) -> None:
        """Overwrite chunk j with ``value`` (same shape), in place."""
        c = self.chunks[j]
        if isinstance(c, torch.Tensor):
            c.copy_(value)
        else:
            c[...] = value.detach().to(torch.float32).numpy()

    def copy(self) -> "Stream":
        """An independent copy (same store)."""
        out = Stream(self.store)
        for j in range(len(self)):
            out.append(self.get(j))
        return out

    @property
    def num_images(self) -> int:
        return sum(int(c.shape[0]) for c in self.chunks)
