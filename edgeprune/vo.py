"""Attention pruning beyond Q/K: V/O head dims and whole heads, and the attention rebuild.

METHODS.md §5 ("V/O dims and whole heads"). ``z`` = the input of ``attn.proj`` (dim H*d_v, the
heads' outputs ``A_h V_h`` concatenated head-major) plays the role of the MLP hidden ``h``:

* V dims: rank the channels of z per head (``edgeprune.ranking.vo_scores``, the MLP criteria
  family; ``combined`` = sqrt(E[z_j^2]) ||W_O[:, j]|| by default), keep the same count in every
  head of a layer (reshape).
* Whole heads: P = every channel of the removed heads, S = the kept heads' (kept) channels.
  Heads are ranked by backward greedy elimination on the *removal error*
  ``E ||W_O,P (z_P - B z_S - c)||^2`` (``edgeprune.solve.mlp_ridge.removal_error``): at each
  step the head whose removal (together with those already removed) leaves the smallest error
  after the ridge fold goes. That is the quantity the fold minimises, in proj's output space,
  so it accounts for what compensation recovers: a large head that the others predict is cheap
  to remove (a per-channel energy x ||W_O|| sum cannot see that), and greedy elimination does
  not remove two heads that only predict each other. Without compensation the error is the
  removed heads' output energy ``E ||W_O,P z_P||^2`` (energy x weight at head level).
* Compensation (V dims and heads together, one solve per layer): ``B = Sigma_PS (Sigma_SS + lam
  I)^-1``, ``c = mu_P - B mu_S``, folded as ``W_O,S <- W_O,S + W_O,P B``, ``b_O <- b_O + W_O,P c``
  by the MLP's own solver and fold (``mlp_ridge.ridge_affine_map`` / ``fold_into_linear``). The V
  rows of P (and the Q/K rows of removed heads) leave ``qkv``. Blocks that lose whole heads are
  then compensated once more through the MLP that follows: ``fc2`` is refit to the dense block's
  output (``edgeprune.head_compensation``, ``edgeprune.solve.attn_heads``; docs/heads.md).
* Fused layout (``CorpConfig.layout == "fused"``): Q/K and V are pruned to the same kept dim per
  head, so every block ends with qk_dim == v_dim: an ordinary multi-head attention.

Statistics are taken on the dense model in the same calibration pass as the MLP and Q/K ones
(one-shot CORP); the Q/K fold of a kept head does not see the V fold and vice versa.
"""

from __future__ import annotations

import hashlib

import torch

from edgeprune.anatomy import BlockAnatomy
from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.errors import UserError
from edgeprune.settings import SettingError
from edgeprune.plan import BlockPlan, dims_override, kept_dim, kept_heads, pruned_indices
from edgeprune.ranking import qk_scores, top_k_indices, vo_scores
from edgeprune.layers.rotary_attention import is_rotary
from edgeprune.solve import mlp_ridge, qk_logit, qk_rope
from edgeprune.surgery import qkv_parts, replace_attention

LAYOUTS = ("default", "fused")


