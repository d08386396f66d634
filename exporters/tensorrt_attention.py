"""Before a TensorRT build: will the engine's attention be fused? (issue 40 item 6)

No TensorRT needed. :func:`attention_shapes` reads every attention of an ONNX file from its graph
(ONNX shape inference: for each ``Softmax``, the ``MatMul`` before it gives the Q/K head dim and the
token count, the ``MatMul`` after it the V head dim; Q/DQ, ``Cast``, scaling and masking nodes
between are skipped); where the graph's shapes are unknown it falls back to the per-block dims of
the file's edgeprune metadata (``blocks``). :func:`fusion_forecast` checks them against TensorRT's
fused-MHA conditions for the build precision (:mod:`devices.kernels`: the profile's
``[pruning.head_dims]`` rule, fp32 never fused, int8 at most 512 tokens, SM >= 7.5) and returns the
one line ``edgeprune build`` prints before building; after the build, the engine's own layer
listing says what TensorRT did (:func:`runners.tensorrt.inspect.attention_fusion_report`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable

from devices.kernels import SOURCE, TENSORRT_INT8_MAX_TOKENS, TENSORRT_MIN_SM, describe_allowed
from exporters.onnx_metadata import read_metadata
from exporters.tensorrt_settings import _load_graph

if TYPE_CHECKING:
    from devices.profile import DeviceProfile

#: nodes that may sit between the attention matmuls and the softmax (scale, mask, Q/DQ, casts)
_PASS_THROUGH = frozenset({"Mul", "Div", "Add", "Where", "Cast", "QuantizeLinear", "DequantizeLinear",
                           "Identity"})


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One attention of a graph: its Q/K and V head dims (None where unknown), token count (the
    longer of the query and key sequences) and whether its first batched matmul reads dequantized
    (int8 Q/DQ) inputs: TensorRT's int8 MHA needs them; otherwise the attention runs in fp16."""

    name: str
    qk: int | None
    v: int | None
    tokens: int | None = None
    quantized: bool = False


def _dims(value_info: Any) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None for d in value_info.type.tensor_type.shape.dim]


def _walk(name: str, step: Callable[[str], Any], upstream: bool, limit: int = 8) -> Any:
    """From tensor ``name``, follow ``step`` (tensor -> next node) through pass-through nodes to a
    ``MatMul`` (None if another node comes first)."""
    for _ in range(limit):
        node = step(name)
        if node is None or node.op_type == "MatMul":
            return node
        if node.op_type not in _PASS_THROUGH:
            return None
        name = node.input[0] if upstream else node.output[0]
    return None


def graph_attention_shapes(model: Any) -> list[AttentionShape]:
    """The attentions of an ``onnx.ModelProto`` (module doc), in graph order.

    Raises:
        ValueError / onnx errors: shape inference failed (the caller falls back to the metadata).
    """
    from onnx import shape_inference

    m = shape_inference.infer_shapes(model)
    info = {v.name: _dims(v) for v in [*m.graph.value_info, *m.graph.input, *m.graph.output]}
    producer = {o: n for n in m.graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in m.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def before(name: str) -> Any:
        return producer.get(name)

    def after(name: str) -> Any:
        nodes = consumers.get(name, [])
        return nodes[0] if len(nodes) == 1 else None

    out = []
    for n in m.graph.node:
        if n.op_type != "Softmax":
            continue
        mm1, mm2 = _walk(n.input[0], before, upstream=True), _walk(n.output[0], after, upstream=False)
        if mm1 is None or mm2 is None:
            continue  # a classifier's softmax, not an attention
        q, kt, vv = (info.get(t) or [] for t in (mm1.input[0], mm1.input[1], mm2.input[1]))
        tokens = [t for t in (q[-2] if len(q) >= 2 else None, kt[-1] if kt else None) if t]
        out.append(AttentionShape(n.name or mm1.name, q[-1] if q else None, vv[-1] if vv else None,
                                  max(tokens) if tokens else None,
                                  all(getattr(producer.get(t), "op_type", "") == "DequantizeLinear"
                                      for t in mm1.input[:2])))
    return out


def attention_shapes(onnx_path: str | os.PathLike[str]) -> list[AttentionShape]:
    """The attentions of an ONNX file: from the graph, else from its edgeprune metadata (module doc).

    Raises:
        UserError: missing or unreadable file.
    """
    model = _load_graph(onnx_path)
    try:
        found = graph_attention_shapes(model)
    except Exception:  # shape inference failed: the metadata below
        found = []
    if found and all(a.qk is not None and a.v is not None for a in found):
        return found
    blocks = read_metadata(onnx_path).get("blocks") or []
    meta = [AttentionShape(f"block {b.get('index', i)}", b.get("qk_dim"), b.get("v_dim"))
            for i, b in enumerate(blocks) if isinstance(b, dict) and b.get("qk_dim") is not None]
    return meta or found


def fusion_forecast(shapes: list[AttentionShape], precision: str, profile: "DeviceProfile") -> str | None:
    """One line when TensorRT will not fuse (some of) the attention of a ``precision`` build on
    ``profile``, else None (no attention found, or every attention meets the rule; TensorRT may still
    decide not to fuse on its own measurements: the engine's listing after the build says).

    The rule (:mod:`devices.kernels`): fp32 is never fused; an attention runs in int8 when the build
    is int8 and its matmuls read Q/DQ inputs (:attr:`AttentionShape.quantized`), else in fp16; its
    head dims must be in ``profile.pruning``'s rule for that precision, Q/K's equal to V's (one head
    size H for Q, K and V); int8 needs at most 512 tokens; the GPU SM >= 7.5.
    """
    if not shapes:
        return None
    where = f"{len(shapes)} attention(s)"
    if precision == "fp32":
        return (f"attention will not be fused: TensorRT fuses multi-head attention only in fp16, bf16 or int8, "
                f"this build is fp32 ({where}; {SOURCE})")
    cc = profile.compute_capability
    if cc is not None and tuple(cc) < TENSORRT_MIN_SM:
        return (f"attention will not be fused: fused multi-head attention needs SM >= 7.5, {profile.name} is "
                f"{profile.compute_capability_str} ({SOURCE})")
    problems = []
    for prec in ("fp16", "int8"):
        mine = [a for a in shapes if (prec == "int8") == (precision == "int8" and a.quantized)]
        allowed = profile.pruning.allowed_head_dims(prec) if profile.pruning is not None else None
        bad = [a for a in mine if allowed is not None and (a.qk not in allowed or a.v not in allowed)]
        if bad and allowed is not None:
            dims = sorted({d for a in bad for d in (a.qk, a.v) if d not in allowed and d is not None})
            problems.append(f"head dims {', '.join(map(str, dims)) or '?'} in {len(bad)} of {where} are outside "
                            f"{profile.name}'s {prec} rule {{{describe_allowed(allowed)}}}")
        long = [a for a in mine if prec == "int8" and (a.tokens or 0) > TENSORRT_INT8_MAX_TOKENS]
        if long:
            problems.append(f"{long[0].tokens} tokens > {TENSORRT_INT8_MAX_TOKENS} in int8")
    unequal = [a for a in shapes if a.qk is not None and a.v is not None and a.qk != a.v]
    if unequal:
        problems.append(f"{len(unequal)} of {where} have Q/K head dim != V head dim")
    return f"attention will not be fused: {'; '.join(problems)} ({SOURCE})" if problems else None


__all__ = ["AttentionShape", "attention_shapes", "fusion_forecast", "graph_attention_shapes"]
