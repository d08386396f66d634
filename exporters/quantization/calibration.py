"""Calibration data for ONNX Runtime static quantization: the one interface between data and quantizer.

The int8 calibration set is the same one ``edgeprune prune`` used: the model spec's
``calibration_source(n, seed=..., data=...)`` (``edgeprune.zoo.registry.ModelSpec``), with ``n`` and
``seed`` taken from the run record that the exporter stored in the ONNX metadata (key
``calibration``: ``num_images``, ``seed``) unless overridden. The images come out of the source
already preprocessed (the spec's resize / crop / mean / std), so the quantizer sees exactly what
the deployed model will see. Evaluation images come from ``eval_source`` (the Fashion-MNIST test
split for ``fmnist-vit``, ``--eval-data`` for timm models, checked disjoint from the calibration
folder), never from the calibration set.

:class:`ArrayCalibrationReader` feeds a materialised (N, C, H, W) float32 array to
``onnxruntime.quantization.quantize_static`` in batches; :func:`calibration_sha256` fingerprints it
(recorded in the quantized file's metadata).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from edgeprune.errors import UserError
from exporters.arrays import source_to_array  # noqa: F401  (handed on: quantize, benchmarks)
from edgeprune.zoo.registry import spec_from_record

class ArrayCalibrationReader(CalibrationDataReader):
    """Yields ``{input_name: (B, C, H, W) float32}`` batches of a calibration array.

    Args:
        images: (N, C, H, W) float32, preprocessed.
        input_name: the ONNX graph input.
        batch_size: images per batch; for a model with a fixed batch size pass that size
            (``fixed_batch=True``): the last partial batch is then padded by repeating its last
            image (repeats do not change min/max ranges; they add weight to one image in the
            histogram methods).

    Raises:
        UserError: an empty or mis-shaped array.
    """

    def __init__(self, images: np.ndarray, input_name: str = "input", batch_size: int = 32,
                 fixed_batch: bool = False) -> None:
        if images.ndim != 4 or images.shape[0] == 0:
            raise UserError(f"calibration images must be a non-empty (N, C, H, W) array, got {images.shape}")
        self.images = np.ascontiguousarray(images, dtype=np.float32)
        self.input_name = input_name
        self.batch_size = max(1, int(batch_size))
        self.fixed_batch = fixed_batch
        self._next = 0
        self._end = len(self.images)

    def __len__(self) -> int:
        """Number of batches."""
        return -(-len(self.images) // self.batch_size)

    def set_range(self, start_index: int, end_index: int) -> None:
        """Give out only batches ``start_index .. end_index - 1`` (batch indices; ONNX Runtime's
        chunked calibration, ``CalibStridedMinMax``, calls this once per chunk)."""
        self._next = max(0, int(start_index)) * self.batch_size
        self._end = min(len(self.images), max(0, int(end_index)) * self.batch_size)

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next batch, or ``None`` when all images (of the range) were given out."""
        start = self._next
        if start >= self._end:
            return None
        self._next = start + self.batch_size
        part = self.images[start:start + self.batch_size]
        if self.fixed_batch and len(part) < self.batch_size:
            part = np.concatenate([part, np.repeat(part[-1:], self.batch_size - len(part), axis=0)])
        return {self.input_name: part}

    def rewind(self) -> None:
        """Start again from the first image (the whole array)."""
        self._next = 0
        self._end = len(self.images)


def calibration_sha256(images: np.ndarray) -> str:
    """SHA-256 over the shape and the float32 bytes (C order) of the calibration array (hex)."""
    arr = np.ascontiguousarray(images, dtype="<f4")
    h = hashlib.sha256()
    h.update(repr(tuple(arr.shape)).encode())
    h.update(arr.tobytes())
    return h.hexdigest()


def spec_from_metadata(meta: Mapping[str, Any]):
    """The :class:`~edgeprune.zoo.registry.ModelSpec` named by an exported file's ``base_model``.

    Returns:
        The spec, or ``None`` when the file does not say which model it is (not an edgeprune export).

    Raises:
        UserError: the recorded name is not a known model.
    """
    base = meta.get("base_model")
    if not isinstance(base, Mapping) or not base.get("name"):
        return None
    return spec_from_record(dict(base))


def recorded_calibration(meta: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(num_images, seed)`` of the run's own calibration set, from the ``calibration`` metadata."""
    cal = meta.get("calibration")
    if not isinstance(cal, Mapping):
        return None, None
    n = cal.get("num_images", cal.get("size_requested"))
    seed = cal.get("seed")
    return (int(n) if isinstance(n, (int, float)) else None,
            int(seed) if isinstance(seed, (int, float)) else None)


def calibration_for(meta: Mapping[str, Any], size: int | None = None, seed: int | None = None,
                    data: str | None = None, eval_data: str | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """The calibration images of an exported model, as ``prune`` would pick them.

    Args:
        meta: the exported file's decoded metadata (``exporters.onnx.read_metadata``).
        size, seed: override the recorded set size / seed (defaults: the run record's, else
            the model's default size and seed 0).
        data: calibration directory (Fashion-MNIST idx dir for fmnist-vit, ImageFolder for timm
            models); ``eval_data``: the evaluation folder, checked disjoint (timm models).

    Returns:
        ``(images (N, C, H, W) float32, info)`` with ``info`` = ``{"source", "num_images", "seed",
        "sha256"}``.

    Raises:
        UserError: the file names no known model, missing data, overlap with evaluation images.
    """
    spec = spec_from_metadata(meta)
    if spec is None:
        raise UserError("no calibration data: the ONNX file does not name an edgeprune model "
                        "(export it with `edgeprune export`, or quantize the run directory)")
    rec_n, rec_seed = recorded_calibration(meta)
    n = size if size is not None else (rec_n or spec.default_calib_size)
    s = seed if seed is not None else (rec_seed if rec_seed is not None else 0)
    if n < 1:
        raise UserError(f"--calib-size must be >= 1, got {n}")
    source = spec.calibration_source(n, seed=s, data=data, eval_data=eval_data)
    images, _ = source_to_array(source)
    want = tuple(spec.input_size)
    if tuple(images.shape[1:]) != want:
        raise UserError(f"calibration images are {tuple(images.shape[1:])}, the model takes {want}")
    return images, {"source": getattr(source, "description", str(data)), "num_images": int(len(images)),
                    "seed": s, "sha256": calibration_sha256(images)}


def eval_for(meta: Mapping[str, Any], size: int, data: str | None = None):
    """The held-out evaluation source of an exported model (``ModelSpec.eval_source``), or ``None``
    when the file names no known model.

    Raises:
        UserError: missing evaluation data for a model that needs ``--eval-data``.
    """
    spec = spec_from_metadata(meta)
    if spec is None:
        return None
    return spec.eval_source(data, n=size)