def attention_dims(b: BlockAnatomy, cfg) -> tuple[int, int, int]:
    """Kept (heads, qk_dim, v_dim) of block ``b`` under ``cfg`` (a :class:`CorpConfig`).

    Raises:
        UserError: rounding leaves no dims, or the fused layout would end with qk_dim != v_dim
            (e.g. a model whose Q/K was pruned before, with no attention sparsity now).
    """
    s_qk, s_v = cfg.attention_sparsities()
    s_heads = cfg.sparsity_of("heads")
    heads = kept_heads(b.num_heads, s_heads) if s_heads > 0 else b.num_heads
    qk = kept_dim(b.qk_dim, s_qk, cfg.round_to, f"block {b.index} Q/K") if s_qk > 0 else b.qk_dim
    v = kept_dim(b.v_dim, s_v, cfg.round_to, f"block {b.index} V") if s_v > 0 else b.v_dim
    given = {key: dims_override(cfg, b.index, key) for key in ("heads", "qk", "v")}
    if cfg.layout == "fused" and given["qk"] is not None and given["v"] is None:
        given["v"] = given["qk"]
    if cfg.layout == "fused" and given["v"] is not None and given["qk"] is None:
        given["qk"] = given["v"]
    for key, dense in (("heads", b.num_heads), ("qk", b.qk_dim), ("v", b.v_dim)):
        if given[key] is not None and given[key] > dense:
            raise UserError(f"block {b.index}: {given[key]} kept {key} asked, the block has {dense}")
    heads = given["heads"] if given["heads"] is not None else heads
    qk = given["qk"] if given["qk"] is not None else qk
    v = given["v"] if given["v"] is not None else v
    if cfg.layout == "fused" and qk != v:
        raise SettingError(f"{{layout}} fused: block {b.index} would end with qk_dim {qk} != v_dim {v} "
                           f"(this model's Q/K and V dims differ already: give {{attn_sparsity}}/{{v_sparsity}} "
                           f"that bring them to the same kept dim, or use {{layout}} default)")
    return heads, qk, v


def head_channels(heads: torch.Tensor, v_keep: torch.Tensor, v_dim: int) -> torch.Tensor:
    """Indices into z (H*d_v) of the kept V dims of the given heads, ascending.

    Args:
        heads: (H',) sorted head indices; v_keep: (H, d_v') sorted kept dims per head (all heads).
    """
    return (heads[:, None] * v_dim + v_keep[heads]).reshape(-1)


def rank_heads(stats: MLPStatistics, proj_weight: torch.Tensor, num_heads: int, keep: int,
               alpha: float = mlp_ridge.DEFAULT_ALPHA, compensation: bool = True,
               worst: bool = False) -> torch.Tensor:
    """Heads to keep, by backward greedy elimination on the removal error (see module doc).

    Args:
        stats: statistics of z (proj's input, H*d_v channels) with covariance.
        proj_weight: W_O (D, H*d_v).
        num_heads: H; keep: H' (1 <= H' <= H).
        alpha: ridge alpha of the fold (same as the MLP's).
        compensation: rank by the error after the ridge fold (else by the plain removal error).
        worst: remove the head with the *largest* error at each step instead (for tests: the
            inverted ranking).

    Returns:
        (H',) int64 sorted kept heads. Ties go to the lower head index.
    """
    removed = elimination_order(stats, proj_weight, num_heads, alpha, compensation, worst, upto=num_heads - keep)
    return torch.tensor([h for h in range(num_heads) if h not in removed], dtype=torch.int64)


def elimination_order(stats: MLPStatistics, proj_weight: torch.Tensor, num_heads: int,
                      alpha: float = mlp_ridge.DEFAULT_ALPHA, compensation: bool = True,
                      worst: bool = False, upto: int | None = None) -> list[int]:
    """The first ``upto`` heads (default H - 1) in the order the backward greedy elimination of :func:`rank_heads`
    removes them. Each step depends only on the heads removed before it, so keeping H' heads removes the first
    H - H' of one order. Remembered on ``stats`` per W_O and settings, and extended only as far as asked (the
    budgeted allocation asks for many H' of the same block, issue 40 item 4).
    """
    upto = num_heads - 1 if upto is None else max(0, min(int(upto), num_heads - 1))
    w = proj_weight.detach().cpu().contiguous()
    key = (hashlib.blake2b(w.view(torch.uint8).numpy(), digest_size=16).hexdigest(), tuple(w.shape), w.dtype,
           num_heads, float(alpha), bool(compensation), bool(worst), stats.count)
    removed = stats.__dict__.setdefault("_head_elimination", {}).setdefault(key, [])
    if len(removed) < upto:
        _eliminate(stats, proj_weight, num_heads, alpha, compensation, worst, removed, upto)
    return removed[:upto]


