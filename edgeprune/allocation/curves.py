"""Error curves E(k) of the budgeted allocation: the calibration error of keeping k dims of one module.

METHODS.md §5 "Budgeted allocation". Every curve is computed from the statistics of the one
calibration pass (nothing is re-run), for the kept sets the plan would choose (the same ranking
as ``edgeprune.corp.plan_corp``), at every candidate kept size (multiples of ``round_to``, and the
dense size).

MLP hidden channels (fc2) and V dims (proj), with compensation: the output error left after the
closed-form ridge fold, in the consuming Linear's output space (the residual stream; LayerScale
included),

    E(k) = tr(W_P (Sigma_PP - Sigma_PS (Sigma_SS + lam I)^-1 Sigma_SP) W_P^T),

S = the first k ranked channels, P = the rest. For nested prefixes all E(k) come from one
Cholesky ``L L^T = Sigma_rr + lam I`` of the ranked covariance: the Schur complement of the
leading k x k block is ``L_PP L_PP^T`` and, L being lower triangular, ``W_P L_PP = (W_r L)[:, k:]``,
so with ``F = W_r L``:

    E(k) = sum_{j >= k} ||F[:, j]||^2 - lam ||W_P||_F^2.

Approximations, both O(lam) with lam = alpha x mean variance (alpha = 1e-3 by default): (1) one
lam per module (alpha x the mean variance of *all* its channels) where the fold uses
alpha x the mean variance of the kept ones; (2) the fold's error carries an extra
``- lam ||(Sigma_SS + lam I)^-1 Sigma_SP W_P^T||^2``. At alpha = 0 the curve equals
``mlp_ridge.removal_error`` after the fold exactly (tests/test_allocation.py). V dims are the same
with z = proj's input, ranked per head, ordered (rank 0 of every head, rank 1 of every head, ...),
so the prefix of length k H is "the top k of every head".

Whole heads: the error after the fold (``mlp_ridge.removal_error``) for the heads
``edgeprune.vo.rank_heads`` keeps, one solve per candidate count.

Q/K dims (per head, summed over the block's heads): the residual of the logit compensation with a
*diagonal* M, ``sum_i ||Q_P K_P^T - Q_S diag(m) K_S^T||_F^2`` minimised over m. With
``T = sum_i Gq_i o Gk_i`` (Hadamard; PSD by the Schur product theorem) it is
``1^T T_PP 1 - r^T T_SS^-1 r`` with ``r = T_SP 1``: the same Schur complement form, so all k come
from one Cholesky of the ranked T (``E(k) = sum_{j >= k} (1^T L)_j^2 - lam (d - k)``). It is an
upper bound of the exact system's residual (which fits a full M) and a lower bound of the
uncompensated ``||Q_P K_P^T||^2`` -- cheap (d_h x d_h per head) where the exact residual needs a
d'^2 x d'^2 solve per candidate.

Without compensation (or without the second-order statistics: no MLP covariance, no Q/K Grams)
the curves are the diagonal removal errors ``sum_{j in P} E[h_j^2] ||W[:, j]||^2`` and
``sum_{a in P} T_aa`` (cross terms ignored).

Normalisation (:func:`normalise`, "residual"): an error in the residual stream after block i
matters in proportion to the stream's energy there (the next LayerNorm divides by its RMS). The
pass does not collect the stream itself, so its energy is approximated by R_i = sum_{j <= i} e_j,
e_j = the energy E||W h||^2 of block j's MLP output (or of its proj output when only attention
statistics exist): MLP / V / heads curves are divided by R_i. Q/K curves (logit units) are made
relative (divided by the head's total logit energy, their E(0)) and mapped to the same scale as
``QK_WEIGHT * e_i / R_i`` ("removing all logit energy of block i costs QK_WEIGHT times removing
its whole MLP output"). docs/allocation.md reports the measurement behind both choices: on
fmnist-vit the Spearman correlation of the summed proxy with the measured final-output error over
allocations at the same FLOPs was 0.35 with per-module relative errors and 0.91-0.95 with this
normalisation at QK_WEIGHT 0.1-0.2.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from edgeprune.anatomy import BlockAnatomy
from edgeprune.ranking import mlp_scores, qk_scores, vo_scores
from edgeprune.solve import mlp_ridge
from edgeprune.vo import head_channels, rank_heads


QK_WEIGHT = 0.2  # Q/K relative logit error -> MLP-output units (measured, docs/allocation.md)


@dataclasses.dataclass
class Curve:
    """The error curve of one allocation unit.

    Attributes:
        block: block index.
        keys: the ``CorpConfig.dims`` keys this unit sets (("mlp",), ("qk",), ("v",), ("heads",)
            or ("qk", "v") tied in the fused layout).
        ks: candidate kept counts, ascending (the last one = dense).
        raw: E(k) for each candidate, in the module's own units (float64 list).
        scale: the normaliser: E(0) on construction, then set by :func:`normalise`;
            ``error(i) = raw[i] / scale``.
        kind: "compensated" or "uncompensated" (diagonal) for the report.
    """

    block: int
    keys: tuple[str, ...]
    ks: list[int]
    raw: list[float]
    scale: float
    kind: str

    @property
    def errors(self) -> list[float]:
        """Normalised errors, one per candidate (unit-free)."""
        s = self.scale if self.scale > 0 else 1.0
        return [max(e, 0.0) / s for e in self.raw]


def candidate_sizes(dim: int, round_to: int) -> list[int]:
    """Multiples of ``round_to`` up to ``dim``, and ``dim`` itself, ascending."""
    ks = list(range(round_to, dim + 1, round_to))
    if not ks or ks[-1] != dim:
        ks.append(dim)
    return ks


def _chol(a: torch.Tensor) -> torch.Tensor:
    """Cholesky of a PSD matrix, adding a tiny jitter only if needed: 1e-12, 1e-10, ..., 1e-4 x
    mean diag, five tries counted, not compared (``1e-12 m 100^4`` can round above ``1e-4 m``,
    which skipped the last try and raised for a covariance of 4 calibration images whose
    eigenvalue -2.4e-10 needed the 1e-4 jitter, 2e-8).

    Raises:
        torch.linalg.LinAlgError: still not positive definite with the largest jitter.
    """
    l, info = torch.linalg.cholesky_ex(a)
    jitter = 1e-12 * float(torch.diagonal(a).abs().mean().clamp_min(1e-300))
    tries = 0
    while int(info) != 0:
        if tries == 5:
            raise torch.linalg.LinAlgError("covariance not positive semi-definite")
        l, info = torch.linalg.cholesky_ex(a + jitter * torch.eye(a.shape[0], dtype=a.dtype))
        jitter *= 100
        tries += 1
    return l


def prefix_errors(cov: torch.Tensor, weight: torch.Tensor, order: torch.Tensor, lengths: list[int],
                  lam: float) -> list[float]:
    """Compensated output error of keeping the first ``l`` channels of ``order``, for each ``l``.

    ``E(l) = tr(W_P (Sigma_PP - Sigma_PS (Sigma_SS + lam I)^-1 Sigma_SP) W_P^T)`` for every prefix
    from one Cholesky (module doc; METHODS.md §5).

    Args:
        cov: Sigma (D, D) centred covariance (any float dtype; computed in float64).
        weight: W (D_out, D) of the consuming Linear.
        order: (D,) int64 channel order (most important first).
        lengths: prefix lengths l in [0, D].
        lam: ridge lambda (>= 0).

    Returns:
        E(l) for each l (squared output units per token).
    """
    idx = order.long()
    a = cov.double()[idx][:, idx] + lam * torch.eye(len(idx), dtype=torch.float64)
    w = weight.double()[:, idx]
    f = w @ _chol(a)
    col = (f * f).sum(0)
    suffix = torch.flip(torch.cumsum(torch.flip(col, [0]), 0), [0])
    wsq = (w * w).sum(0)
    wsuffix = torch.flip(torch.cumsum(torch.flip(wsq, [0]), 0), [0])
    d = len(idx)
    out = []
    for l in lengths:
        out.append(0.0 if l >= d else float(suffix[l] - lam * wsuffix[l]))
    return out


def diagonal_errors(energy: torch.Tensor, weight: torch.Tensor, order: torch.Tensor,
                    lengths: list[int]) -> list[float]:
    """Uncompensated diagonal error ``sum_{j in P} E[h_j^2] ||W[:, j]||^2`` per prefix length."""
    idx = order.long()
    per = energy.double()[idx].clamp_min(0) * weight.double()[:, idx].pow(2).sum(0)
    suffix = torch.flip(torch.cumsum(torch.flip(per, [0]), 0), [0])
    return [0.0 if l >= len(idx) else float(suffix[l]) for l in lengths]


def _effective_weight(linear, layer_scale) -> torch.Tensor:
    """W of the Linear as seen by the residual stream: diag(gamma) W when a LayerScale follows."""
    w = linear.weight.detach().double()
    gamma = getattr(layer_scale, "gamma", None) if layer_scale is not None else None
    if gamma is not None:
        w = gamma.detach().double()[:, None] * w
    return w


def _module_lambda(cov: torch.Tensor, alpha: float) -> float:
    return float(alpha * torch.diagonal(cov).double().mean().clamp_min(0))


def mlp_curve(b: BlockAnatomy, st, cfg) -> Curve:
    """E(k) of the block's MLP hidden channels (module doc). ``st``: its :class:`MLPStatistics`."""
    ks = candidate_sizes(b.mlp_hidden, cfg.round_to)
    w = _effective_weight(b.fc2, b.ls2)
    order = torch.sort(mlp_scores(st, b.fc2.weight.detach(), cfg.mlp_criterion), descending=True,
                       stable=True).indices
    raw, scale, kind = _fold_errors(st, w, order, ks, cfg, cfg.compensation and st.second_order)
    return Curve(b.index, ("mlp",), ks, raw, scale, kind)


