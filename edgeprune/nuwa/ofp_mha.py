"""OFP-MHA: data-free truncation of the QK and VO products by SVD (nuwa §3.3 eq. 7-9, suppl. §10).

Per head h of a block, with input tokens X (n x D) and the ones column 1:

* Logits. ``Q K^T = X~ A_Q^T A_K X~^T`` with the bias-augmented ``X~ = [X | 1]`` and
  ``A_Q = [W_Q | b_Q]``, ``A_K = [W_K | b_K]`` (d_h x (D+1)). The logits depend on the weights only
  through ``M_QK = A_Q^T A_K`` ((D+1) x (D+1), rank <= d_h). Eckart-Young (nuwa eq. 7-8, proof 1 in
  suppl. §10): the best rank-r approximation is the truncated SVD ``U_r S_r V_r^T``; splitting it
  symmetrically gives ``A_Q' = S_r^1/2 U_r^T``, ``A_K' = S_r^1/2 V_r^T`` (r x (D+1)): the first D
  columns are the new W_Q', W_K', the last one the new biases.
  The key bias adds ``q_i . b_K`` to every logit of query i -- a per-row constant, which softmax
  ignores. By default (``key_bias="drop"``) it is therefore left out: the truncated product is
  ``A_Q^T W_K`` ((D+1) x D), every singular value is spent on logit terms that change the attention
  weights, and b_K' = 0. The logits then equal the dense ones up to that per-row constant and the
  attention weights / outputs are exact at full rank. ``key_bias="augment"`` truncates the fully
  augmented ``A_Q^T A_K`` of METHODS.md §3 instead (raw logits exact at full rank).
* Values. The head's output is ``softmax(.) V W_O,h^T`` with ``V = X W_V^T + 1 b_V^T``. Softmax rows
  sum to 1, so the bias term is ``P 1 b_V^T W_O,h^T = 1 (W_O,h b_V)^T`` exactly: it is folded into
  the output-projection bias, ``b_O' = b_O + sum_h W_O,h b_V,h``, and the new value bias is 0. The
  rest depends on the weights only through ``M_VO = W_V^T W_O,h^T`` (D x D, rank <= d_h), truncated
  the same way: ``W_V' = S_r^1/2 U_r^T`` (r x D), ``W_O,h' = V_r S_r^1/2`` (D x r). (When the model
  has a V bias but no proj bias the fold is impossible; then the bias-augmented
  ``[W_V | b_V]^T W_O,h^T`` is truncated instead, as written in METHODS.md §3.)
* Scale. The dense logits use the module's scale (``d_h^-1/2``); :class:`PrunedAttention` uses
  ``r^-1/2`` (SDPA default), so ``scale * sqrt(r)`` (= ``sqrt(r / d_h)``) is folded into W_Q', b_Q'.

The SVD of ``A B^T`` (A, B tall, k columns) is computed without forming it: thin QR ``A = Q_a R_a``,
``B = Q_b R_b``, SVD of the small ``R_a R_b^T = u s v^T``, so ``U = Q_a u``, ``V = Q_b v`` -- exact,
float64, O(D k^2) per head. Nothing here looks at data: the factors depend on the base weights only
(cached by :mod:`edgeprune.nuwa.svd_cache`) and are shared by every sub-task and budget.

Dims (nuwa eq. 9): per layer, the retained energy of rank r in head h is
``sum_{i<r} s_i^2 / sum_i s_i^2`` (squared singular values: the Frobenius energy that Eckart-Young
bounds); the layer takes the smallest r whose mean over heads is >= rho, floored to a multiple of
``round_to`` (min ``round_to``; the full dim is kept as is).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.errors import UserError
from edgeprune.layers.rotary_attention import is_rotary
from edgeprune.surgery import qkv_parts, replace_attention

KEY_BIAS_MODES = ("drop", "augment")


@dataclasses.dataclass
class BlockFactors:
    """SVD factors of one block's attention (float32 tensors, float64 computed).

    Attributes:
        qk_u: (H, Da, d_qk), qk_v: (H, Dk, d_qk): left / right singular vectors of ``A_Q^T A_K``
            (Da = D+1 with a qkv bias, else D; Dk = D unless the key bias is augmented); qk_s: (H, d_qk) singular
            values, descending.
        vo_u: (H, Dv, d_v) (Dv = D, or D+1 when the V bias could not be folded), vo_v: (H, D, d_v),
            vo_s: (H, d_v): SVD of ``W_V^T W_O,h^T``.
        proj_bias: (D,) output bias with the V bias folded in, or None (no biases at all).
        scale: the block's current logit scale.
        qk_bias: whether the block has a qkv bias (the Q factor then carries a bias row).
        k_bias_augmented: whether the K factor carries a bias row (``key_bias="augment"``).
        v_bias_augmented: whether the V factor carries a bias row (V bias not foldable).
    """

    qk_u: torch.Tensor
    qk_s: torch.Tensor
    qk_v: torch.Tensor
    vo_u: torch.Tensor
    vo_s: torch.Tensor
    vo_v: torch.Tensor
    proj_bias: torch.Tensor | None
    scale: float
    qk_bias: bool
    k_bias_augmented: bool
    v_bias_augmented: bool

    @property
    def num_heads(self) -> int:
        return self.qk_s.shape[0]

    @property
    def qk_dim(self) -> int:
        return self.qk_s.shape[1]

    @property
    def v_dim(self) -> int:
        return self.vo_s.shape[1]


def product_svd(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SVD of ``a @ b^T`` for tall a (..., m, k), b (..., p, k) without forming the product.

    Returns:
        U (..., m, k), S (..., k) descending, V (..., p, k) with ``a b^T = U diag(S) V^T``.
    """
    qa, ra = torch.linalg.qr(a)
    qb, rb = torch.linalg.qr(b)
    u, s, vh = torch.linalg.svd(ra @ rb.transpose(-1, -2))
    return qa @ u, s, qb @ vh.transpose(-1, -2)


