"""Data sources as NumPy arrays: what ONNX Runtime sessions take (verify, quantize, their checks)."""

from __future__ import annotations

from typing import Any

import numpy as np

from edgeprune.errors import UserError


def source_to_array(source: Any, limit: int | None = None, batch_size: int = 64
                    ) -> tuple[np.ndarray, np.ndarray | None]:
    """Materialise a data source (``batches(b)`` yielding ``(images, labels|None)``) as arrays.

    Returns:
        ``(images (N, C, H, W) float32, labels (N,) int64 or None)``.

    Raises:
        UserError: the source is empty.
    """
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    labeled = True
    total = 0
    for x, y in source.batches(batch_size):
        xs.append(np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=np.float32))
        if y is None:
            labeled = False
        else:
            ys.append(np.asarray(y.cpu().numpy() if hasattr(y, "cpu") else y, dtype=np.int64))
        total += len(xs[-1])
        if limit is not None and total >= limit:
            break
    if not xs:
        raise UserError(f"no images in {getattr(source, 'description', 'the data source')}")
    images = np.concatenate(xs)[:limit]
    labels = np.concatenate(ys)[:limit] if labeled and ys else None
    if labels is not None and (labels < 0).any():
        labels = None
    return images, labels
