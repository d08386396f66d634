"""ONNX graph clean-up (onnx-graphsurgeon constant folding, dead-node removal, topological sort)
and inspection helpers for :func:`exporters.onnx.export_onnx`."""

from __future__ import annotations

import os
import warnings
from typing import Any

from exporters.onnx_fold import PROTOBUF_LIMIT, _quiet_onnxruntime, fold_shape_chains  # noqa: F401 (handed on)


def _clean_graph(model_proto):
    """onnx-graphsurgeon: fold constants (incl. static shape arithmetic), drop dead nodes, sort;
    then fold the dynamic-batch shape chains (:func:`exporters.onnx_fold.fold_shape_chains`)."""
    import onnx_graphsurgeon as gs

    import onnx

    if model_proto.ByteSize() < PROTOBUF_LIMIT:
        # Static shapes for intermediate tensors let fold_shapes resolve Shape->Gather chains of
        # static dims (e.g. SDPA's 1/sqrt(head_dim) scale).
        try:
            model_proto = onnx.shape_inference.infer_shapes(model_proto, data_prop=True)
        except Exception:
            pass
    graph = gs.import_onnx(model_proto)
    with warnings.catch_warnings(), _quiet_onnxruntime():
        warnings.simplefilter("ignore")
        graph.fold_constants(fold_shapes=True)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    cleaned = gs.export_onnx(graph, do_type_check=True)
    # gs keeps the opset; carry over model-level fields gs does not.
    cleaned.ir_version = model_proto.ir_version
    # A dynamic batch keeps Shape->Gather->Unsqueeze->Concat chains that gs cannot fold (the batch
    # is unknown); onnxslim rewrites them to constant shapes with -1 (exporters.onnx_fold).
    return fold_shape_chains(cleaned)


def _weights_bytes(model_proto) -> int:
    total = 0
    for init in model_proto.graph.initializer:
        total += len(init.raw_data) if init.raw_data else init.ByteSize()
    return total


def _output_shape_of(model_proto) -> list:
    outs = model_proto.graph.output
    if not outs:
        return []
    dims = outs[0].type.tensor_type.shape.dim
    return [d.dim_param if d.dim_param else int(d.dim_value) for d in dims]


def graph_op_summary(path: str | os.PathLike) -> dict[str, Any]:
    """Op types and domains of an ONNX file (for tests and ``verify`` output)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    ops: dict[str, int] = {}
    domains: set[str] = set()
    for node in m.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
        domains.add(node.domain or "ai.onnx")
    opsets = {imp.domain or "ai.onnx": imp.version for imp in m.opset_import}
    return {"ops": ops, "domains": sorted(domains), "opsets": opsets}