def _fold_errors(st, w: torch.Tensor, order: torch.Tensor, lengths: list[int], cfg,
                 compensated: bool) -> tuple[list[float], float, str]:
    """(E(k) for every prefix length, E(0) without ridge, kind) of one linear layer's input
    channels: the compensated prefix errors, or the diagonal removal errors without compensation."""
    if compensated:
        cov = st.cov
        raw = prefix_errors(cov, w, order, lengths, _module_lambda(cov, cfg.ridge_alpha))
        return raw, prefix_errors(cov, w, order, [0], 0.0)[0], "compensated"
    raw = diagonal_errors(st.energy, w, order, lengths)
    return raw, diagonal_errors(st.energy, w, order, [0])[0], "uncompensated"


def v_order(st, proj_weight: torch.Tensor, num_heads: int, criterion: str) -> torch.Tensor:
    """Channel order of z (H*d_v) such that its prefix of length k H = the top k V dims of every head."""
    scores = vo_scores(st, proj_weight, num_heads, criterion)  # (H, d_v)
    d_v = scores.shape[1]
    rank = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # (H, d_v)
    chans = torch.arange(num_heads)[:, None] * d_v + rank  # (H, d_v)
    return chans.T.reshape(-1)


def v_curve(b: BlockAnatomy, st, cfg, ks: list[int] | None = None) -> Curve:
    """E(k) of the block's V dims (same count per head; module doc). ``st``: proj-input statistics."""
    ks = ks or candidate_sizes(b.v_dim, cfg.round_to)
    w = _effective_weight(b.proj, b.ls1)
    order = v_order(st, b.proj.weight.detach(), b.num_heads, cfg.vo_criterion)
    lengths = [k * b.num_heads for k in ks]
    raw, scale, kind = _fold_errors(st, w, order, lengths, cfg, cfg.compensation)
    return Curve(b.index, ("v",), ks, raw, scale, kind)


