"""One block of sequential calibration: statistics on both streams, ranking, two-stream fit,
fold and surgery (module doc of ``edgeprune.sequential``)."""

from __future__ import annotations

import time

import torch

from edgeprune.anatomy import BlockAnatomy
from edgeprune.calibration.collect import split_qk
from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.calibration.qk_stats import QKStatistics
from edgeprune.corp.qk_solvers import qk_solver_from_grams
from edgeprune.corp.steps import mlp_kept
from edgeprune.head_compensation import refit_from_streams
from edgeprune.layers.rotary_attention import is_rotary
from edgeprune.plan import BlockPlan, pruned_indices
from edgeprune.ranking import mlp_scores, top_k_indices
from edgeprune.sequential.cross import CrossStatistics
from edgeprune.sequential.streams import Stream
from edgeprune.solve import cross_fit, mlp_ridge
from edgeprune.solve.qk_logit_cross import QKCrossGrams, cross_rhs
from edgeprune.surgery import shrink_mlp
from edgeprune.vo import attention_dims, plan_attention, prune_attention


def block_modules(b: BlockAnatomy, cfg) -> dict:
    """What block ``b`` prunes under ``cfg``: ``{"mlp": kept channels, "heads", "qk", "v",
    "prune_mlp", "prune_qk", "prune_vo"}``.

    Raises:
        UserError: as ``corp.mlp_kept`` / ``vo.attention_dims``.
    """
    heads, qk, v = attention_dims(b, cfg)
    k = mlp_kept(b, cfg)
    return {"mlp": k, "heads": heads, "qk": qk, "v": v, "prune_mlp": k < b.mlp_hidden,
            "prune_qk": qk < b.qk_dim, "prune_vo": heads < b.num_heads or v < b.v_dim}


class _Capture:
    """Forward hooks on one block: ``qkv`` output, ``proj`` input, ``fc2`` input."""

    def __init__(self, b: BlockAnatomy, qk: bool, vo: bool, mlp: bool) -> None:
        self.out: dict[str, torch.Tensor] = {}
        self.handles = []
        if qk:
            self.handles.append(b.qkv.register_forward_hook(lambda _m, _a, o: self.out.__setitem__("qkv", o)))
        if vo:
            self.handles.append(b.proj.register_forward_pre_hook(lambda _m, a: self.out.__setitem__("z", a[0])))
        if mlp:
            self.handles.append(b.fc2.register_forward_pre_hook(lambda _m, a: self.out.__setitem__("h", a[0])))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _two_stream_fit(weight, bias, keep, own: MLPStatistics, cross: CrossStatistics | None, alpha: float):
    """Fold of a Linear whose input channels ``keep`` survive (cross_fit; equal streams: CORP)."""
    if cross is None:  # streams equal: Cov(h, h~) = Sigma~, mu = mu~
        cov_x, mean_d = own.cov, own.mean
    else:
        cov_x, mean_d = cross.cov, cross.mean_dense
    t_mat, t_vec, lam = cross_fit.cross_affine_map(mean_d, own.mean, cov_x, own.cov, keep, alpha)
    w, b = cross_fit.fold_cross_map(weight, bias, t_mat, t_vec)
    return w, b, lam