def _eliminate(stats: MLPStatistics, proj_weight: torch.Tensor, num_heads: int, alpha: float, compensation: bool,
               worst: bool, removed: list[int], upto: int) -> None:
    """Extend ``removed`` (in place) by greedy steps until it holds ``upto`` heads."""
    d_v = proj_weight.shape[1] // num_heads
    mean, cov = stats.mean, stats.cov
    full = torch.arange(d_v).repeat(num_heads, 1)
    kept = [h for h in range(num_heads) if h not in removed]
    while len(removed) < upto:
        errs = []
        for h in kept:
            s = head_channels(torch.tensor([g for g in kept if g != h]), full, d_v)
            p = head_channels(torch.tensor(sorted(removed + [h])), full, d_v)
            b = c = None
            if compensation:
                b, c, _ = mlp_ridge.ridge_affine_map(mean, cov, s, p, alpha)
            errs.append(mlp_ridge.removal_error(mean, cov, proj_weight, s, p, b, c))
        t = torch.tensor(errs, dtype=torch.float64)
        idx = int(torch.sort(-t if worst else t, stable=True).indices[0])
        removed.append(kept.pop(idx))


def plan_attention(b: BlockAnatomy, plan: BlockPlan, cfg, qk_stats, vo_stats: MLPStatistics | None) -> None:
    """Fill ``plan.head_keep``, ``plan.v_keep`` and ``plan.qk_keep`` of block ``b`` (in place).

    Args:
        b: the block; plan: its plan; cfg: :class:`CorpConfig`.
        qk_stats: the block's :class:`QKStatistics` (needed when Q/K dims are pruned).
        vo_stats: statistics of proj's input (needed when V dims or heads are pruned).

    Raises:
        UserError: rounding leaves no dims; fused layout with unequal kept dims.
        ValueError: V dims or heads to prune but no ``vo_stats``.
    """
    heads, qk, v = attention_dims(b, cfg)
    w_o = b.proj.weight.detach()
    if (heads < b.num_heads or v < b.v_dim) and vo_stats is None:
        raise ValueError(f"block {b.index}: V/O or head pruning needs the statistics of proj's input")
    if heads < b.num_heads:
        plan.head_keep = rank_heads(vo_stats, w_o, b.num_heads, heads, cfg.ridge_alpha, cfg.compensation)
    if v < b.v_dim:
        plan.v_keep = top_k_indices(vo_scores(vo_stats, w_o, b.num_heads, cfg.vo_criterion), v)
    if qk < b.qk_dim:
        if is_rotary(b.attn):  # whole RoPE pairs (METHODS.md §6)
            plan.qk_keep = qk_rope.kept_pairs_dims(qk_stats.pair_energy, qk)
        else:
            plan.qk_keep = top_k_indices(qk_scores(qk_stats), qk)


