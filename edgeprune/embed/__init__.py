"""Embed (residual-width) slicing: rotate the residual stream into its principal subspace and keep D'
channels, one-shot (issue 33; SliceGPT, Ashkboos et al. 2024, adapted to LayerNorm ViTs)."""

from edgeprune.embed.fold import fold_centring_and_affine, stream_parts
from edgeprune.embed.rotate import ones_complement, principal_basis, rotate_and_slice
from edgeprune.embed.slice import apply_embed_structure, embed_kept_dim, slice_embed

__all__ = ["apply_embed_structure", "embed_kept_dim", "fold_centring_and_affine", "ones_complement",
           "principal_basis", "rotate_and_slice", "slice_embed", "stream_parts"]
