"""Fold the run-time shape arithmetic that a dynamic batch axis leaves in an exported ViT graph.

Why
---
timm's ``Attention`` and :class:`edgeprune.layers.PrunedAttention` reshape with sizes read from
the input: ``B, N, C = x.shape; qkv.reshape(B, N, 3, H, d)``. TorchScript tracing records each
``x.shape[i]`` as ``Shape -> Gather(i)`` and the target shape as ``Unsqueeze``s fed to a
``Concat``, so every reshape carries a small integer sub-graph computed at run time. With a static
batch, onnx-graphsurgeon's ``fold_constants(fold_shapes=True)`` (in
:func:`exporters.onnx_graph._clean_graph`) folds them all. With the dynamic batch axis
(``"batch"``, the default) ``Shape(x)[0]`` is unknown, so graphsurgeon keeps the whole chain --
even the parts that read static dims (tokens N, heads H, head dim d) -- and a Q/K-pruned block
(``qk_dim != v_dim``), whose q, k and v are three separate reshapes, keeps three chains where a
dense block keeps one (measured: fmnist-vit 232 nodes dense, 256 Q/K-pruned; 38 and 62 of them
Shape/Gather/Unsqueeze/Concat).

What is folded
--------------
:func:`fold_shape_chains` runs onnxslim's symbolic shape inference and constant folding
(``onnxslim.slim`` with graph fusion and weight tying off): each reshape target whose only
unknown entry is the batch becomes a constant with ``-1`` there (e.g. ``[-1, 49, 2, 32]``), and
the ``Shape``/``Gather``/``Unsqueeze``/``Concat``/``Slice`` nodes that fed it are removed. The batch
axis stays symbolic; nothing else in the graph changes (no op fusion, no ``Gemm`` rewrite,
no merging of equal weights, so initializer names still match the PyTorch parameters). Q/K-pruned
blocks then cost no more nodes than dense ones (fmnist-vit: 193 nodes both).

It runs only on graphs with a symbolic input dim (a static-batch graph is already folded), and
only below the 2 GB protobuf limit. Without onnxslim (``pip install onnxslim``), or if it fails,
the graph is returned as it is, with a warning saying so: the file is still correct, only larger
and 5-15% slower on ONNX Runtime CPU.
"""

from __future__ import annotations

import contextlib

import warnings
from collections import Counter

#: Op types of the integer shape sub-graphs counted by :func:`shape_chain_nodes`.
SHAPE_CHAIN_OPS = frozenset({"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast"})

_MISSING_WARNED = False


#: Serialized protobufs must stay below 2 GiB; above this many bytes of weights, use external data.
PROTOBUF_LIMIT = 2_000_000_000


@contextlib.contextmanager
def _quiet_onnxruntime():
    """Silence ORT's optimizer warnings while graphsurgeon folds constants with it."""
    try:
        import onnxruntime as ort
    except ImportError:  # gs then folds with numpy only
        yield
        return
    ort.set_default_logger_severity(3)
    try:
        yield
    finally:
        ort.set_default_logger_severity(2)  # ORT's default (warning)


def has_symbolic_input(model_proto) -> bool:
    """Whether any graph input has a symbolic (or unknown) dim, e.g. the ``"batch"`` axis."""
    for inp in model_proto.graph.input:
        if not inp.type.HasField("tensor_type"):
            continue
        for dim in inp.type.tensor_type.shape.dim:
            if dim.dim_param or not dim.HasField("dim_value"):
                return True
    return False


def fold_shape_chains(model_proto):
    """Fold the batch-dependent ``Shape->Gather->Unsqueeze->Concat`` chains of ``model_proto``.

    Returns a new ``onnx.ModelProto`` (or ``model_proto`` itself when there is nothing to fold,
    onnxslim is missing or fails). See the module docstring for what is folded and why.
    """
    global _MISSING_WARNED
    if not has_symbolic_input(model_proto) or model_proto.ByteSize() >= PROTOBUF_LIMIT:
        return model_proto
    try:
        import onnxslim
    except ImportError:
        if not _MISSING_WARNED:
            warnings.warn("onnxslim is not installed: dynamic-batch ONNX graphs keep their "
                          "Shape->Gather->Concat reshape chains (pip install onnxslim)", stacklevel=2)
            _MISSING_WARNED = True
        return model_proto
    try:
        # _quiet_onnxruntime: onnxslim sets ORT's default log severity to "error" and leaves it so.
        with warnings.catch_warnings(), _quiet_onnxruntime():
            warnings.simplefilter("ignore")
            # its dead-node elimination is what rewrites the reshape targets; it also drops the Add of an all-zero
            # bias, so an attention without q/k/v bias (or a random-init one) does not fuse in ORT (docs/graphs.md)
            skip = ["graph_fusion", "weight_tying"]
            folded = onnxslim.slim(model_proto, skip_optimizations=skip)
    except Exception as err:  # an optimizer must never break an export that is otherwise fine
        warnings.warn(f"onnxslim could not fold the shape chains ({type(err).__name__}: {err}); "
                      "exporting the graph unfolded", stacklevel=2)
        return model_proto
    if folded is None:
        return model_proto
    folded.ir_version = model_proto.ir_version  # as _clean_graph: keep the exporter's IR version
    return folded


def shape_chain_nodes(model_proto) -> int:
    """Number of nodes computing shapes at run time: every ``Shape`` node plus each node of
    :data:`SHAPE_CHAIN_OPS` fed (transitively) by one. 0 on a fully folded graph."""
    consumers: dict[str, list] = {}
    for node in model_proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    seen: set[int] = set()
    todo = [n for n in model_proto.graph.node if n.op_type == "Shape"]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for out in node.output:
            todo.extend(c for c in consumers.get(out, []) if c.op_type in SHAPE_CHAIN_OPS)
    return len(seen)


def op_counts(model_proto) -> Counter:
    """``Counter`` of the graph's node op types."""
    return Counter(node.op_type for node in model_proto.graph.node)