def _attn_scale(block: BlockAnatomy) -> float:
    scale = getattr(block.attn, "scale", None)
    return float(scale) if scale is not None else block.qk_dim ** -0.5


@torch.no_grad()
def block_factors(block: BlockAnatomy, key_bias: str = "drop") -> BlockFactors:
    """Compute the QK and VO SVD factors of one block (float64, returned as float32).

    Args:
        key_bias: "drop" (softmax-invariant key bias left out; default) or "augment".
    """
    if key_bias not in KEY_BIAS_MODES:
        raise ValueError(f"key_bias must be one of {KEY_BIAS_MODES}, got {key_bias!r}")
    if is_rotary(block.attn):
        raise UserError(f"block {block.index} rotates its queries and keys (RoPE): NuWa's QK truncation mixes "
                        "Q/K dims across RoPE pairs, which the rotation does not allow; derive does not support "
                        "rotary models (prune them: Q/K pairs, V/O, heads and MLP)")
    p = qkv_parts(block)
    H, dv = block.num_heads, block.v_dim
    wq, wk, wv = p["wq"].double(), p["wk"].double(), p["wv"].double()
    has_bias = p["bq"] is not None
    aq, ak = wq.transpose(1, 2), wk.transpose(1, 2)  # (H, D, d)
    if has_bias:
        aq = torch.cat([aq, p["bq"].double()[:, None, :]], dim=1)  # (H, D+1, d)
        if key_bias == "augment":
            ak = torch.cat([ak, p["bk"].double()[:, None, :]], dim=1)
    qk_u, qk_s, qk_v = product_svd(aq, ak)

    wo = block.proj.weight.detach().double()  # (D, H*dv)
    D = wo.shape[0]
    wo_h = wo.reshape(D, H, dv).permute(1, 0, 2)  # (H, D, dv): W_O,h
    b_o = None if block.proj.bias is None else block.proj.bias.detach().double()
    av = wv.transpose(1, 2)  # (H, D, dv) = W_V^T
    augmented = False
    proj_bias = b_o
    if has_bias:
        bv = p["bv"].double()
        if b_o is not None:
            # softmax rows sum to 1: P (1 b_V^T) W_O,h^T = 1 (W_O,h b_V)^T -- exact fold.
            proj_bias = b_o + torch.einsum("hdv,hv->d", wo_h, bv)
        else:
            av = torch.cat([av, bv[:, None, :]], dim=1)
            augmented = True
    vo_u, vo_s, vo_v = product_svd(av, wo_h)
    f = lambda t: t.float().contiguous()  # noqa: E731
    return BlockFactors(qk_u=f(qk_u), qk_s=f(qk_s), qk_v=f(qk_v), vo_u=f(vo_u), vo_s=f(vo_s),
                        vo_v=f(vo_v), proj_bias=None if proj_bias is None else f(proj_bias),
                        scale=_attn_scale(block), qk_bias=has_bias,
                        k_bias_augmented=has_bias and key_bias == "augment",
                        v_bias_augmented=augmented)


