"""Multi-head self-attention whose Q/K head dim (qk_dim) may differ from its V head dim (v_dim).

After CORP prunes Q/K head dims (corp-v1 §3.3) or NuWa truncates the QK and VO products
(nuwa §3.3), a head computes logits from ``qk_dim``-dimensional queries and keys but still mixes
``v_dim``-dimensional values. timm's ``Attention`` ties both to ``head_dim``; this module keeps them
apart while staying a drop-in replacement (same forward signature, fused ``qkv`` Linear, output
``proj``), so it exports to ONNX as plain MatMul/Softmax ops. ``num_heads`` may be smaller than the
dense model's (whole heads pruned, METHODS.md §5).

When qk_dim == v_dim (edgeprune's ``--layout fused``) the module is an ordinary multi-head
attention: q, k, v come out of ``qkv`` exactly as in timm (one reshape to (3, B, H, N, d)), so
``F.scaled_dot_product_attention`` may pick its fused kernels (FlashAttention on GPU, the flash CPU
kernel), which require the same last dim for q, k and v. With qk_dim != v_dim PyTorch falls back
to the unfused math/efficient path.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class PrunedAttention(nn.Module):
    """Self-attention with separate Q/K and V head dims.

    Args:
        dim: token width D (input and output).
        num_heads: H (the kept heads when whole heads were pruned).
        qk_dim: per-head query/key dim d_qk (>= 1).
        v_dim: per-head value dim d_v (>= 1).
        qkv_bias: whether ``qkv`` has a bias.
        proj_bias: whether ``proj`` has a bias.
        scale: logit scale; ``None`` means ``qk_dim ** -0.5`` (SDPA's default). edgeprune folds any
            other scale (the dense ``head_dim ** -0.5``) into the query weights so that the default
            applies and the exported graph is a plain attention (METHODS.md §1, "Scale").
        dense_head_dim: head_dim of the dense model this module was pruned from (bookkeeping).

    Shapes:
        ``qkv``: Linear(D, H*(2*d_qk + d_v)), output rows ``[q; k; v]``, each head-major.
        ``proj``: Linear(H*d_v, D).
        forward: x (B, N, D) -> (B, N, D).
    """

    def __init__(self, dim: int, num_heads: int, qk_dim: int, v_dim: int,
                 qkv_bias: bool = True, proj_bias: bool = True,
                 scale: Optional[float] = None, dense_head_dim: Optional[int] = None) -> None:
        super().__init__()
        if min(dim, num_heads, qk_dim, v_dim) < 1:
            raise ValueError(f"all dims must be >= 1, got dim={dim} heads={num_heads} "
                             f"qk_dim={qk_dim} v_dim={v_dim}")
        self.num_heads = num_heads
        self.qk_dim = qk_dim
        self.v_dim = v_dim
        self.head_dim = v_dim  # what timm code reading `.head_dim` means: the output per head
        self.dense_head_dim = int(dense_head_dim or qk_dim)
        self.scale = qk_dim ** -0.5 if scale is None else float(scale)
        self.qkv = nn.Linear(dim, num_heads * (2 * qk_dim + v_dim), bias=qkv_bias)
        self.proj = nn.Linear(num_heads * v_dim, dim, bias=proj_bias)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                **_: object) -> torch.Tensor:
        B, N, _ = x.shape
        H, dq, dv = self.num_heads, self.qk_dim, self.v_dim
        if dq == dv:  # ordinary MHA: timm's layout, fused SDPA kernels apply
            q, k, v = self.qkv(x).reshape(B, N, 3, H, dq).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = self.qkv(x).split([H * dq, H * dq, H * dv], dim=-1)
            q = q.reshape(B, N, H, dq).transpose(1, 2)
            k = k.reshape(B, N, H, dq).transpose(1, 2)
            v = v.reshape(B, N, H, dv).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)
        out = out.transpose(1, 2).reshape(B, N, H * dv)
        return self.proj(out)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, qk_dim={self.qk_dim}, v_dim={self.v_dim}"
