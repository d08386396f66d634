"""The sub-blocks a latency table times (moved from ``edgeprune.latency.measure``): random weights around copies
of the model's own norms, activation and LayerScales, so they run the same kernels as the model's blocks.

* attention: ``x + ls1(proj(attn(norm1(x))))`` with an :class:`~edgeprune.layers.PrunedAttention` of (kept heads,
  per-head Q/K dim, per-head V dim);
* MLP: ``x + ls2(fc2(act(fc1(norm2(x)))))`` of a kept width; a gated (SwiGLU) MLP
  ``x + ls2(fc2(act(fc1_g(u)) * fc1(u)))``, ``u = norm2(x)``, its gate and up projections at the kept width (issue 54:
  DINOv3 S+/H+, DINOv2-g).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from edgeprune.layers.pruned_attention import PrunedAttention
from edgeprune.layers.rotary_attention import RotaryAttention, is_rotary



def _or_identity(m: nn.Module | None) -> nn.Module:
    return nn.Identity() if m is None else copy.deepcopy(m)


class AttnSubBlock(nn.Module):
    """``x + ls1(proj(attn(norm1(x))))``: (B, N, D) -> (B, N, D)."""

    def __init__(self, norm: nn.Module, attn: nn.Module, ls: nn.Module) -> None:
        super().__init__()
        self.norm, self.attn, self.ls = norm, attn, ls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ls(self.attn(self.norm(x)))


class MlpSubBlock(nn.Module):
    """``x + ls2(fc2(act(fc1(norm2(x)))))``: (B, N, D) -> (B, N, D); with ``gate`` (a gated MLP's ``fc1_g``)
    ``x + ls2(fc2(act(gate(u)) * fc1(u)))``, ``u = norm2(x)``."""

    def __init__(self, norm: nn.Module, fc1: nn.Linear, act: nn.Module, fc2: nn.Linear, ls: nn.Module,
                 gate: nn.Linear | None = None) -> None:
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2, self.ls, self.gate = norm, fc1, act, fc2, ls, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.norm(x)
        h = self.act(self.fc1(u)) if self.gate is None else self.act(self.gate(u)) * self.fc1(u)
        return x + self.ls(self.fc2(h))


def attn_subblock(template: Any, embed_dim: int, heads: int, qk: int, v: int, seed: int = 0) -> AttnSubBlock:
    """Attention sub-block shaped like ``template`` (a :class:`~edgeprune.anatomy.BlockAnatomy`:
    its norm1, ls1 and bias flags) with ``heads`` heads of Q/K dim ``qk`` and V dim ``v``; random
    weights (seeded)."""
    torch.manual_seed(seed)
    shape = dict(qkv_bias=template.qkv.bias is not None, proj_bias=template.proj.bias is not None,
                 dense_head_dim=template.head_dim)
    attn = (RotaryAttention(embed_dim, heads, qk, v, template.attn.num_tokens, **shape)  # timed with its RoPE
            if is_rotary(template.attn) else PrunedAttention(embed_dim, heads, qk, v, **shape))
    return AttnSubBlock(_or_identity(template.block.norm1), attn, _or_identity(template.ls1)).eval()


def mlp_subblock(template: Any, embed_dim: int, width: int, seed: int = 0) -> MlpSubBlock:
    """MLP sub-block shaped like ``template`` (its norm2, activation, ls2, bias flags; gated where its MLP is:
    ``template.fc1_gate``) of hidden width ``width``; random weights (seeded)."""
    torch.manual_seed(seed)
    fc1 = nn.Linear(embed_dim, width, bias=template.fc1.bias is not None)
    fc2 = nn.Linear(width, embed_dim, bias=template.fc2.bias is not None)
    g = template.fc1_gate
    gate = None if g is None else nn.Linear(embed_dim, width, bias=g.bias is not None)
    return MlpSubBlock(_or_identity(template.block.norm2), fc1, copy.deepcopy(template.act), fc2,
                       _or_identity(template.ls2), gate).eval()
