"""OFP-MLP: uniform neuron budget, mean-activation ranking, least-squares fc2 re-fit
(nuwa §3.3 eq. 10-12, suppl. §9-11).

* Dims (eq. 10, eq. 33 / Alg. 1, suppl. §9 "Uniform"): the MLP neuron budget left after the
  attention is spread so that all MLPs end up with similar sizes: water-filling in units of
  ``round_to`` channels -- every block gets ``min(cap_l, level)``, the remainder goes one unit at a
  time to the blocks that still have room (in block order). ``cap_l`` is the block's SKP anchor
  size floored to a multiple of ``round_to``: channels SKP removed never come back.
* Ranking: OFP prunes the *anchor* model (SKP's kept channels only). Its hidden activations are
  collected on the calibration images (streamed, float64, :class:`MLPStatistics`); the channels
  with the highest mean activation over all tokens are kept (eq. 11 "top neurons with the highest
  activation values").
* Re-fit (eq. 11-12, proof 2 in suppl. §10): ``[W2' | b2'] = argmin || W2 H + b2 1^T -
  (W2' H_S + b2' 1^T) ||_F`` over the calibration tokens, H the anchor's hidden activations. With a
  bias this is the least-squares regression of the pruned channels on the kept ones,
  ``h_P ~ B h_S + c`` with ``B = Sigma_PS Sigma_SS^-1``, ``c = mu_P - B mu_S`` (centred
  statistics), folded as ``W2' = W2_S + W2_P B``, ``b2' = b2 + W2_P c``: exactly the normal equation
  (eq. 29) of the augmented problem, solved in float64 by Cholesky with a small scale-free ridge
  ``lam = alpha * tr(Sigma_SS) / |S|`` for stability (alpha 1e-4 by default; 0 = plain LS when
  Sigma_SS is nonsingular). The solver is shared with CORP (``edgeprune.solve.mlp_ridge``).
"""

from __future__ import annotations

import torch

from edgeprune.anatomy import BlockAnatomy
from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.solve.mlp_ridge import fold_into_fc2, ridge_affine_map
from edgeprune.surgery import shrink_mlp

DEFAULT_RIDGE_ALPHA = 1e-4


def uniform_mlp_dims(caps: list[int], total: int, round_to: int = 8) -> list[int] | None:
    """Spread ``total`` kept neurons over the blocks so that they get similar sizes (eq. 10, 33).

    Args:
        caps: the most each block may keep (multiples of ``round_to``, >= round_to).
        total: total neurons that may be kept.
        round_to: granularity.

    Returns:
        per-block kept counts (multiples of ``round_to``, each <= its cap, sum <= total, and
        ``total - sum < round_to`` unless every block is at its cap), or None when ``total`` cannot
        give every block ``round_to`` neurons.
    """
    units = total // round_to
    cu = [max(1, c // round_to) for c in caps]
    if units < len(cu):
        return None
    if units >= sum(cu):
        return [u * round_to for u in cu]
    lo, hi = 1, max(cu)  # largest level L with sum(min(cap, L)) <= units
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(c, mid) for c in cu) <= units:
            lo = mid
        else:
            hi = mid - 1
    out = [min(c, lo) for c in cu]
    rest = units - sum(out)
    for i, c in enumerate(cu):
        if rest == 0:
            break
        if c > out[i]:
            out[i] += 1
            rest -= 1
    return [u * round_to for u in out]


def rank_channels(stats: MLPStatistics) -> torch.Tensor:
    """Channel indices by mean activation over all calibration tokens, highest first."""
    return torch.sort(-stats.mean, stable=True).indices


@torch.no_grad()
def refit_fc2(block: BlockAnatomy, stats: MLPStatistics, keep: torch.Tensor,
              ridge_alpha: float = DEFAULT_RIDGE_ALPHA, refit: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """New fc2 weight and bias for kept channels ``keep`` (eq. 12), without changing the block.

    Args:
        block: the block (its fc2 is read).
        stats: hidden statistics of this block's fc2 input.
        keep: sorted kept channel indices.
        ridge_alpha: scale-free ridge strength (see module doc).
        refit: False = plain removal (``W2[:, S]``, ``b2``), the "w/o optimization" ablation.

    Returns:
        (W2' (D, |S|), b2' (D,)).
    """
    D_mlp = block.mlp_hidden
    mask = torch.ones(D_mlp, dtype=torch.bool)
    mask[keep] = False
    prune = mask.nonzero().flatten()
    b = c = None
    if refit and len(prune) > 0:
        b, c, _ = ridge_affine_map(stats.mean, stats.cov, keep, prune, ridge_alpha)
    return fold_into_fc2(block.fc2.weight.detach(), None if block.fc2.bias is None else block.fc2.bias.detach(),
                         keep, prune, b, c)


@torch.no_grad()
def prune_mlp(block: BlockAnatomy, stats: MLPStatistics, k: int,
              ridge_alpha: float = DEFAULT_RIDGE_ALPHA, refit: bool = True) -> torch.Tensor:
    """Keep the k channels with the highest mean activation and re-fit fc2, in place.

    Returns:
        the sorted kept channel indices (in the block's current channel numbering).
    """
    if k >= block.mlp_hidden:
        return torch.arange(block.mlp_hidden)
    keep = rank_channels(stats)[:k].sort().values
    w, bias = refit_fc2(block, stats, keep, ridge_alpha, refit)
    shrink_mlp(block, keep, w, bias if block.fc2.bias is not None else None)
    return keep
