"""Which scaled-dot-product-attention kernel a PyTorch model runs (flash, efficient, cuDNN, math).

PyTorch's ``F.scaled_dot_product_attention`` dispatches to a fused kernel (FlashAttention,
memory-efficient attention, cuDNN attention; on the CPU a flash-style kernel) only when the inputs
allow it; FlashAttention (GPU and CPU) needs the query/key head dim to equal the value head dim,
so a pruned model with ``qk_dim != v_dim`` falls back to another kernel: the unfused ``math`` path
on the CPU (measured here: the CPU dispatcher picks ``flash_attention`` for 64/64 and 32/32,
``math`` for 32/64); on CUDA the memory-efficient kernel may accept unequal (aligned) head dims
(not measured: no GPU was available). That is why
a pruned model can be slower per FLOP than the dense one, and why ``--layout fused`` exists.

:func:`attention_kernels` runs one forward pass with ``F.scaled_dot_product_attention`` wrapped:
every call asks the dispatcher which backend it chooses for those exact tensors
(``torch._fused_sdp_choice``, the function the dispatcher itself calls) and then runs the original.
Models that compute attention with explicit matmul + softmax make no SDPA call (reported empty).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None) -> str:
    """The backend PyTorch's dispatcher picks for these inputs: ``flash_attention``,
    ``efficient_attention``, ``cudnn_attention``, ``math`` (lower-case ``SDPBackend`` names), or
    ``unknown`` when this torch cannot say.

    Args:
        q, k: (B, H, N, d_qk); v: (B, H, N, d_v); the rest as for ``F.scaled_dot_product_attention``.
    """
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
        return SDPBackend(choice).name.lower()
    except Exception:  # noqa: BLE001 - a private API: report, never fail the benchmark
        return "unknown"


@contextlib.contextmanager
def record_sdpa_kernels() -> Iterator[collections.Counter]:
    """Within the context every ``F.scaled_dot_product_attention`` call is counted by the backend
    the dispatcher picks for it (:func:`sdpa_backend`); yields the counter."""
    counts: collections.Counter = collections.Counter()
    original = F.scaled_dot_product_attention

    def wrapped(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        counts[sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, scale)] += 1
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)

    F.scaled_dot_product_attention = wrapped
    try:
        yield counts
    finally:
        F.scaled_dot_product_attention = original


@torch.inference_mode()
def attention_kernels(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Backend name -> number of SDPA calls in one forward pass of ``model`` on ``x`` (on the
    model's device and dtype). Empty: the model made no SDPA call (explicit attention)."""
    with record_sdpa_kernels() as counts:
        model(x)
    return dict(sorted(counts.items()))


def describe(kernels: dict[str, int] | None) -> str:
    """``"flash_attention x12"``, ``"math x12"``, ``"math x6, flash_attention x6"``, or
    ``"no SDPA call"``."""
    if not kernels:
        return "no SDPA call"
    return ", ".join(f"{name} x{n}" for name, n in kernels.items())
