"""Q/DQ placement for TensorRT's explicit quantization, written from explicit ranges.

What TensorRT fuses (checked against NVIDIA's documentation, see docs/quantization.md, "Q/DQ
placement"): a ``QuantizeLinear`` -> ``DequantizeLinear`` pair on each *input* of a weighted
operation (``MatMul``/``Gemm`` with a constant weight, ``Conv``), the weight stored as an int8
initializer read through a ``DequantizeLinear`` with one scale per output channel, zero points 0
(symmetric; TensorRT supports no other), and nothing on LayerNorm, Softmax, GELU or residual
adds -- those run in fp16 between the int8 GEMMs (NVIDIA ModelOpt's int8 ONNX PTQ places the
nodes the same way). This module writes exactly that, from ranges it is given:

* activation input ``x`` of an int8 GEMM: ``Q(x, s, 0) -> DQ(., s, 0)`` with the per-tensor
  scale ``s = amax / 127`` (TensorRT's convention); one pair per tensor, shared by every int8
  GEMM reading ``x`` (a float GEMM reading the same tensor reads it unquantized);
* weight ``W``: ``W_q = clip(round(W / s_c), -127, 127)`` int8 with ``s_c = max|W_c| / 127`` per
  output channel ``c`` (``axis`` 1 for a ``MatMul`` weight stored (in, out), 0 for ``Gemm`` with
  ``transB=1`` and ``Conv``), then ``DQ(W_q, s_c, 0, axis)``;
* biases stay float (TensorRT folds them into the int8 kernel's epilogue).

:func:`find_gemms` lists the weighted GEMMs of an exported ViT with their kind (``qkv``, ``proj``,
``fc1``, ``fc2``, ``patch_embed``, ``head``; :data:`KIND_PATTERNS`), block and FLOPs; attention's
activation x activation products hold no weight and are not GEMMs here (TensorRT runs its fused
attention in fp16).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

#: GEMM kinds by node-name pattern, first match wins (timm / DINOv2 export names); the rest is
#: ``other``.
KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    ("qkv", "*/attn/qkv/*"), ("qkv", "*/attn/q/*"), ("qkv", "*/attn/k/*"), ("qkv", "*/attn/v/*"),
    ("qkv", "*/attn/qk/*"),
    ("proj", "*/attn/proj/*"), ("fc1", "*/mlp/fc1/*"), ("fc2", "*/mlp/fc2/*"),
    ("fc1", "*/mlp/fc1_g/*"), ("fc1", "*/mlp/fc1_x/*"),  # a gated MLP's gate and up projections (SwiGLU)
    ("patch_embed", "*patch_embed*"), ("head", "*head*"),
    # a class-token block (edgeprune.layers.class_token_block): its q / kv projections and proj
    # hang off the block itself
    ("proj", "*/blocks.?/proj/*"), ("proj", "*/blocks.??/proj/*"),
    ("qkv", "*/blocks.?/MatMul"), ("qkv", "*/blocks.??/MatMul"),
    ("qkv", "*/blocks.?/MatMul_1"), ("qkv", "*/blocks.??/MatMul_1"),
)
#: Largest int8 magnitude used (symmetric, narrow range: -127..127).
QMAX = 127.0
_BLOCK = re.compile(r"blocks\.(\d+)")


@dataclass(frozen=True)
class GemmNode:
    """One weighted GEMM of an ONNX graph.

    Attributes:
        name: node name; ``op_type``: ``MatMul``, ``Gemm`` or ``Conv``.
        kind: :data:`KIND_PATTERNS` kind; ``block``: transformer block index (None outside blocks).
        x: activation input tensor; ``w``: weight initializer; ``axis``: the weight's output-channel
            axis (per-channel scales).
        k: reduction length per output value; ``n_out``: output channels; ``stride_area``: the
            product of a ``Conv``'s strides (1 otherwise).
    """

    name: str
    op_type: str
    kind: str
    block: int | None
    x: str
    w: str
    axis: int
    k: int
    n_out: int

    stride_area: int = 1

    def flops_per_image(self, x_shape: Sequence[int]) -> float:
        """2 x MACs of one image, from the activation's shape ``(N, ..., K)`` (``MatMul``/``Gemm``)
        or ``(N, C, H, W)`` (``Conv``: H x W / stride area output positions, as a patch embedding
        with stride = kernel)."""
        n = max(1, int(x_shape[0]))
        if self.op_type == "Conv":
            rows = int(np.prod(x_shape[2:])) // max(1, self.stride_area)
        else:
            rows = int(np.prod(x_shape)) // (n * max(1, self.k))
        return 2.0 * rows * self.k * self.n_out


def gemm_kind(name: str) -> str:
    """The kind of a GEMM node by its name (:data:`KIND_PATTERNS`), ``other`` if none matches."""
    for kind, pattern in KIND_PATTERNS:
        if fnmatch.fnmatchcase(name, pattern):
            return kind
    return "other"


def find_gemms(model: Any) -> list[GemmNode]:
    """The weighted GEMMs of an ONNX ``ModelProto`` in graph order: ``MatMul`` with a 2-D
    initializer as second input, ``Gemm`` with an initializer weight, ``Conv`` with an initializer
    weight. Unnamed nodes are skipped (they cannot be reported or excluded)."""
    inits = {t.name: t for t in model.graph.initializer}
    out: list[GemmNode] = []
    for node in model.graph.node:
        if not node.name or len(node.input) < 2 or node.input[1] not in inits:
            continue
        dims = list(inits[node.input[1]].dims)
        m = _BLOCK.search(node.name)
        common = dict(name=node.name, op_type=node.op_type, kind=gemm_kind(node.name),
                      block=int(m.group(1)) if m else None, x=node.input[0], w=node.input[1])
        if node.op_type == "MatMul" and len(dims) == 2:
            out.append(GemmNode(**common, axis=1, k=dims[0], n_out=dims[1]))
        elif node.op_type == "Gemm" and len(dims) == 2:
            trans_b = any(a.name == "transB" and a.i == 1 for a in node.attribute)
            k, n = (dims[1], dims[0]) if trans_b else (dims[0], dims[1])
            out.append(GemmNode(**common, axis=0 if trans_b else 1, k=k, n_out=n))
        elif node.op_type == "Conv" and len(dims) >= 3:
            strides = next((list(a.ints) for a in node.attribute if a.name == "strides"), [1])
            out.append(GemmNode(**common, axis=0, k=int(np.prod(dims[1:])), n_out=dims[0],
                                stride_area=int(np.prod(strides))))
    return out


def quantize_weight(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8 of a weight: ``(W_q int8, scales float32 (W.shape[axis],))``,
    ``s_c = max|W_c| / 127`` (1 for an all-zero channel), ``W_q = clip(round(W / s_c), -127, 127)``."""
    w = np.asarray(w, dtype=np.float32)
    other = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=other)
    scale = np.where(amax > 0, amax / QMAX, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.round(w / scale.reshape(shape)), -QMAX, QMAX).astype(np.int8)
    return q, scale


