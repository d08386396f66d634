"""Activation statistics on calibration images, gathered in one streaming pass: the one statistics pass.

Both int8 recipes read their activation statistics here. The TensorRT recipe
(``exporters.quantization.recipe_tensorrt``, :func:`gemm_input_stats`) needs, for every activation
tensor a GEMM reads: its per-tensor max ``|x|`` (the MinMax range), its per-channel max ``|x_j|``
over the last axis (SmoothQuant's ``max|X_j|``), a uniform random sample of its rows (tokens) to
measure a GEMM's output error under a candidate scale or clipping range without keeping every token
of every image (DINOv2 ViT-S/14 at 224 px: ~2.8 MB per block and image), and for GPTQ the Gram
matrix ``X^T X``. The ONNX Runtime recipe's ``--smooth-alpha`` (``exporters.quantization.smoothing.
smooth_onnx``) needs the per-channel max of the LayerNorm outputs only (``rows=0``). The tensors
are exposed as extra graph outputs of the float model and read with ONNX Runtime; the batches come
from the one calibration reader (:class:`exporters.quantization.calibration.ArrayCalibrationReader`,
which also pads the last batch of a fixed-batch model; the padding is dropped before the
statistics).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from exporters.ort_session import import_onnxruntime
from exporters.quantization.calibration import ArrayCalibrationReader


@dataclasses.dataclass
class ActStats:
    """Statistics of some activation tensors over the calibration images.

    Attributes:
        amax: tensor -> max ``|x|`` over all images and positions (float).
        chan_amax: tensor -> (C,) max ``|x_j|`` per last-axis channel (float64; of a 4-D NCHW
            feature map that is the width axis: meaningful for channels-last tensors only).
        rows: tensor -> (R, C) float32 sample of rows (all leading axes flattened), uniform over
            images and tokens (only tensors of rank <= 3: token activations, not images).
        shapes: tensor -> shape of the tensor for one image (leading axis 1).
        n_images: calibration images seen.
        gram: tensor -> (C, C) float64 Gram matrix ``X^T X`` over *every* row of every image
            (token activations only; filled when ``collect_stats(gram=True)``): the ``H`` of GPTQ
            weight rounding (``exporters.quantization.weight_rounding``).
    """

    amax: dict[str, float]
    chan_amax: dict[str, np.ndarray]
    rows: dict[str, np.ndarray]
    shapes: dict[str, tuple[int, ...]]
    n_images: int
    gram: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def rescale(self, tensor: str, s: np.ndarray) -> None:
        """Record that ``tensor`` is now ``x / s`` (per last-axis channel): a folded smoothing."""
        self.chan_amax[tensor] = self.chan_amax[tensor] / s
        self.amax[tensor] = float(self.chan_amax[tensor].max())
        if tensor in self.rows:
            self.rows[tensor] = (self.rows[tensor] / s.astype(np.float32)).astype(np.float32)
        if tensor in self.gram:
            s64 = np.asarray(s, dtype=np.float64)
            self.gram[tensor] = self.gram[tensor] / np.outer(s64, s64)

    def alias(self, tensor: str, new: str, s: np.ndarray) -> None:
        """Record a new tensor ``new = tensor / s`` (an explicit per-channel scale node): its
        statistics are ``tensor``'s, rescaled."""
        self.chan_amax[new] = self.chan_amax[tensor].copy()
        self.amax[new] = self.amax[tensor]
        if tensor in self.rows:
            self.rows[new] = self.rows[tensor].copy()
        if tensor in self.gram:
            self.gram[new] = self.gram[tensor].copy()
        if tensor in self.shapes:
            self.shapes[new] = self.shapes[tensor]
        self.rescale(new, s)