@torch.no_grad()
def prune_block(b: BlockAnatomy, what: dict, cfg, dense: Stream, pruned: Stream, shared: bool,
                 gram_dtype: torch.dtype) -> dict:
    """Statistics pass on both streams (advancing the dense one), ranking, fit, fold and surgery
    of one block (in place). Returns the block's solve info."""
    comp = cfg.compensation
    two = comp and not shared
    H, dq = b.num_heads, b.qk_dim
    mlp_st = MLPStatistics(b.mlp_hidden, gram_dtype, comp) if what["prune_mlp"] else None
    mlp_x = CrossStatistics(b.mlp_hidden, gram_dtype) if what["prune_mlp"] and two else None
    qk_st = (QKStatistics(H, dq, keep_grams=comp, gram_dtype=gram_dtype, rotary=is_rotary(b.attn))
             if what["prune_qk"] else None)
    qk_x = QKCrossGrams(H, dq) if what["prune_qk"] and two else None
    vo_st = MLPStatistics(b.proj.in_features, gram_dtype, True) if what["prune_vo"] else None
    vo_x = CrossStatistics(b.proj.in_features, gram_dtype) if what["prune_vo"] and two else None
    cap = _Capture(b, qk_st is not None, vo_st is not None, mlp_st is not None)
    try:
        for j in range(len(dense)):
            xd = dense.get(j)
            n = xd.shape[0]
            inp = xd if shared else torch.cat([xd, pruned.get(j)])
            cap.out.clear()
            out = b.block(inp)
            dense.set(j, out[:n])
            both = lambda t: (t, t) if shared else (t[:n], t[n:])  # noqa: E731
            if mlp_st is not None:
                hd, hp = both(cap.out["h"])
                mlp_st.add_batch(hp)
                if mlp_x is not None:
                    mlp_x.add_batch(hd, hp)
            if vo_st is not None:
                zd, zp = both(cap.out["z"])
                vo_st.add_batch(zp)
                if vo_x is not None:
                    vo_x.add_batch(zd, zp)
            if qk_st is not None:
                q, k = split_qk(cap.out["qkv"], H, dq, b.attn)
                (qd, qp), (kd, kp) = both(q), both(k)
                qk_st.add_batch(qp, kp)
                if qk_x is not None:
                    qk_x.add_batch(qd, kd, qp, kp)
    finally:
        cap.remove()
    t_solve = time.perf_counter()
    plan = BlockPlan(index=b.index)
    if what["prune_mlp"]:
        plan.mlp_keep = top_k_indices(mlp_scores(mlp_st, b.fc2.weight.detach(), cfg.mlp_criterion), what["mlp"])
    if what["prune_qk"] or what["prune_vo"]:
        plan_attention(b, plan, cfg, qk_st, vo_st)
    rec: dict = {"index": b.index}
    if plan.mlp_keep is not None:
        keep = plan.mlp_keep
        w2 = b.fc2.weight.detach()
        b2 = None if b.fc2.bias is None else b.fc2.bias.detach()
        if comp:
            w2, b2, rec["mlp_lambda"] = _two_stream_fit(w2, b2, keep, mlp_st, mlp_x, cfg.ridge_alpha)
        else:
            w2, b2 = mlp_ridge.fold_into_linear(w2, b2, keep, pruned_indices(keep, b.mlp_hidden), None, None)
        shrink_mlp(b, keep, w2, b2)
    if plan.prunes_attention:
        qk_solve = proj_fit = None
        if comp and qk_st is not None:
            rhs_fn = None
            if qk_x is not None:
                gq, gk = qk_st.grams()
                xq, xk = qk_x.grams()
                rhs_fn = lambda _i, h, keep, _p: cross_rhs(gq[:, h], gk[:, h], xq[:, h], xk[:, h], keep)  # noqa: E731
            qk_solve = qk_solver_from_grams({b.index: qk_st}, {b.index: plan}, cfg, rhs_fn)
        if comp and vo_st is not None:
            def proj_fit(keep, _prune, w, bias):
                return _two_stream_fit(w, bias, keep, vo_st, vo_x, cfg.ridge_alpha)
        rec.update(prune_attention(b, plan, cfg, vo_st, qk_solve, proj_fit))
        if comp and what["heads"] < H and pruned is not dense:  # whole heads: fc2 refit (docs/heads.md)
            rec.update(refit_from_streams(b, dense, pruned, cfg))
    rec["solve_seconds"] = time.perf_counter() - t_solve
    return rec


@torch.no_grad()
def advance(b: BlockAnatomy, stream: Stream) -> None:
    """Run block ``b`` over every chunk of ``stream`` (in place)."""
    for j in range(len(stream)):
        stream.set(j, b.block(stream.get(j)))