def energy_ratios(s: torch.Tensor) -> torch.Tensor:
    """Mean over heads of the retained energy ``sum_{i<r} s_i^2 / sum s_i^2`` for r = 1..d.

    Args:
        s: (H, d) singular values.

    Returns:
        (d,) float64; entry r-1 is the mean retained energy at rank r (1.0 at r = d).
    """
    e = s.double() ** 2
    tot = e.sum(-1, keepdim=True)
    ratio = torch.where(tot > 0, e.cumsum(-1) / tot.clamp_min(1e-300), torch.ones_like(e))
    return ratio.mean(0)


def rank_for_energy(s: torch.Tensor, rho: float, round_to: int = 8) -> int:
    """nuwa eq. 9: the smallest r with mean retained energy >= rho, floored to a multiple of
    ``round_to`` (min ``round_to``); the full dim d when r = d."""
    ratios = energy_ratios(s)
    d = ratios.numel()
    ok = (ratios >= rho - 1e-9).nonzero()
    r = int(ok[0]) + 1 if len(ok) else d
    if r >= d:
        return d
    return min(d, max(round_to, (r // round_to) * round_to))


def retained_energy(s: torch.Tensor, r: int) -> float:
    """Mean over heads of the energy kept at rank r."""
    return float(energy_ratios(s)[r - 1])


@torch.no_grad()
def truncate_attention(block: BlockAnatomy, factors: BlockFactors, qk_dim: int, v_dim: int) -> None:
    """Replace the block's attention, in place, by the rank-(qk_dim, v_dim) truncation (eq. 8).

    With qk_dim, v_dim equal to the full dims this reproduces the attention exactly (up to float
    round-off): the product of the factors is the original product.
    """
    H = factors.num_heads
    r, rv = int(qk_dim), int(v_dim)
    if not (1 <= r <= factors.qk_dim and 1 <= rv <= factors.v_dim):
        raise ValueError(f"block {block.index}: dims ({r}, {rv}) outside 1..({factors.qk_dim}, {factors.v_dim})")
    dtype = block.qkv.weight.dtype
    fold = factors.scale * math.sqrt(r)  # sqrt(r / d_h) for a dense block
    sq = factors.qk_s[:, :r].double().clamp_min(0).sqrt()
    aq = (factors.qk_u[:, :, :r].double() * sq[:, None, :]).transpose(1, 2) * fold  # (H, r, Da)
    ak = (factors.qk_v[:, :, :r].double() * sq[:, None, :]).transpose(1, 2)
    D = block.qkv.in_features
    wq, wk = aq[..., :D], ak[..., :D]
    bq = aq[..., D] if factors.qk_bias else None
    if factors.k_bias_augmented:
        bk = ak[..., D]
    elif factors.qk_bias:
        bk = torch.zeros(H, r, dtype=torch.float64)  # softmax-invariant key bias dropped
    else:
        bk = None
    sv = factors.vo_s[:, :rv].double().clamp_min(0).sqrt()
    av = (factors.vo_u[:, :, :rv].double() * sv[:, None, :]).transpose(1, 2)  # (H, rv, Dv)
    wv = av[..., :D]
    if factors.v_bias_augmented:
        bv = av[..., D]
    elif factors.qk_bias:
        bv = torch.zeros(H, rv, dtype=torch.float64)
    else:
        bv = None
    wo = factors.vo_v[:, :, :rv].double() * sv[:, None, :]  # (H, D, rv)
    proj_w = wo.permute(1, 0, 2).reshape(wo.shape[1], H * rv)
    c = lambda t: None if t is None else t.to(dtype).contiguous()  # noqa: E731
    replace_attention(block, c(wq), c(bq), c(wk), c(bk), c(wv), c(bv), c(proj_w), c(factors.proj_bias))


def model_factors(anatomy: ViTAnatomy, key_bias: str = "drop") -> list[BlockFactors]:
    """:func:`block_factors` for every block (uncached; see :mod:`edgeprune.nuwa.svd_cache`)."""
    return [block_factors(b, key_bias) for b in anatomy.blocks]


def layer_dims(factors: list[BlockFactors], rho: float, round_to: int = 8) -> tuple[list[int], list[int]]:
    """Per-layer (qk_dims, v_dims) for a retained-energy ratio rho (nuwa eq. 9)."""
    qk = [rank_for_energy(f.qk_s, rho, round_to) for f in factors]
    vo = [rank_for_energy(f.vo_s, rho, round_to) for f in factors]
    return qk, vo
