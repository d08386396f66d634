"""SmoothQuant scale migration on an exported ONNX graph, before int8 quantization.

Why
---
Per-tensor int8 activations lose the small channels of a tensor that has a few huge ones. After a
LayerNorm, pretrained ViTs (DINOv2 especially) carry such outlier channels: the LayerNorm's
affine weight ``gamma_j`` is tens of times larger in a few channels ``j``. SmoothQuant (Xiao et
al., 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models", eq. 4) divides activation channel ``j`` by ``s_j`` and multiplies row ``j`` of the next
weight by ``s_j``; the product is unchanged in exact arithmetic, and the activation's range is
flattened at the price of a (per-channel-quantized, hence cheap) wider weight range::

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)        (eq. 4; alpha = 0.5 as in the paper)

Where it applies
----------------
Only where the division can be folded into constants, so the graph keeps its nodes and ops
(nothing is inserted; TensorRT and ONNX Runtime see the same graph with other numbers):
a ``LayerNormalization`` whose scale (and bias) are initializers used by no other node, and whose
output is read only by ``MatMul`` nodes with an initializer weight ``(C, out)`` as second input
(the fused ``qkv`` and ``fc1`` projections of a ViT block) or by value-independent ops
(``Shape``). ``gamma_j``, ``beta_j`` are divided by ``s_j`` and row ``j`` of every consuming
weight is multiplied by ``s_j``. ``max|X_j|`` is the largest magnitude of channel ``j`` (last
axis) over the calibration images and tokens, measured with ONNX Runtime on the float graph.

The float model's outputs change only by rounding (tested: relative error ~1e-6).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeprune.errors import UserError

#: Consumers of a LayerNorm output that read only its shape, never its values.
_SHAPE_ONLY_OPS = ("Shape",)
#: Bounds on s_j: a channel that is (numerically) zero everywhere must not blow up its weight row.
_S_MIN, _S_MAX = 1e-4, 1e4


@dataclass(frozen=True)
class SmoothSite:
    """One LayerNorm -> MatMul(s) pair that can be smoothed.

    Attributes:
        norm: the LayerNormalization node name; ``output``: its output tensor (the activation X).
        scale, bias: initializer names of gamma and beta (``bias`` None when absent).
        weights: initializer names of the consuming MatMuls' (C, out) weights.
    """

    norm: str
    output: str
    scale: str
    bias: str | None
    weights: tuple[str, ...]


def find_sites(model: Any) -> list[SmoothSite]:
    """The LayerNorm -> MatMul pairs of an ONNX ``ModelProto`` where smoothing folds into constants
    (see the module docstring for the rule), in graph order."""
    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, list[Any]] = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    graph_outputs = {o.name for o in model.graph.output}
    sites: list[SmoothSite] = []
    for node in model.graph.node:
        if node.op_type != "LayerNormalization" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        scale = node.input[1]
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        if bias is not None and bias not in inits:
            continue
        if any(len(consumers[p]) != 1 for p in (scale, bias) if p is not None):
            continue  # gamma / beta shared with another node: cannot rescale them for this one alone
        out = node.output[0]
        readers = consumers[out]
        weights: list[str] = []
        ok = out not in graph_outputs and bool(readers)
        for r in readers:
            if r.op_type in _SHAPE_ONLY_OPS:
                continue
            if (r.op_type == "MatMul" and r.input[0] == out and r.input[1] in inits
                    and len(inits[r.input[1]].dims) == 2 and len(consumers[r.input[1]]) == 1):
                weights.append(r.input[1])
            else:
                ok = False
        if ok and weights:
            sites.append(SmoothSite(node.name, out, scale, bias, tuple(weights)))
    return sites


def activation_absmax(model_path: Path, outputs: list[str], images: np.ndarray, batch_size: int = 32,
                      threads: int | None = None) -> dict[str, np.ndarray]:
    """Per-channel max |x| of the named tensors over ``images`` (N, C, H, W) float32.

    The tensors are exposed as extra graph outputs of a temporary copy (ONNX Runtime CPU).

    Returns:
        ``{name: (C,) float64}``, C = the tensor's last axis.
    """
    import onnx
    import onnxruntime as ort

    m = onnx.load(str(model_path))
    have = {o.name for o in m.graph.output}
    for name in outputs:
        if name not in have:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = int(threads)
    opts.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    del m
    in_name = sess.get_inputs()[0].name
    fixed = sess.get_inputs()[0].shape[0]
    step = fixed if isinstance(fixed, int) and fixed > 0 else max(1, int(batch_size))
    amax: dict[str, np.ndarray] = {}
    for i in range(0, len(images), step):
        x = np.ascontiguousarray(images[i:i + step], dtype=np.float32)
        if len(x) < step and isinstance(fixed, int) and fixed > 0:
            x = np.concatenate([x, np.repeat(x[-1:], step - len(x), axis=0)])
        for name, value in zip(outputs, sess.run(outputs, {in_name: x})):
            a = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0).astype(np.float64)
            amax[name] = a if name not in amax else np.maximum(amax[name], a)
    return amax


def smoothing_scales(x_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's per-channel factors ``s = x^alpha / w^(1 - alpha)`` (eq. 4), clipped to
    [1e-4, 1e4]; channels with a zero activation or weight range get 1.

    Args:
        x_absmax: (C,) max |X_j| over the calibration set; ``w_absmax``: (C,) max_k |W_jk| over
            every consuming weight; ``alpha`` in [0, 1].
    """
    x = np.asarray(x_absmax, dtype=np.float64)
    w = np.asarray(w_absmax, dtype=np.float64)
    s = np.ones_like(x)
    ok = (x > 0) & (w > 0)
    s[ok] = x[ok] ** alpha / w[ok] ** (1.0 - alpha)
    return np.clip(s, _S_MIN, _S_MAX)


