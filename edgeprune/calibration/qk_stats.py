"""Per-image query/key statistics of one attention layer, for CORP's Q/K head-dim pruning.

For image i and head h, with Q, K the (n x d_h) query and key matrices of that head:
``Gq_i = Q^T Q`` and ``Gk_i = K^T K`` (d_h x d_h). Everything CORP needs is derived from them:

* the logit-energy ranking ``s_j = E_i[ ||q_j||^2 ||k_j||^2 ] = E_i[ Gq_i[j,j] Gk_i[j,j] ]``
  (corp-v1 §3.3, eq. 13),
* the per-image blocks of the exact compensation system, ``Gq_i[S,S]``, ``Gk_i[S,S]``,
  ``Cq_i = Gq_i[S,P]`` and ``Ck_i = Gk_i[P,S]`` (METHODS.md §1, corp-v1 eq. 15/29), which can only
  be formed once the kept set S is known.

So one streamed pass keeps the per-image Grams (float32 storage; products formed in
``gram_dtype``, float32 by default -- a sum over one image's n tokens):
``N * H * 2 * d_h^2 * 4`` bytes per layer, e.g. 4 MB per image for ViT-S (12 layers). No token
activation is kept. (:class:`QKSystemAccumulator` in ``edgeprune.solve.qk_logit`` accumulates
the system directly for a known S, for a second pass when the Grams do not fit in memory.)
"""

from __future__ import annotations

import torch

from edgeprune.plan import pruned_indices
from edgeprune.solve import qk_logit


