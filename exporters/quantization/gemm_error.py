"""Where the int8 loss is: quantize one GEMM (or one group of GEMMs) at a time and measure it.

For the static symmetric int8 of TensorRT (``exporters.quantization.qdq``: per-tensor symmetric activations
with MinMax ranges from the calibration images, per-channel symmetric weights), every weighted
GEMM is made int8 *alone*, everything else float, and the variant runs on held-out images:

* ``rel_err`` -- relative squared error of the model's output vs the float model,
  ``||q - f||^2 / ||f||^2`` over all images;
* ``drop`` -- top-1 of the float model minus top-1 of the variant, in points (with labels);
  ``agreement`` -- share of images whose top-1 class is the float model's.

Groups (:func:`group_sensitivity`): every GEMM of one kind (``qkv``, ``proj``, ``fc1``, ``fc2``,
``patch_embed``, ``head``), of one block, or all at once -- errors do not add up across layers, so
the groups say what a whole kind costs together.

The model measured is the float model as the recipe prepared it (smoothed by
``exporters.quantization.smoothing.apply_smoothing``, ranges from
``exporters.quantization.stats``).

Why two sensitivity passes: this one (the TensorRT recipe's fallback, ``tools/quant_sensitivity.py``)
writes each variant's Q/DQ itself (:func:`exporters.quantization.qdq.insert_qdq`) with the recipe's
own ranges and rounded weights, and runs only the blocks from the GEMM onward;
``exporters.quantization.ort_int8.rank_sensitivity`` (the ONNX Runtime recipe's ``--auto-exclude``)
has ONNX Runtime's ``quantize_static`` quantize each node, so it ranks what that quantizer will
write (its calibration method and cache, attention products and other op types included). Both
score a variant with :func:`output_cost`.

Cost: a GEMM in block ``b`` changes nothing before block ``b``, so the held-out images' inputs of
every block are computed once (float) and each variant runs only from its block onward
(``onnx.utils.Extractor``; a model whose blocks cannot be cut runs whole).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from exporters.quantization.qdq import GemmNode, find_gemms, insert_qdq
from exporters.quantization.stats import ActStats, session_from_proto


@dataclasses.dataclass
class EvalSet:
    """Held-out images, their labels (or None) and the float model's outputs on them."""

    x: np.ndarray
    y: np.ndarray | None
    float_out: np.ndarray
    cuts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def copy_model(model: Any) -> Any:
    """A deep copy of an ONNX ``ModelProto``."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def block_cuts(model: Any, gemms: Sequence[GemmNode]) -> dict[int, str]:
    """Block index -> the residual-stream tensor entering the block (the first LayerNorm's input)."""
    cuts: dict[int, str] = {}
    blocks = {g.block for g in gemms if g.block is not None}
    for node in model.graph.node:
        for b in blocks:
            if b not in cuts and node.op_type == "LayerNormalization" and f"blocks.{b}/" in node.name:
                cuts[b] = node.input[0]
    return cuts


def prepare_eval(model: Any, x: np.ndarray, y: np.ndarray | None, cuts: Sequence[str], *,
                 batch_size: int = 32, threads: int | None = None) -> EvalSet:
    """Run the float model once on the held-out images, keeping its outputs and block inputs."""
    stats = _run(model, x, list(cuts), batch_size, threads)
    out, tensors = stats
    return EvalSet(x, y, out, tensors)


def _run(model: Any, x: np.ndarray, extra: list[str], batch_size: int, threads: int | None,
         feed: str | None = None, feed_x: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    import onnx

    m = copy_model(model)
    for name in extra:
        m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    sess = session_from_proto(m, threads)
    out_names = [o.name for o in sess.get_outputs()]
    in_name = feed or sess.get_inputs()[0].name
    data = x if feed_x is None else feed_x
    outs: dict[str, list[np.ndarray]] = {n: [] for n in out_names}
    for i in range(0, len(data), batch_size):
        for n, v in zip(out_names, sess.run(out_names, {in_name: np.ascontiguousarray(data[i:i + batch_size])})):
            outs[n].append(v)
    cat = {n: np.concatenate(v) for n, v in outs.items()}
    return cat[out_names[0]].astype(np.float32), {n: cat[n] for n in extra}


def run_variant(model: Any, ev: EvalSet, cut: str | None, *, batch_size: int = 32,
                threads: int | None = None) -> np.ndarray:
    """Outputs of ``model`` on the held-out images, from ``cut`` (a cached block input) if given
    and extractable, else from the images."""
    if cut is not None and cut in ev.cuts:
        sub = _extract(model, cut)
        if sub is not None:
            return _run(sub, ev.x, [], batch_size, threads, feed=cut, feed_x=ev.cuts[cut])[0]
    return _run(model, ev.x, [], batch_size, threads)[0]


def _extract(model: Any, cut: str) -> Any:
    import onnx
    from onnx.utils import Extractor

    try:
        sub = Extractor(model).extract_model([cut], [o.name for o in model.graph.output])
        onnx.checker.check_model(sub)
        return sub
    except Exception:  # noqa: BLE001 - a graph whose tail reads tensors before the cut: run whole
        return None


def output_cost(out: np.ndarray, float_out: np.ndarray, labels: np.ndarray | None = None) -> dict[str, float]:
    """How far a quantized variant's outputs are from the float model's: the one error measure of both
    recipes' sensitivity passes (:func:`gemm_sensitivity`, ``exporters.quantization.ort_int8.rank_sensitivity``).

    Args:
        out, float_out: (N, ...) outputs of the variant and of the float model on the same images.
        labels: (N,) class labels, or None.

    Returns:
        ``{"rel_err": ||q - f||^2 / ||f||^2 over all outputs, "agreement": share of images whose
        top-1 class is the float model's (1.0 for outputs that are not (N, classes) logits)}``,
        plus with labels ``"top1"`` (fraction) and ``"drop"`` (float top-1 minus the variant's, in points).
    """
    q = out.reshape(len(out), -1).astype(np.float64)
    f = float_out.reshape(len(out), -1).astype(np.float64)
    row: dict[str, float] = {"rel_err": float(np.sum((q - f) ** 2) / max(np.sum(f ** 2), 1e-30)),
                             "agreement": float(np.mean(q.argmax(1) == f.argmax(1))) if float_out.ndim == 2 else 1.0}
    if labels is not None:
        row["top1"] = float(np.mean(q.argmax(1) == labels))
        row["drop"] = 100.0 * (float(np.mean(f.argmax(1) == labels)) - row["top1"])
    return row


def cost(out: np.ndarray, ev: EvalSet) -> dict[str, float]:
    """:func:`output_cost` of one variant's outputs on the held-out set ``ev``."""
    return output_cost(out, ev.float_out, ev.y)


def gemm_sensitivity(model: Any, stats: ActStats, ev: EvalSet, gemms: Sequence[GemmNode] | None = None, *,
                     batch_size: int = 32, threads: int | None = None,
                     log: Callable[[str], None] | None = None,
                     weights: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> list[dict[str, Any]]:
    """Quantize each GEMM alone (MinMax ranges of ``stats``) and measure it on ``ev``.

    Args:
        model: the float (possibly smoothed) ``ModelProto``; ``stats``: its activation stats
            (``stats.amax`` are the ranges used: MinMax, or the clipped ranges of a recipe).
        gemms: the GEMMs to test (default every weighted GEMM).
        weights: pre-rounded int8 weights by GEMM name (:func:`exporters.quantization.qdq.insert_qdq`).

    Returns:
        one ``{"node", "kind", "block", "flops", "rel_err", "agreement", "top1", "drop"}`` per
        GEMM, graph order (``flops`` per image).
    """
    gemms = list(gemms) if gemms is not None else find_gemms(model)
    cuts = block_cuts(model, gemms)
    rows = []
    for i, g in enumerate(gemms):
        variant = copy_model(model)
        insert_qdq(variant, [g], stats.amax, weights)
        out = run_variant(variant, ev, cuts.get(g.block) if g.block is not None else None,
                          batch_size=batch_size, threads=threads)
        rows.append({"node": g.name, "kind": g.kind, "block": g.block,
                     "flops": g.flops_per_image(stats.shapes.get(g.x, (1, 1, g.k))), **cost(out, ev)})
        if log:
            log(f"[{i + 1}/{len(gemms)}] {g.name}: rel_err {rows[-1]['rel_err']:.2e}")
    return rows


def group_sensitivity(model: Any, stats: ActStats, ev: EvalSet, groups: dict[str, Sequence[GemmNode]], *,
                      batch_size: int = 32, threads: int | None = None) -> dict[str, dict[str, float]]:
    """Quantize each named group of GEMMs together and measure it (``{group: cost}``)."""
    res: dict[str, dict[str, float]] = {}
    for name, members in groups.items():
        variant = copy_model(model)
        insert_qdq(variant, list(members), stats.amax)
        blocks = {g.block for g in members}
        cut = block_cuts(model, members).get(next(iter(blocks))) if len(blocks) == 1 and None not in blocks else None
        res[name] = cost(run_variant(variant, ev, cut, batch_size=batch_size, threads=threads), ev)
    return res


def default_groups(gemms: Sequence[GemmNode]) -> dict[str, list[GemmNode]]:
    """``kind:<k>`` for each kind, ``block:<b>`` for each block, and ``all``."""
    groups: dict[str, list[GemmNode]] = {}
    for g in gemms:
        groups.setdefault(f"kind:{g.kind}", []).append(g)
    for g in gemms:
        if g.block is not None:
            groups.setdefault(f"block:{g.block}", []).append(g)
    groups["all"] = list(gemms)
    return groups