def site_weight_absmax(inits: dict[str, Any], site: SmoothSite) -> np.ndarray:
    """(C,) max over every consuming weight of ``max_k |W_jk|`` (row j = input channel j)."""
    from onnx import numpy_helper

    ws = [np.abs(numpy_helper.to_array(inits[name])).max(axis=1) for name in site.weights]
    return np.max(np.stack(ws), axis=0).astype(np.float64)


def fold_site(inits: dict[str, Any], site: SmoothSite, s: np.ndarray) -> None:
    """Fold the per-channel factors ``s`` (C,) into one site, editing the initializers in place:
    ``gamma / s``, ``beta / s`` and row ``j`` of every consuming weight times ``s_j``. The
    LayerNorm's output becomes ``x / s`` and every product ``(x / s) (s W) = x W`` is unchanged."""
    from onnx import numpy_helper

    gamma = numpy_helper.to_array(inits[site.scale])
    inits[site.scale].CopyFrom(numpy_helper.from_array((gamma / s).astype(gamma.dtype), site.scale))
    if site.bias is not None:
        beta = numpy_helper.to_array(inits[site.bias])
        inits[site.bias].CopyFrom(numpy_helper.from_array((beta / s).astype(beta.dtype), site.bias))
    for name in site.weights:
        w = numpy_helper.to_array(inits[name])
        inits[name].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(w.dtype), name))


def smooth_onnx(src: Path, dst: Path, images: np.ndarray, alpha: float = 0.5, batch_size: int = 32,
                threads: int | None = None) -> list[dict[str, Any]]:
    """Write ``dst``: ``src`` with SmoothQuant's scales folded into every smoothable LayerNorm and
    its MatMul weights (module docstring).

    Args:
        src, dst: float ONNX in / out (``dst`` is written whole; callers write it in a temp dir).
        images: (N, C, H, W) float32 calibration images, preprocessed.
        alpha: migration strength in [0, 1], the share of the activations' range moved into the
            weights (SmoothQuant's default 0.5).

    Returns:
        one ``{"norm", "channels", "x_range_before", "x_range_after", "s_max", "s_min"}`` per site
        (ranges = max/median of the per-channel max |X_j|: how uneven the channels are).

    Raises:
        UserError: alpha outside [0, 1].
    """
    import onnx

    if not 0.0 <= float(alpha) <= 1.0:
        raise UserError(f"--smooth-alpha must be in [0, 1], got {alpha}")
    model = onnx.load(str(src))
    sites = find_sites(model)
    if not sites:
        onnx.save_model(model, str(dst))
        return []
    amax = activation_absmax(src, [s.output for s in sites], images, batch_size, threads)
    inits = {t.name: t for t in model.graph.initializer}
    report: list[dict[str, Any]] = []
    for site in sites:
        x = amax[site.output]
        s = smoothing_scales(x, site_weight_absmax(inits, site), alpha)
        fold_site(inits, site, s)
        after = x / s
        report.append({"norm": site.norm, "channels": int(len(s)),
                       "x_range_before": float(x.max() / max(np.median(x), 1e-30)),
                       "x_range_after": float(after.max() / max(np.median(after), 1e-30)),
                       "s_min": float(s.min()), "s_max": float(s.max())})
    onnx.save_model(model, str(dst))
    return report
