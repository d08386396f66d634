"""Two-stream (sequential) Q/K compensation: pruned-stream queries/keys, dense logits as target.

METHODS.md §5, "Sequential calibration"; the one-stream system is ``edgeprune.solve.qk_logit``
(corp-v1 eq. 12-16, App. B.2). For one head and image i let ``Q_d, K_d`` (n x d) be the dense
stream's queries and keys (all d dims) and ``Q~, K~`` the pruned stream's (the same block's
``qkv`` applied to the output of the already pruned blocks). The pruned block keeps dims S and
computes the logits ``Q~_S (I + M) K~_S^T`` (``fold_logit_compensation`` folds ``I + M``). Both
logits carry the same factor 1/sqrt(d_h) (the fold keeps the dense scale), so the fit is done in
the unscaled basis (the scale multiplies the objective by a constant; the ridge rule is
scale-free). Find M (d' x d') minimising

    sum_i || Q_d,i K_d,i^T - Q~_S,i (I + M) K~_S,i^T ||_F^2 + lam ||M||_F^2

(ridge prior at the CORP fold, M = 0). Setting the gradient to zero, with ``Gq~_i = Q~_S^T Q~_S``,
``Gk~_i = K~_S^T K~_S`` (d' x d'), ``Xq_i = Q~^T Q_d`` and ``Xk_i = K_d^T K~`` (d x d, full dims):

    sum_i Gq~_i M Gk~_i + lam M = sum_i ( Xq_i[S, :] Xk_i[:, S] - Gq~_i Gk~_i )

i.e. METHODS.md's ``sum_i Q~_S^T Q~_S M' K~_S^T K~_S + lam (M' - I) = sum_i Q~_S^T Q_d K_d^T K~_S``
for the full map ``M' = I + M``. The left side is the one-stream Kronecker system built from the
pruned stream's Grams (``qk_logit.kronecker_system``, same ridge lambda rule
``lam = alpha * tr(K) / d'^2``); only the right side changes. When the streams are equal
(``Xq = Gq``, ``Xk = Gk``) it is ``sum_i Gq_i[S, P] Gk_i[P, S]``: exactly CORP's system.
"""

from __future__ import annotations

import torch


def cross_rhs(gq: torch.Tensor, gk: torch.Tensor, xq: torch.Tensor, xk: torch.Tensor,
              keep: torch.Tensor) -> torch.Tensor:
    """Right side of the two-stream Q/K system for one head (module doc), float64.

    Args:
        gq, gk: the pruned stream's per-image Grams ``Q~^T Q~``, ``K~^T K~`` (N, d, d).
        xq: per-image ``Q~^T Q_d`` (N, d, d) (rows pruned-stream dims, columns dense dims).
        xk: per-image ``K_d^T K~`` (N, d, d) (rows dense dims, columns pruned-stream dims).
        keep: S (d',) int64.

    Returns:
        (d', d') float64 ``sum_i Xq_i[S, :] Xk_i[:, S] - Gq_i[S, S] Gk_i[S, S]``.
    """
    xq_s = xq.double()[:, keep]
    xk_s = xk.double()[:, :, keep]
    gq_ss = gq.double()[:, keep][:, :, keep]
    gk_ss = gk.double()[:, keep][:, :, keep]
    return (xq_s @ xk_s - gq_ss @ gk_ss).sum(0)


class QKCrossGrams:
    """Per-image cross Grams ``Q~^T Q_d`` and ``K_d^T K~`` of one layer (all heads).

    The pruned stream's own Grams and ranking score live in a
    :class:`~edgeprune.calibration.qk_stats.QKStatistics`; this holds the cross terms of the
    right side. Memory: ``N * H * 2 * d^2 * 4`` bytes (float32 storage, products in float32 over
    one image's n tokens, like the one-stream Grams).

    Args:
        num_heads: H; qk_dim: d.
    """

    def __init__(self, num_heads: int, qk_dim: int) -> None:
        self.num_heads, self.qk_dim = num_heads, qk_dim
        self._xq: list[torch.Tensor] = []
        self._xk: list[torch.Tensor] = []

    @torch.no_grad()
    def add_batch(self, q_dense: torch.Tensor, k_dense: torch.Tensor, q_pruned: torch.Tensor,
                  k_pruned: torch.Tensor) -> None:
        """Add one batch of both streams, each (B, H, n, d), the same images in the same order.

        Raises:
            ValueError: shapes differ or do not match (H, d).
        """
        shape = q_dense.shape
        if any(t.shape != shape for t in (k_dense, q_pruned, k_pruned)) or q_dense.dim() != 4 \
                or shape[1] != self.num_heads or shape[3] != self.qk_dim:
            raise ValueError(f"expected four (B, {self.num_heads}, n, {self.qk_dim}) tensors, got "
                             f"{[tuple(t.shape) for t in (q_dense, k_dense, q_pruned, k_pruned)]}")
        self._xq.append((q_pruned.float().transpose(-1, -2) @ q_dense.float()))
        self._xk.append((k_dense.float().transpose(-1, -2) @ k_pruned.float()))

    def grams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Xq, Xk), each (N, H, d, d) float32.

        Raises:
            RuntimeError: nothing added.
        """
        if not self._xq:
            raise RuntimeError("QKCrossGrams: no images were added")
        return torch.cat(self._xq), torch.cat(self._xk)