def fake_quant_weight(w: np.ndarray, axis: int) -> np.ndarray:
    """``DQ(Q(W))`` of :func:`quantize_weight`, float32 (for error estimates in numpy)."""
    q, s = quantize_weight(w, axis)
    shape = [1] * np.ndim(w)
    shape[axis] = -1
    return q.astype(np.float32) * s.reshape(shape)


def fake_quant_act(x: np.ndarray, amax: float) -> np.ndarray:
    """``DQ(Q(x))`` with the per-tensor symmetric scale ``amax / 127``, saturating at -128..127
    (ONNX ``QuantizeLinear`` rounds half to even, as ``np.round``)."""
    s = np.float32(max(float(amax), 1e-12) / QMAX)
    return np.clip(np.round(np.asarray(x, dtype=np.float32) / s), -128, 127) * s


def insert_qdq(model: Any, gemms: Sequence[GemmNode], amax: Mapping[str, float],
               weights: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> list[str]:
    """Quantize ``gemms`` of ``model`` (an ONNX ``ModelProto``, edited in place) the TensorRT way
    (module docstring): Q/DQ on each GEMM's activation input with ``amax[x]``, int8 per-channel
    weights behind a ``DequantizeLinear``.

    Args:
        model: the float model (its weights already smoothed, if at all).
        gemms: the GEMMs to make int8 (from :func:`find_gemms` on this model); others stay float.
        amax: per-tensor clipping range of every quantized activation (> 0).
        weights: GEMM node name -> ``(W_q int8, scales (n_out,))`` already rounded (in the
            weight's own layout, scales on ``g.axis``; e.g. GPTQ, ``exporters.quantization.weight_rounding``);
            a GEMM not in it gets :func:`quantize_weight` (round to nearest).

    Returns:
        the names of the nodes quantized, in graph order.

    Raises:
        KeyError: an activation without a range.
    """
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    by_name = {g.name: g for g in gemms}
    new_nodes: list[Any] = []
    qdq_of: dict[str, str] = {}
    done: list[str] = []
    weight_users: dict[str, int] = {}
    for node in model.graph.node:
        for i in node.input:
            weight_users[i] = weight_users.get(i, 0) + 1
    for node in model.graph.node:
        g = by_name.get(node.name)
        if g is not None:
            if g.x not in qdq_of:
                qdq_of[g.x] = _activation_qdq(g.x, float(amax[g.x]), new_nodes, model, helper)
            node.input[0] = qdq_of[g.x]
            pre = (weights or {}).get(g.name)
            node.input[1] = _weight_dq(g, numpy_helper.to_array(inits[g.w]), new_nodes, model, helper,
                                       numpy_helper, pre)
            weight_users[g.w] -= 1
            done.append(g.name)
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    unused = {w for w, n in weight_users.items() if n == 0 and w in inits}
    keep = [t for t in model.graph.initializer if t.name not in unused]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return done


def _activation_qdq(x: str, amax: float, nodes: list[Any], model: Any, helper: Any) -> str:
    if not amax > 0:
        raise ValueError(f"activation {x} has no positive range ({amax})")
    base = _safe(x)
    scale, zp = f"{base}_scale", f"{base}_zero_point"
    model.graph.initializer.extend([
        helper.make_tensor(scale, 1, [], [np.float32(amax / QMAX)]),          # FLOAT
        helper.make_tensor(zp, 3, [], [0]),                                    # INT8
    ])
    nodes.append(helper.make_node("QuantizeLinear", [x, scale, zp], [f"{base}_quantized"],
                                  name=f"{base}_QuantizeLinear"))
    nodes.append(helper.make_node("DequantizeLinear", [f"{base}_quantized", scale, zp], [f"{base}_dequantized"],
                                  name=f"{base}_DequantizeLinear"))
    return f"{base}_dequantized"


def _weight_dq(g: GemmNode, w: np.ndarray, nodes: list[Any], model: Any, helper: Any, numpy_helper: Any,
               pre: tuple[np.ndarray, np.ndarray] | None = None) -> str:
    q, s = quantize_weight(w, g.axis) if pre is None else pre
    if q.shape != w.shape or q.dtype != np.int8 or s.shape != (w.shape[g.axis],):
        raise ValueError(f"pre-rounded weight of {g.name} has shape {q.shape}/{s.shape}, not {w.shape}")
    base = _safe(g.w) + "_" + _safe(g.name)
    model.graph.initializer.extend([
        numpy_helper.from_array(q, f"{base}_quantized"),
        numpy_helper.from_array(s, f"{base}_scale"),
        numpy_helper.from_array(np.zeros(s.shape, np.int8), f"{base}_zero_point"),
    ])
    nodes.append(helper.make_node("DequantizeLinear", [f"{base}_quantized", f"{base}_scale", f"{base}_zero_point"],
                                  [f"{base}_dequantized"], name=f"{base}_DequantizeLinear", axis=g.axis))
    return f"{base}_dequantized"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", name).strip("_")
