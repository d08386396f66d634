"""Proportional attention (ToMe, Bolya et al., ICLR 2023, §3 "Tracking Token Size", eq. 1) with the keys ToMe
matches tokens on.

A token that stands for s input patches should weigh in the softmax as s copies of itself would: ToMe adds
``log s`` to the attention logits of every key,

    A = softmax(Q K^T / sqrt(d) + log s),

which is exact for duplicates (k copies of one key/value pair, given a logit bias of log k, give the same
attention output as the copies themselves). The same module runs timm's ``Attention`` and edgeprune's
``PrunedAttention`` (uneven Q/K and V head dims, kept heads): their fused ``qkv`` rows are ``[q; k; v]``, head-major,
and their ``scale`` is the logit scale; the output goes through their ``proj``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def proportional_attention(attn: nn.Module, x: torch.Tensor, size: torch.Tensor | None,
                           query_tokens: int | None = None, tokens: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention of ``attn`` on ``x`` with ``log size`` added to every key's logits.

    Args:
        attn: a timm ``Attention`` or a ``PrunedAttention`` (H heads, d_qk, d_v; fused ``qkv``, ``proj``, ``scale``).
        x: (B, N, D) normed tokens.
        size: (B, N, 1) patches per token, or None (every token 1: plain attention).
        query_tokens: T: the queries of the first T tokens only (the class-token last block), None = all N.
        tokens: N as a Python int (a merge block knows it; then an exported graph's reshapes hold constant token
            counts that ONNX shape inference follows); None: ``x.shape[1]``.

    Returns:
        ``(out, metric)``: out (B, T or N, D), the attention output after ``proj``; metric (B, N, d_qk), the keys
        averaged over heads (ToMe §3, "Token Similarity").
    """
    B, n = x.shape[0], (x.shape[1] if tokens is None else int(tokens))
    H = int(attn.num_heads)
    dq = int(getattr(attn, "qk_dim", attn.head_dim))
    dv = int(getattr(attn, "v_dim", attn.head_dim))
    w, b = attn.qkv.weight, attn.qkv.bias
    if query_tokens is None:
        q, k, v = F.linear(x, w, b).split([H * dq, H * dq, H * dv], dim=-1)
        t = n
    else:
        t = int(query_tokens)
        q = F.linear(x[:, :t], w[:H * dq], None if b is None else b[:H * dq])
        k, v = F.linear(x, w[H * dq:], None if b is None else b[H * dq:]).split([H * dq, H * dv], dim=-1)
    q = q.reshape(B, t, H, dq).transpose(1, 2)
    k = k.reshape(B, n, H, dq).transpose(1, 2)
    v = v.reshape(B, n, H, dv).transpose(1, 2)
    rotate = getattr(attn, "rotate", None)
    if rotate is not None:  # RotaryAttention, never merged (tokens.apply refuses): the first t / n tokens' tables
        q, k = rotate(q), rotate(k)
    bias = None if size is None else size.log().transpose(1, 2).unsqueeze(1)  # (B, 1, 1, N)
    if bias is not None and torch.compiler.is_exporting():
        # torch.export (opset-23 Attention, exporters.onnx attention="standard"): ONNX Runtime's Attention kernel
        # wants the mask's query axis at full length, not broadcast (attention_helper.h, "inconsistent
        # q_sequence_length"); the TorchScript export adds the (B, 1, 1, N) bias with broadcasting as it is
        bias = bias.expand(-1, -1, t, -1)
    drop = getattr(attn, "attn_drop", None)
    p = float(drop.p) if isinstance(drop, nn.Dropout) and attn.training else 0.0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=float(attn.scale))
    out = attn.proj(out.transpose(1, 2).reshape(B, t, H * dv))
    proj_drop = getattr(attn, "proj_drop", None)
    return (proj_drop(out) if proj_drop is not None else out), k.mean(dim=1)
