"""Verify a merged model's ONNX export with ONNX Runtime's merge decisions replayed in PyTorch (issue 55).

A token-merged graph (``--tokens-merge``) makes discrete choices in each bipartite matching: an ``ArgMax`` (each A
token's best B partner) and a ``TopK`` over the ``ReduceMax`` of the same similarities (which A tokens merge). On
near-tied similarities ONNX Runtime and PyTorch can choose differently and the outputs then differ beyond ``atol``
(docs/tokens.md, "ONNX vs PyTorch"). :func:`replay_compare` separates the two questions:

1. does the graph compute what PyTorch computes *given the same choices*? ONNX Runtime runs a copy of the graph that
   also outputs every matching's ArgMax and TopK indices; PyTorch runs with those choices
   (:class:`edgeprune.tokens.replay.MergeReplay`) and the outputs are compared with the same tolerance;
2. were the choices that differ near-ties? For each input, the largest similarity sum ONNX Runtime's choices give
   up against PyTorch's own at a step (``max_similarity_gap``), to be compared with float rounding
   (:data:`NEAR_TIE`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from edgeprune.errors import UserError
from edgeprune.tokens.replay import MergeReplay, replaying
from exporters.agreement import compare_outputs
from exporters.ort_session import load_session
from exporters.verify import check_input_shape, flat_outputs, run_torch

#: the largest similarity sum (cosine similarities, float32 arithmetic) a choice may give up and still count as a
#: near-tie: measured gaps of flipped choices are 6e-8..1.8e-7 (docs/results/merge_ties.json); a wrong graph's are
#: of the order of the similarities' spread (1e-2 and more)
NEAR_TIE = 1e-5

__all__ = ["NEAR_TIE", "decision_outputs", "replay_compare", "format_replay"]


def decision_outputs(model: Any) -> list[tuple[str, str]]:
    """``[(ArgMax output, TopK indices output)]`` of every token matching in ``model`` (an ``onnx.ModelProto``), in
    the order they run (each matching depends on the previous one's output, so the graph's topological order is
    the model's).

    A matching is a ``TopK`` whose input is the output of a ``ReduceMax`` with an ``ArgMax`` on the same tensor
    (``scores.max(dim=-1)`` of :func:`edgeprune.tokens.merge.bipartite_soft_matching`); the unmerge's TopK (over the
    ranked positions, not a ReduceMax) is not one.
    """
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    argmax = {node.input[0]: node.output[0] for node in graph.node if node.op_type == "ArgMax"}
    out = []
    for node in graph.node:
        if node.op_type != "TopK":
            continue
        src = producer.get(node.input[0])
        if src is not None and src.op_type == "ReduceMax" and src.input[0] in argmax:
            out.append((argmax[src.input[0]], node.output[1]))
    return out


def _session_with_decisions(path: Path, threads: int | None) -> tuple[Any, list[tuple[str, str]]]:
    import onnx

    try:
        model = onnx.load(str(path))
    except Exception as err:  # a corrupt file: the plain session already said so; one line here too
        raise UserError(f"cannot read ONNX model {path}: {str(err).strip()[:200]}") from None
    pairs = decision_outputs(model)
    have = {o.name for o in model.graph.output}
    for name in {n for pair in pairs for n in pair} - have:
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None))
    session = load_session(path, providers=["cpu"], threads=threads, model_bytes=model.SerializeToString())
    return session, pairs


def _run_with_decisions(session: Any, pairs: list[tuple[str, str]], x: np.ndarray, fixed_batch: int | None,
                        chunk: int, outputs: int) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    name = session.get_inputs()[0].name
    names = [o.name for o in session.get_outputs()[:outputs]] + [n for pair in pairs for n in pair]
    step = fixed_batch or chunk
    outs, decisions = [], [([], []) for _ in pairs]
    for start in range(0, x.shape[0], step):
        part = x[start:start + step]
        n = part.shape[0]
        if fixed_batch and n < fixed_batch:
            part = np.concatenate([part, np.repeat(part[-1:], fixed_batch - n, axis=0)], axis=0)
        got = session.run(names, {name: part})
        outs.append(flat_outputs(got[:outputs], n))
        for k in range(len(pairs)):
            decisions[k][0].append(got[outputs + 2 * k][:n])
            decisions[k][1].append(got[outputs + 2 * k + 1][:n])
    return np.concatenate(outs, axis=0), [(np.concatenate(i), np.concatenate(o)) for i, o in decisions]


def replay_compare(onnx_path: str | os.PathLike, torch_model: nn.Module, x: np.ndarray, *, atol: float,
                   rtol: float = 0.0, output_kind: str | None = None, batch_size: int = 16,
                   threads: int | None = None) -> dict[str, Any] | None:
    """ONNX Runtime vs PyTorch on ``x`` (N, C, H, W) float32 with ONNX Runtime's merge choices replayed in PyTorch.

    Returns:
        None when the graph has no token matching; else a dict: ``matchings`` (per input), ``passed`` (every input
        within ``atol + rtol |ref|`` with the same choices, and every choice that differs a near-tie),
        ``inputs_within_tolerance``, ``max_abs_diff`` (with the choices replayed), ``inputs_with_other_merges``
        (inputs whose ONNX Runtime choices differ from PyTorch's own at some step), ``max_similarity_gap`` (module
        doc) and ``near_tie`` (:data:`NEAR_TIE`).

    Raises:
        UserError: an unreadable file; a model whose matchings do not fit the graph's (another model than the
            file's).
    """
    path = Path(onnx_path)
    session, pairs = _session_with_decisions(path, threads)
    if not pairs:
        return None
    fixed = check_input_shape(session, x.shape)
    n_out = len(session.get_outputs()) - len({n for pair in pairs for n in pair})
    onnx_out, decisions = _run_with_decisions(session, pairs, x, fixed, max(1, int(batch_size)), n_out)
    replay = MergeReplay([(torch.from_numpy(i), torch.from_numpy(o)) for i, o in decisions])
    try:
        with replaying(replay):
            torch_out = run_torch(torch_model, x, max(1, int(batch_size)))
    except ValueError as err:
        raise UserError(f"the PyTorch model's token matchings do not fit {path.name}'s ({err})") from None
    if replay.steps_run != len(pairs) * -(-x.shape[0] // max(1, int(batch_size))):
        raise UserError(f"the PyTorch model ran {replay.steps_run} token matchings, {path.name} has {len(pairs)} "
                        "per batch (another model than the file's?)")
    cmp = compare_outputs(onnx_out, torch_out, output_kind=output_kind, atol=atol, rtol=rtol)
    gap = float(replay.gap.max()) if replay.gap.numel() else 0.0
    return {"matchings": len(pairs), "passed": bool(cmp.passed and gap <= NEAR_TIE),
            "inputs_within_tolerance": cmp.inputs_within_tolerance, "n": cmp.n, "max_abs_diff": cmp.max_abs_diff,
            "inputs_with_other_merges": int(replay.differs.sum()), "max_similarity_gap": gap, "near_tie": NEAR_TIE}


def format_replay(rep: dict[str, Any]) -> str:
    """One line for ``edgeprune verify``: the comparison with ONNX Runtime's merge choices replayed."""
    other = rep["inputs_with_other_merges"]
    kind = "near-ties" if rep["max_similarity_gap"] <= rep["near_tie"] else "NOT near-ties"
    ties = (f"; {other} input{'s' if other != 1 else ''} merged other token pairs in ONNX Runtime, giving up at most "
            f"{rep['max_similarity_gap']:.1e} of similarity ({kind}, <= {rep['near_tie']:g})") if other \
        else "; every choice the same"
    return (f"merge replay:  with ONNX Runtime's {rep['matchings']} token-merge choices per input replayed in "
            f"PyTorch, {rep['inputs_within_tolerance']} of {rep['n']} inputs within tolerance (max abs diff "
            f"{rep['max_abs_diff']:.3e}){ties}")