def heads_curve(b: BlockAnatomy, st, cfg) -> Curve:
    """Error after the fold of keeping the heads ``edgeprune.vo.rank_heads`` keeps, per head count."""
    H, d_v = b.num_heads, b.v_dim
    w_raw = b.proj.weight.detach()
    w = _effective_weight(b.proj, b.ls1)
    full = torch.arange(d_v).repeat(H, 1)
    ks = list(range(1, H + 1))
    raw = []
    for k in ks[:-1]:  # fewer than H heads; all H (the last) leave no error
        kept = rank_heads(st, w_raw, H, k, cfg.ridge_alpha, cfg.compensation)
        removed = torch.tensor([h for h in range(H) if h not in set(kept.tolist())])
        s, p = head_channels(kept, full, d_v), head_channels(removed, full, d_v)
        bm = c = None
        if cfg.compensation:
            bm, c, _ = mlp_ridge.ridge_affine_map(st.mean, st.cov, s, p, cfg.ridge_alpha)
        raw.append(mlp_ridge.removal_error(st.mean, st.cov, w, s, p, bm, c))
    raw.append(0.0)
    scale = float((w @ st.cov.double() * w).sum()) if cfg.compensation else \
        float((st.energy.double().clamp_min(0) * w.pow(2).sum(0)).sum())
    return Curve(b.index, ("heads",), ks, raw, scale, "compensated" if cfg.compensation else "uncompensated")


def qk_hadamard(qk_stats) -> torch.Tensor | None:
    """T (H, d, d) float64 = sum_i Gq_i o Gk_i per head, or None when the Grams were not kept."""
    if not getattr(qk_stats, "keep_grams", False) or not getattr(qk_stats, "_gq", None):
        return None
    gq, gk = qk_stats.grams()
    t = torch.zeros(gq.shape[1:], dtype=torch.float64)
    for i in range(0, gq.shape[0], 256):  # chunks: bounded float64 temporaries
        t += (gq[i:i + 256].double() * gk[i:i + 256].double()).sum(0)
    return t


