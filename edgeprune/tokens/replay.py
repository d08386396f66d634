"""Another runtime's merge decisions, replayed in PyTorch (issue 55: verifying a merged model's ONNX export).

Bipartite soft matching (:func:`~edgeprune.tokens.merge.bipartite_soft_matching`) makes discrete choices -- which A
tokens merge (the top r of each token's best similarity) and into which B token (the best one). Where two
similarities are tied within float rounding (gaps of 1e-7 measured, docs/tokens.md "ONNX vs PyTorch"), ONNX Runtime
and PyTorch can choose differently, and the outputs then differ by far more than ``atol`` although the graph computes
the same function. To check the *function*, :class:`MergeReplay` makes PyTorch take the choices ONNX Runtime took
(the ArgMax and TopK outputs of each matching, :mod:`exporters.merge_replay`) and measures how far each replayed
choice is from PyTorch's own: the similarity it gives up,

    gap = sum of the r best similarities (PyTorch's choice) - sum of the similarities of the r pairs replayed,

computed on PyTorch's scores of the same step (>= 0; 0 when the choices agree or are exactly tied). A near-tie has a
gap at float rounding; a wrong graph has a large one or outputs that differ even with the same choices.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Sequence

import torch

__all__ = ["MergeReplay", "active_replay", "replaying"]

_ACTIVE: ContextVar["MergeReplay | None"] = ContextVar("edgeprune_merge_replay", default=None)


def active_replay() -> "MergeReplay | None":
    """The replay a :func:`replaying` block set (None outside one: a matching makes its own choices)."""
    return _ACTIVE.get()


class MergeReplay:
    """The choices of every matching of a model on ``N`` inputs, taken in the order the model runs them.

    Args:
        decisions: per matching step, in the model's order (block by block, attention then MLP branch):
            ``(best_idx, order)``, each (N, |A|) int64: each A token's chosen B partner, and the A tokens ranked
            (the first r merge). The model may run the N inputs in chunks: the steps restart with each chunk and
            the inputs advance by the chunk's size.

    Attributes:
        differs: (N,) bool, whether an input's replayed pairs (merged A token -> its B token) differ from PyTorch's
            own at some step (None until the model has run).
        gap: (N,) float64, the largest similarity sum an input's replayed choices give up at a step (module doc).

    Raises:
        ValueError: (from :meth:`take`) more matchings than decisions, or decisions of another shape than the step's.
    """

    def __init__(self, decisions: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.decisions = [(torch.as_tensor(i).long(), torch.as_tensor(o).long()) for i, o in decisions]
        n = int(self.decisions[0][0].shape[0]) if self.decisions else 0
        self.differs = torch.zeros(n, dtype=torch.bool)
        self.gap = torch.zeros(n, dtype=torch.float64)
        self.step, self.offset, self.steps_run = 0, 0, 0

    def take(self, scores: torch.Tensor, best: torch.Tensor, best_idx: torch.Tensor, order: torch.Tensor,
             r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The replayed ``(best_idx, order)`` for this step, given PyTorch's own (``scores`` (B, |A|, |B|), ``best``,
        ``best_idx``, ``order`` (B, |A|)); records whether and by how much they differ."""
        if self.step >= len(self.decisions):
            raise ValueError(f"the model ran more than the {len(self.decisions)} token matchings replayed")
        b = int(scores.shape[0])
        all_idx, all_order = self.decisions[self.step]
        rows = slice(self.offset, self.offset + b)
        idx, rank = all_idx[rows].to(best_idx.device), all_order[rows].to(order.device)
        if tuple(idx.shape) != tuple(best_idx.shape) or tuple(rank.shape) != tuple(order.shape):
            raise ValueError(f"matching {self.step}: replayed decisions of shape {tuple(idx.shape)} for a step of "
                             f"{tuple(best_idx.shape)}")
        own = best.double().gather(-1, order[:, :r]).sum(-1)
        chosen = scores.double().gather(-1, idx.unsqueeze(-1)).squeeze(-1).gather(-1, rank[:, :r]).sum(-1)
        self.gap[rows] = torch.maximum(self.gap[rows], (own - chosen).clamp_min(0).cpu())
        self.differs[rows] |= (_pairs(best_idx, order, r) != _pairs(idx, rank, r)).any(-1).cpu()
        self.step += 1
        self.steps_run += 1
        if self.step == len(self.decisions):  # the chunk is done: the next one starts at the first matching
            self.step, self.offset = 0, self.offset + b
        return idx, rank


def _pairs(best_idx: torch.Tensor, order: torch.Tensor, r: int) -> torch.Tensor:
    """(B, |A|): each merged A token's B partner + 1, 0 for the A tokens that stay (the order within does not
    matter)."""
    src = order[:, :r]
    return torch.zeros_like(best_idx).scatter(-1, src, best_idx.gather(-1, src) + 1)


@contextlib.contextmanager
def replaying(replay: MergeReplay) -> Iterator[MergeReplay]:
    """Within the block, every token matching takes its choices from ``replay`` (in the order they run)."""
    token = _ACTIVE.set(replay)
    try:
        yield replay
    finally:
        _ACTIVE.reset(token)
