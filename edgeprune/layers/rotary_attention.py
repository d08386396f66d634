"""Multi-head self-attention with rotary position embedding (RoPE) tables of a fixed image size.

timm's rotary ViTs (``Eva``: DINOv3, EVA-02, ``vit_*rope*``) compute their RoPE sin/cos at run time
from the patch grid and hand them to every block; their ONNX graphs then hold the grid arithmetic
(``If`` / ``Tile`` / dynamic shapes, NVIDIA/TensorRT#4558). Here the tables of the model's fixed
image size are *buffers* of the attention: one row per token (prefix tokens get cos = 1, sin = 0,
i.e. no rotation, as timm applies RoPE to patch tokens only) and one table per head, because after
Q/K pruning (METHODS.md §6) the heads of a layer may keep different pairs. The exported graph is two
``Mul``, one ``Add`` and a ``rotate_half`` (``Slice``/``Neg``/``Concat``) on constants.

Layout: ``rotate_half`` (timm ``rope_rotate_half``, DINOv3): dim j of a head pairs with j + d/2.
Interleaved models (EVA-02: 2j with 2j + 1) are converted to it by permuting the q/k rows of ``qkv``
(:mod:`edgeprune.zoo.eva`), which leaves every logit unchanged. A pruned head keeps whole pairs, in the
same layout (its kept dims, sorted, are the kept pairs' first halves then their second halves).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from edgeprune.layers.pruned_attention import PrunedAttention


def rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split at ``half`` (a Python int: the export's Slices are constant)
    along the last dim (the RoPE pair partner)."""
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """Rotate each pair (j, j + d/2) of ``x`` by its angle: ``x * cos + rotate_half(x) * sin``.

    Args:
        x: (B, H, n, d) queries or keys, ``rotate_half`` layout, d even.
        cos, sin: (H, n, d) tables (``cos[..., j] == cos[..., j + d/2]``, same for sin).
        half: d / 2.

    Returns:
        (B, H, n, d), in x's dtype.
    """
    return x * cos.to(x.dtype) + rotate_half(x, half) * sin.to(x.dtype)


class RotaryAttention(PrunedAttention):
    """:class:`PrunedAttention` whose queries and keys are rotated by fixed RoPE tables.

    Args:
        dim, num_heads, qk_dim, v_dim, qkv_bias, proj_bias, scale, dense_head_dim: as
            :class:`PrunedAttention` (``qk_dim`` even: whole pairs).
        num_tokens: n, the sequence length the tables cover (prefix + patch tokens).

    Buffers (persistent, so a pruned run's kept pairs travel with its weights):
        ``rope_cos``, ``rope_sin``: (H, n, qk_dim) float32.

    Shapes:
        forward: x (B, n, D) -> (B, n, D); n must equal ``num_tokens``.

    Raises:
        ValueError: an odd ``qk_dim``.
    """

    def __init__(self, dim: int, num_heads: int, qk_dim: int, v_dim: int, num_tokens: int,
                 qkv_bias: bool = True, proj_bias: bool = True, scale: Optional[float] = None,
                 dense_head_dim: Optional[int] = None) -> None:
        if qk_dim % 2:
            raise ValueError(f"a rotary head keeps whole RoPE pairs: qk_dim must be even, got {qk_dim}")
        super().__init__(dim, num_heads, qk_dim, v_dim, qkv_bias=qkv_bias, proj_bias=proj_bias,
                         scale=scale, dense_head_dim=dense_head_dim)
        self.num_tokens = int(num_tokens)
        self.register_buffer("rope_cos", torch.ones(num_heads, num_tokens, qk_dim))
        self.register_buffer("rope_sin", torch.zeros(num_heads, num_tokens, qk_dim))

    def set_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Copy (H, n, qk_dim) tables into the buffers.

        Raises:
            ValueError: a shape other than the buffers'.
        """
        if cos.shape != self.rope_cos.shape or sin.shape != self.rope_sin.shape:
            raise ValueError(f"RoPE tables of shape {tuple(cos.shape)}/{tuple(sin.shape)}, "
                             f"expected {tuple(self.rope_cos.shape)}")
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """Rotate queries or keys (B, H, m, qk_dim) of the first m tokens (m <= ``num_tokens``)."""
        m = int(t.shape[2])
        cos, sin = self.rope_cos, self.rope_sin
        if m != self.num_tokens:  # the class-token last block's queries: the first m rows
            cos, sin = cos[:, :m], sin[:, :m]
        return apply_rope(t, cos, sin, self.qk_dim // 2)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                **_: object) -> torch.Tensor:
        # token count and widths as Python ints: the exported graph's reshapes are constant but the batch
        N, H, dq, dv = self.num_tokens, self.num_heads, self.qk_dim, self.v_dim
        q, k, v = self.qkv(x).split([H * dq, H * dq, H * dv], dim=-1)
        q = apply_rope(q.reshape(-1, N, H, dq).transpose(1, 2), self.rope_cos, self.rope_sin, dq // 2)
        k = apply_rope(k.reshape(-1, N, H, dq).transpose(1, 2), self.rope_cos, self.rope_sin, dq // 2)
        v = v.reshape(-1, N, H, dv).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(-1, N, H * dv))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rope tables of {self.num_tokens} tokens"


def is_rotary(attn: nn.Module) -> bool:
    """True for an attention that rotates its queries and keys (:class:`RotaryAttention`)."""
    return isinstance(attn, RotaryAttention)