def prune_attention(b: BlockAnatomy, plan: BlockPlan, cfg, vo_stats: MLPStatistics | None,
                    qk_solve, proj_fit=None) -> dict:
    """Solve and fold the Q/K and V/O compensations of one block, then rebuild its attention.

    Args:
        b: the block (its attention is replaced by a :class:`PrunedAttention`, in place).
        plan: kept heads / Q/K dims / V dims (``None`` = all kept).
        cfg: :class:`CorpConfig` (``compensation``, ``ridge_alpha``).
        vo_stats: statistics of proj's input z (needed if V dims or heads are pruned with
            compensation).
        qk_solve: ``f(block, head) -> (M, lam, info)`` (``corp.qk_solver_from_grams``) or None.
        proj_fit: optional ``f(keep, prune, W_O, b_O) -> (W_O', b_O', lam)`` replacing the ridge
            fold of ``proj`` when compensating (the two-stream fit of ``edgeprune.sequential``);
            ``vo_stats`` is then not used by the fold.

    Raises:
        ValueError: V dims or heads pruned with compensation but no ``vo_stats``.

    Returns:
        solve info: ``vo_lambda`` (the proj fold's ridge lambda), ``qk_lambda`` / ``qk_solver``
        per compensated head.
    """
    H, dq, dv = b.num_heads, b.qk_dim, b.v_dim
    parts = qkv_parts(b)
    heads = plan.head_keep if plan.head_keep is not None else torch.arange(H)
    qk_keep = plan.qk_keep if plan.qk_keep is not None else torch.arange(dq).repeat(H, 1)
    v_keep = plan.v_keep if plan.v_keep is not None else torch.arange(dv).repeat(H, 1)
    # the current logits are q.k * scale; the rebuilt module uses 1/sqrt(d'): fold scale * sqrt(d')
    # into W_Q (fold_logit_compensation folds sqrt(d' / scale_dim)); dense timm: scale_dim = d_h
    scale_dim = float(getattr(b.attn, "scale", dq ** -0.5)) ** -2.0
    rec: dict = {}
    # proj: kept channels S of z, pruned P (V dims of kept heads + every channel of removed heads)
    keep = head_channels(heads, v_keep, dv)
    prune = pruned_indices(keep, H * dv)
    w_o = b.proj.weight.detach()
    b_o = None if b.proj.bias is None else b.proj.bias.detach()
    if len(prune) > 0:
        bmat = cvec = None
        if cfg.compensation and proj_fit is not None:
            w_o, b_o, rec["vo_lambda"] = proj_fit(keep, prune, w_o, b_o)
        elif cfg.compensation:
            if vo_stats is None:
                raise ValueError(f"block {b.index}: the proj fold needs the statistics of proj's input")
            bmat, cvec, lam = mlp_ridge.ridge_affine_map(vo_stats.mean, vo_stats.cov, keep, prune, cfg.ridge_alpha)
            rec["vo_lambda"] = lam
        if not (cfg.compensation and proj_fit is not None):
            w_o, b_o = mlp_ridge.fold_into_linear(w_o, b_o, keep, prune, bmat, cvec)
    wq, wk, bq, bk, lams, how = [], [], [], [], [], []
    rotary = is_rotary(b.attn)
    for h in heads.tolist():
        kq = qk_keep[h]
        m = None
        # nothing pruned in this head: M = 0 exactly, skip the d'^2 x d'^2 solve
        if cfg.compensation and qk_solve is not None and len(kq) < dq:
            m, lam, solved = qk_solve(b.index, h)
            lams.append(lam)
            how.append(solved["solver"])
        sel = lambda t: None if t is None else t[h][kq]  # noqa: E731
        if rotary and m is not None and how and how[-1] == "rope-general":  # q' = (I + M) q before the rotation
            out = (*qk_rope.fold_rope_general(sel(parts["wq"]), sel(parts["bq"]), m, scale_dim),
                   sel(parts["wk"]), sel(parts["bk"]))
        elif rotary:  # the pair-form M commutes with the rotation: folded into W_Q alone (qk_rope)
            out = (*qk_rope.fold_rope_compensation(sel(parts["wq"]), sel(parts["bq"]), m, scale_dim),
                   sel(parts["wk"]), sel(parts["bk"]))
        else:
            out = qk_logit.fold_logit_compensation(sel(parts["wq"]), sel(parts["bq"]),
                                                   sel(parts["wk"]), sel(parts["bk"]), m, scale_dim)
        wq.append(out[0]); bq.append(out[1]); wk.append(out[2]); bk.append(out[3])
    stack = lambda ts: None if ts[0] is None else torch.stack(ts)  # noqa: E731
    wv = torch.stack([parts["wv"][h][v_keep[h]] for h in heads.tolist()])
    bv = None if parts["bv"] is None else torch.stack([parts["bv"][h][v_keep[h]] for h in heads.tolist()])
    rope = None
    if rotary:  # the kept heads' tables, at their kept pairs
        idx = heads.tolist()
        rope = tuple(torch.stack([t[h][:, qk_keep[h]] for h in idx]) for t in (b.attn.rope_cos, b.attn.rope_sin))
    replace_attention(b, torch.stack(wq), stack(bq), torch.stack(wk), stack(bk), wv, bv, w_o, b_o, rope=rope)
    if lams:
        rec["qk_lambda"] = lams
        rec["qk_solver"] = how
    return rec