class QKStatistics:
    """Accumulates per-image Q/K Gram matrices and the logit-energy score of one layer.

    Args:
        num_heads: H.
        qk_dim: per-head query/key dim d (the current one; d_h for a dense model).
        keep_grams: store the per-image Grams (needed for compensation); ``False`` keeps only
            the ranking score (uncompensated pruning needs nothing else).
        gram_dtype: dtype in which the per-image products are formed.
        device: where ``_score`` accumulates (the activations' device).
        grams_device: where the per-image Grams are stored; default: the activations' device.
            ``collect_statistics`` stores them in host memory during a GPU pass, so that GPU
            memory stays bounded by the model and one batch, whatever N (the Grams are the
            statistics that grow with N; ``CorpConfig.qk_memory_limit_gb`` bounds them in RAM).
        rotary: the layer rotates its queries and keys (RoPE): the caller feeds *rotated* q and k,
            the ranking reads :attr:`pair_energy` and the solve the pair form
            (:mod:`edgeprune.solve.qk_rope`).
    """

    def __init__(self, num_heads: int, qk_dim: int, keep_grams: bool = True,
                 gram_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 grams_device: torch.device | str | None = None, rotary: bool = False) -> None:
        self.gram_dtype = gram_dtype
        self.rotary = bool(rotary)
        self.num_heads = num_heads
        self.qk_dim = qk_dim
        self.keep_grams = keep_grams
        self.grams_device = grams_device
        self.num_images = 0
        self._score = torch.zeros(num_heads, qk_dim, dtype=torch.float64, device=device)
        # RoPE pairs (j, j + d/2): E_i[(||q_j||^2 + ||q_j+d/2||^2) (||k_j||^2 + ||k_j+d/2||^2)]
        self._pair_score = torch.zeros(num_heads, qk_dim // 2, dtype=torch.float64, device=device)
        self._gq: list[torch.Tensor] = []
        self._gk: list[torch.Tensor] = []

    @torch.no_grad()
    def add_batch(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Add queries and keys of shape (B, H, n, d) (one row per token, per image).

        Raises:
            ValueError: shapes disagree with (H, d).
        """
        if q.shape != k.shape or q.dim() != 4 or q.shape[1] != self.num_heads or q.shape[3] != self.qk_dim:
            raise ValueError(f"expected q, k of shape (B, {self.num_heads}, n, {self.qk_dim}), "
                             f"got {tuple(q.shape)} and {tuple(k.shape)}")
        h = self.num_heads
        # one contiguous (B, 2H, n, d) copy and one batched GEMM for both Grams: q and k arrive
        # as strided views of the fused qkv output, which batched matmul would copy twice each
        qk = torch.cat([q, k], 1).to(self.gram_dtype)
        g = qk.transpose(-1, -2) @ qk  # (B, 2H, d, d)
        diag = torch.diagonal(g, dim1=-2, dim2=-1).double()  # (B, 2H, d)
        self._score += (diag[:, :h] * diag[:, h:]).sum(0)
        if self.qk_dim % 2 == 0:
            p = self.qk_dim // 2
            pair = diag[..., :p] + diag[..., p:2 * p]  # (B, 2H, d/2)
            self._pair_score += (pair[:, :h] * pair[:, h:]).sum(0)
        if self.keep_grams:
            dev = q.device if self.grams_device is None else self.grams_device
            g = g.to(device=dev, dtype=torch.float32)
            self._gq.append(g[:, :h])
            self._gk.append(g[:, h:])
        self.num_images += q.shape[0]

    @property
    def logit_energy(self) -> torch.Tensor:
        """s, (H, d) float64: E_i[ ||q_j||^2 ||k_j||^2 ] per head and dim (corp-v1 eq. 13)."""
        if self.num_images == 0:
            raise RuntimeError("QKStatistics: no images were added")
        return self._score / self.num_images

    @property
    def pair_energy(self) -> torch.Tensor:
        """(H, d/2) float64: the RoPE pair energy ``E_i[(||q_j||^2 + ||q_u||^2)(||k_j||^2 + ||k_u||^2)]``,
        u = j + d/2 (METHODS.md §6; rotation-invariant, so the same on rotated or unrotated q, k)."""
        if self.num_images == 0:
            raise RuntimeError("QKStatistics: no images were added")
        return self._pair_score / self.num_images

    def grams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-image Grams (Gq, Gk), each (N, H, d, d) float32.

        Raises:
            RuntimeError: constructed with ``keep_grams=False`` or nothing added.
        """
        if not self.keep_grams:
            raise RuntimeError("QKStatistics was built with keep_grams=False")
        if not self._gq:
            raise RuntimeError("QKStatistics: no images were added")
        return torch.cat(self._gq), torch.cat(self._gk)

    def memory_bytes(self) -> int:
        """Bytes held by the stored Grams."""
        return sum(t.numel() * t.element_size() for t in self._gq + self._gk)

    def to(self, device: torch.device | str) -> "QKStatistics":
        """Move the score sums and the stored Grams to ``device`` (in place); returns self.

        Call it once, after the pass: Grams not yet on ``device`` are concatenated into one
        tensor per side first, so the data moves in one copy each (no per-batch transfers);
        Grams already there are left as they are (no copy). Later
        ``add_batch`` calls must bring activations on ``device``.
        """
        device = torch.device(device)
        self._score = self._score.to(device)
        self._pair_score = self._pair_score.to(device)
        if any(t.device != device for t in self._gq + self._gk):
            gq, gk = (torch.cat(lst) if len(lst) > 1 else lst[0] for lst in (self._gq, self._gk))
            self._gq, self._gk = [gq.to(device)], [gk.to(device)]
        if self.grams_device is not None:
            self.grams_device = device
        return self


class QKSystemStatistics:
    """Accumulates the exact Q/K compensation system for a known kept set, image by image.

    The memory-light alternative to storing per-image Grams (:class:`QKStatistics`): once the kept
    dims ``keep`` (H, d') are known, each image's Grams are reduced at once to its contribution
    ``Gq_i[S,S] (x) Gk_i[S,S]`` and ``Gq_i[S,P] Gk_i[P,S]`` (corp-v1 eq. 29; see
    ``edgeprune.solve.qk_logit``). Memory: H * d'^4 float64, independent of N. Needs a second
    calibration pass (the ranking needs the first).

    Args:
        keep: (H, d') int64 kept dims per head; qk_dim: the current per-head dim d.
        device: where the float64 system accumulates (the activations' device).
    """

    def __init__(self, keep: torch.Tensor, qk_dim: int, device: torch.device | str = "cpu") -> None:
        self._kron = qk_logit.kronecker_systems  # looked up per instance (tests swap it)
        self.num_heads, self.kept = keep.shape
        # the index sets live where the system accumulates: moved once, not per batch
        self.keep = keep.to(device)
        self.prune = torch.stack([pruned_indices(k, qk_dim) for k in keep]).to(device)
        d2 = self.kept * self.kept
        self.k_sys = torch.zeros(self.num_heads, d2, d2, dtype=torch.float64, device=device)
        self.rhs = torch.zeros(self.num_heads, self.kept, self.kept, dtype=torch.float64, device=device)
        self.num_images = 0
        self.qk_dim = qk_dim

    @torch.no_grad()
    def add_batch(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Add queries and keys (B, H, n, d): float64 Grams and one batched system assembly for
        all heads (``qk_logit.kronecker_systems``), summed into the float64 system on its device.

        Raises:
            ValueError: shapes disagree with (H, d); activations on another device than the system.
        """
        if q.shape != k.shape or q.dim() != 4 or q.shape[1] != self.num_heads or q.shape[3] != self.qk_dim:
            raise ValueError(f"expected q, k of shape (B, {self.num_heads}, n, {self.qk_dim}), "
                             f"got {tuple(q.shape)} and {tuple(k.shape)}")
        if q.device != self.k_sys.device:
            raise ValueError(f"activations on {q.device}, the Q/K system on {self.k_sys.device} "
                             "(construct it with device= the calibration pass's device)")
        qd, kd = q.double(), k.double()
        ks, rhs = self._kron(qd.transpose(-1, -2) @ qd, kd.transpose(-1, -2) @ kd, self.keep, self.prune)
        self.k_sys += ks
        self.rhs += rhs
        self.num_images += q.shape[0]

    def to(self, device: torch.device | str) -> "QKSystemStatistics":
        """Move the system, its right side and the index sets to ``device`` (in place); returns self."""
        for name in ("k_sys", "rhs", "keep", "prune"):
            setattr(self, name, getattr(self, name).to(device))
        return self
