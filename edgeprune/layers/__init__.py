"""Modules that replace timm's after structured pruning."""

from edgeprune.layers.pruned_attention import PrunedAttention

__all__ = ["PrunedAttention"]