def qk_head_errors(t: torch.Tensor, order: torch.Tensor, ks: list[int], lam: float) -> list[float]:
    """Diagonal-M compensated logit residual of one head for each kept count k (module doc).

    Args:
        t: T (d, d) = sum_i Gq_i o Gk_i; order: (d,) ranked dims; ks: kept counts; lam: ridge.
    """
    idx = order.long()
    a = t[idx][:, idx] + lam * torch.eye(len(idx), dtype=torch.float64)
    csum = _chol(a).sum(0)
    suffix = torch.flip(torch.cumsum(torch.flip(csum * csum, [0]), 0), [0])
    d = len(idx)
    return [0.0 if k >= d else float(suffix[k] - lam * (d - k)) for k in ks]


def qk_curve(b: BlockAnatomy, st, cfg, ks: list[int] | None = None) -> Curve:
    """E(k) of the block's Q/K dims, summed over heads (module doc). ``st``: its QKStatistics."""
    ks = ks or candidate_sizes(b.qk_dim, cfg.round_to)
    scores = qk_scores(st)  # (H, d)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    t = qk_hadamard(st) if cfg.compensation else None
    raw = [0.0] * len(ks)
    scale = 0.0
    for h in range(b.num_heads):
        if t is not None:
            th = t[h]
            lam = float(cfg.qk_ridge_alpha * torch.diagonal(th).mean().clamp_min(0))
            errs = qk_head_errors(th, order[h], ks, lam)
            scale += float(th.sum())
        else:  # diagonal only: T_aa = N x logit energy
            per = scores[h][order[h]].double()
            suffix = torch.flip(torch.cumsum(torch.flip(per, [0]), 0), [0])
            errs = [0.0 if k >= len(per) else float(suffix[k]) for k in ks]
            scale += float(per.sum())
        raw = [r + e for r, e in zip(raw, errs)]
    return Curve(b.index, ("qk",), ks, raw, scale, "compensated" if t is not None else "uncompensated")


def tie_curves(a: Curve, b: Curve) -> Curve:
    """One unit setting both modules to the same kept count (fused layout: qk_dim == v_dim);
    normalised errors add. Only the counts both curves have are kept."""
    common = [k for k in a.ks if k in set(b.ks)]
    ea = dict(zip(a.ks, a.errors))
    eb = dict(zip(b.ks, b.errors))
    return Curve(a.block, a.keys + b.keys, common, [ea[k] + eb[k] for k in common], 1.0, a.kind)


def output_energy(st, weight: torch.Tensor) -> float:
    """E||W h||^2 per token (no bias) = tr(W (Sigma + mu mu^T) W^T) from the statistics of h."""
    w = weight.double()
    mu = st.mean.double()
    if st.second_order:
        g = st.cov.double() + torch.outer(mu, mu)
        return float((w @ g * w).sum())
    return float((st.energy.double().clamp_min(0) * w.pow(2).sum(0)).sum())


def _block_energy(b, stats) -> float | None:
    """Block ``b``'s output energy for :func:`normalise` (fc2's from the MLP statistics, else proj's from the V/O
    ones; None without either), kept in ``stats.derived`` by the weight's bytes: every candidate allocation of a
    prune (and a latency correction's rounds) normalises with the same statistics and weights (issue 40 item 4)."""
    mlp = stats.mlp[b.index] if stats.mlp else None
    vo = stats.vo[b.index] if stats.vo else None
    if mlp is None and vo is None:
        return None
    st = mlp if mlp is not None else vo
    w = _effective_weight(b.fc2, b.ls2) if mlp is not None else _effective_weight(b.proj, b.ls1)
    key = ("allocation.energy", b.index, mlp is not None, tuple(w.shape),
           hashlib.blake2b(w.cpu().contiguous().numpy().tobytes(), digest_size=16).hexdigest())
    cache = getattr(stats, "derived", None)
    if cache is None:
        return output_energy(st, w)
    if key not in cache:
        cache[key] = output_energy(st, w)
    return cache[key]


def normalise(curves: list[Curve], anatomy, stats, qk_weight: float | None = None) -> None:
    """Set every curve's ``scale`` so that errors of all blocks and module types are comparable
    (module doc, "Normalisation"; in place). ``qk_weight``: the Q/K weight (default
    :data:`QK_WEIGHT`)."""
    qk_weight = QK_WEIGHT if qk_weight is None else float(qk_weight)
    energy = [_block_energy(b, stats) for b in anatomy.blocks]
    known = all(e is not None and e > 0 for e in energy)
    residual = []
    total = 0.0
    for e in energy:
        total += e or 0.0
        residual.append(total)
    for c in curves:
        e0 = c.scale if c.scale > 0 else 1.0  # E(0) of the curve
        if not known:  # no output energies: every curve relative to its own E(0)
            c.scale = e0
        elif c.keys == ("qk",):
            c.scale = e0 * residual[c.block] / (qk_weight * float(energy[c.block] or 1.0))
        else:
            c.scale = residual[c.block]