def collect_stats(model: Any, tensors: Sequence[str], images: np.ndarray, *, batch_size: int = 8,
                  rows: int = 2048, seed: int = 0, threads: int | None = None, gram: bool = False) -> ActStats:
    """Run the float ``model`` (path or ``ModelProto``) on ``images`` (N, C, H, W) and gather
    :class:`ActStats` of ``tensors``.

    Args:
        rows: rows sampled per tensor over the whole set (about ``rows / N`` per image).
        seed: seed of the row sampling.
        gram: also accumulate every token tensor's Gram matrix ``X^T X`` (float64; C x C per
            tensor: 19 MB for a 1536-wide MLP input).

    Raises:
        onnxruntime errors: a model ONNX Runtime cannot load (callers pass exported models).
    """
    import onnx

    m = onnx.load(str(model)) if isinstance(model, (str, Path)) else _copy(model)
    have = {o.name for o in m.graph.output}
    names = list(dict.fromkeys(tensors))
    for name in names:
        if name not in have:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    sess = session_from_proto(m, threads)
    del m
    first = sess.get_inputs()[0]
    fixed = first.shape[0] if isinstance(first.shape[0], int) and first.shape[0] > 0 else None
    reader = ArrayCalibrationReader(images, first.name, fixed or batch_size, fixed_batch=bool(fixed))
    rng = np.random.default_rng(seed)
    n = len(images)
    stats = ActStats({}, {}, {}, {}, n)
    sampled: dict[str, list[np.ndarray]] = {t: [] for t in names}
    start = 0
    while (feed := reader.get_next()) is not None:
        b = min(reader.batch_size, n - start)  # real images in the batch (the rest: padding repeats)
        start += reader.batch_size
        for name, value in zip(names, sess.run(names, feed)):
            value = value[:b] if fixed and len(value) == fixed else value
            _update(stats, sampled, name, value, b, rows, n, rng, gram)
    for name, parts in sampled.items():
        if parts:
            stats.rows[name] = np.concatenate(parts)[:rows]
    return stats


def _update(stats: ActStats, sampled: dict[str, list[np.ndarray]], name: str, value: np.ndarray, b: int,
            rows: int, n: int, rng: np.random.Generator, gram: bool = False) -> None:
    v = np.asarray(value, dtype=np.float32)
    stats.shapes.setdefault(name, (1, *v.shape[1:]))
    flat = v.reshape(-1, v.shape[-1])
    ch = np.abs(flat).max(axis=0).astype(np.float64)
    stats.chan_amax[name] = ch if name not in stats.chan_amax else np.maximum(stats.chan_amax[name], ch)
    if v.ndim == 4:  # an image / feature map: per-tensor range, no rows, no Gram (channels on axis 1)
        stats.amax[name] = max(stats.amax.get(name, 0.0), float(np.abs(v).max()))
        return
    stats.amax[name] = float(stats.chan_amax[name].max())
    if gram:  # float32 product per batch, float64 sum over batches
        g = (flat.T @ flat).astype(np.float64)
        stats.gram[name] = g if name not in stats.gram else stats.gram[name] + g
    take = min(len(flat), int(np.ceil(rows * b / max(1, n))))
    if take:
        sampled[name].append(flat[rng.choice(len(flat), size=take, replace=False)].copy())


def session_from_proto(model: Any, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session of an in-memory ``ModelProto`` (all graph optimisations,
    ``threads`` intra-op threads, ORT's default when None)."""
    ort = import_onnxruntime()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.inter_op_num_threads = 1
    if threads:
        so.intra_op_num_threads = int(threads)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _copy(model: Any) -> Any:
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def gemm_input_stats(model: Any, calib: np.ndarray, gemms: Sequence[Any], *, rows: int = 1024,
                     batch_size: int = 8, threads: int | None = None, gram: bool = False) -> ActStats:
    """:func:`collect_stats` of every GEMM input of ``model`` (``gemms``: ``exporters.quantization.qdq.GemmNode``;
    ``gram``: also the inputs' Gram matrices, for GPTQ rounding), with the TensorRT recipe's row sample."""
    return collect_stats(model, [g.x for g in gemms], calib, batch_size=batch_size, rows=rows, threads=threads,
                         gram=gram)
