"""Streaming first- and second-order statistics of an MLP's hidden activations.

Collected at the input of ``fc2`` (post-activation hidden h, dim D_mlp) over every token of every
calibration image, for CORP's ranking (corp-v2 §3.3) and ridge compensation (corp-v1 eq. 7-11).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from edgeprune.solve.gram import symmetric_gram


#: base of the per-image seeds of :func:`token_positions` (image j uses TOKEN_SEED + j)
TOKEN_SEED = 0x5EED0000


#: ``gram_tokens=None`` (auto): at least this many tokens per image ...
AUTO_MIN_TOKENS = 64
#: ... and at least this many sampled tokens per MLP hidden channel over the calibration set ...
AUTO_SAMPLES_PER_CHANNEL = 32
#: ... and all tokens unless the sample is at most this fraction of them (a small saving is not
#: worth an estimator)
AUTO_MAX_FRACTION = 0.5


def auto_gram_tokens(num_images: int | None, mlp_hidden: int, num_tokens: int) -> int:
    """Tokens per image of the default (``gram_tokens=None``) MLP statistics; 0 = all tokens.

    ``K = max(64, ceil(32 D / N))`` for N calibration images and D MLP hidden channels: at least
    64 tokens per image and at least 32 sampled tokens per hidden channel in all; all tokens when
    ``K > n / 2`` (the sample would not halve the covariance's cost), when N is unknown, and so
    for every model with < 128 tokens (fmnist-vit's 49).
    Why 32 per channel: on DINOv2-S (D = 1536) 256 images x 64 tokens (10.7 per channel) cost
    1.0-1.6 top-1 points per seed against all tokens (uniform CORP at FLOPs x0.5), while 1024
    images x 64 tokens (43 per channel) beat 256 images with all tokens (docs/prune_cost.md). So
    the default samples only where the calibration set is large: deit_small / DINOv2-S at 256
    images use all tokens, at 512 images 96, from 768 images 64.

    Args:
        num_images: N (None = unknown); mlp_hidden: D (the largest block's); num_tokens: n.
    """
    if num_images is None or num_images < 1:
        return 0
    k = max(AUTO_MIN_TOKENS, math.ceil(AUTO_SAMPLES_PER_CHANNEL * mlp_hidden / num_images))
    return 0 if k > AUTO_MAX_FRACTION * num_tokens else k


def token_positions(num_tokens: int, tokens: int, image_index: int) -> torch.Tensor | None:
    """The ``tokens`` token positions used for calibration image ``image_index``: a uniformly random
    subset of ``range(num_tokens)`` (sorted int64), drawn by a generator seeded with
    ``TOKEN_SEED + image_index``; None when every token is used (``tokens`` <= 0 or >= n).

    Each image gets its own subset, so every position is equally likely and the statistics are
    unbiased estimates of the all-token ones; a fixed subset shared by all images is biased
    (tokens at other positions are never seen, however many images): on fmnist-vit (49 tokens,
    MLP 0.5, 512 images) 12 fixed evenly spaced positions left 2.5x the all-token output error,
    12 random positions per image 1.04x (docs/prune_cost.md). Seeded by the image's index in the
    calibration set, not by a stream: deterministic, and the same under torchrun (where each rank
    knows its first image's index) as in one process.

    Raises:
        ValueError: num_tokens < 1 or image_index < 0.
    """
    if num_tokens < 1 or image_index < 0:
        raise ValueError(f"need num_tokens >= 1 and image_index >= 0, got {num_tokens}, {image_index}")
    if tokens <= 0 or tokens >= num_tokens:
        return None
    gen = torch.Generator().manual_seed(TOKEN_SEED + int(image_index))
    return torch.randperm(num_tokens, generator=gen)[:tokens].sort().values


class MLPStatistics:
    """Accumulates mean, centred covariance, energy and active probability of hidden activations.

    Sums are kept in float64. Each batch is shifted by a fixed reference (the first batch's mean)
    before its products are formed -- the "shifted data" algorithm, which keeps the covariance
    accurate when the mean is large relative to the spread. The per-batch Gram ``X^T X`` (the
    dominant cost of calibration) is formed in ``gram_dtype`` -- float32 by default, 2-4x faster than
    float64 on CPUs, exact to ~1e-6 relative for one batch of centred data (tested) -- and added
    to the float64 running sum, so the error does not grow with the calibration size.

    Usage: ``stats.add_batch(h)`` for each batch, then read :attr:`mean`, :attr:`cov`,
    :attr:`energy`, :attr:`active_prob`. Memory: O(D_mlp^2) float64, independent of N.

    Args:
        dim: D_mlp.
        gram_dtype: dtype of the per-batch Gram product (float64 or float32).
        second_order: accumulate the full covariance (needed for compensation). ``False`` keeps
            only per-channel sums of squares -- enough for every ranking criterion, at a fraction
            of the cost; :attr:`cov` then raises.
        count_positive: count positive activations per channel (only the ``active`` ranking
            criterion reads :attr:`active_prob`; the count costs ~1/3 of a Gram GEMM on CPU).
            ``False``: :attr:`active_prob` raises.
        device: where the accumulators live (the device of the activations; statistics never
            leave it during the pass). All sums stay float64 there.
        shift_fn: maps the first batch's float64 mean (D_mlp,) to the shift actually used;
            default: the mean itself. Under torchrun every rank gets rank 0's first-batch mean
            (:func:`edgeprune.distributed.common_shift_fn`), so each rank forms exactly the
            per-batch products a single-process run forms.
        tokens: use only this many tokens per image, at the random positions
            :func:`token_positions` draws for that image (0 = all). Every statistic (mean,
            covariance, energy, positive count) is then that of the selected tokens: an unbiased
            estimator of the all-token statistics whose Gram costs k/n of the all-token Gram
            (docs/prune_cost.md measures its cost and accuracy). Applies to activations shaped
            (B, n, D); 2-D input is used as given.
        first_image: index in the calibration set of the first image this object will see (the
            images then follow in order); under torchrun, the first image of this rank's share.
    """

    def __init__(self, dim: int, gram_dtype: torch.dtype = torch.float32, second_order: bool = True,
                 count_positive: bool = True, device: torch.device | str = "cpu",
                 shift_fn: Callable[[torch.Tensor], torch.Tensor] | None = None, tokens: int = 0,
                 first_image: int = 0) -> None:
        self.dim = dim
        self.tokens = int(tokens)
        self.images_seen = 0
        self.first_image = int(first_image)
        self.shift_fn = shift_fn
        self.gram_dtype = gram_dtype
        self.second_order = second_order
        self.count_positive = count_positive
        f64 = dict(dtype=torch.float64, device=device)
        self._sq = torch.zeros(dim, **f64)
        self.count = 0
        self._shift: torch.Tensor | None = None
        self._sum = torch.zeros(dim, **f64)
        # float64 sum of the shifted data's Gram; allocated only when second_order (D^2 x 8 bytes)
        self._gram = torch.zeros(dim, dim, **f64) if second_order else torch.zeros(0, 0, **f64)
        self._positive = torch.zeros(dim, **f64)

    def to(self, device: torch.device | str) -> "MLPStatistics":
        """Move the accumulators to ``device`` (in place; e.g. to the host after a GPU pass).

        Returns:
            self.
        """
        for name in ("_shift", "_sum", "_gram", "_sq", "_positive"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    @torch.no_grad()
    def add_batch(self, h: torch.Tensor) -> None:
        """Add activations h of shape (..., D_mlp) (e.g. (B, n, D_mlp)); every row is one token.

        Raises:
            ValueError: last dim is not D_mlp.
        """
        if h.shape[-1] != self.dim:
            raise ValueError(f"expected hidden dim {self.dim}, got {tuple(h.shape)}")
        if self.tokens > 0 and h.dim() == 3 and 0 < self.tokens < h.shape[1]:
            b, n, _ = h.shape
            first = self.first_image + self.images_seen
            idx = torch.stack([token_positions(n, self.tokens, first + j) for j in range(b)]).to(h.device)
            h = h.gather(1, idx.unsqueeze(-1).expand(b, self.tokens, self.dim))
        if h.dim() == 3:
            self.images_seen += h.shape[0]
        x = h.reshape(-1, self.dim)
        if x.shape[0] == 0:
            return
        if self._shift is None:
            first = x.mean(0, dtype=torch.float64)
            shift = first if self.shift_fn is None else self.shift_fn(first)
            # the shift as subtracted below (rounded to gram_dtype), so that mean adds back exactly it
            self._shift = shift.to(self.gram_dtype).double().to(self._sum.device)
        elif self._shift.device != x.device:
            raise ValueError(f"activations on {x.device}, statistics on {self._shift.device}")
        # Per-batch reductions in gram_dtype (an int32 count; float32 column sums), added to the
        # float64 running sums: 4-9x faster than reducing in float64, which cost ~10% of a
        # DINOv2-S calibration pass.
        if self.count_positive:
            self._positive += (x > 0).sum(0, dtype=torch.int32)
        xc = x.to(self.gram_dtype) - self._shift.to(self.gram_dtype)
        self._sum += xc.sum(0)
        if self.second_order:
            symmetric_gram(xc, out=self._gram)  # float32 block products summed into float64
        else:
            self._sq += (xc * xc).sum(0)
        self.count += x.shape[0]

    def _check(self) -> None:
        if self.count == 0:
            raise RuntimeError("MLPStatistics: no activations were added")

    @property
    def mean(self) -> torch.Tensor:
        """mu, (D_mlp,) float64: E[h]."""
        self._check()
        return self._shift + self._sum / self.count

    @property
    def cov(self) -> torch.Tensor:
        """Sigma, (D_mlp, D_mlp) float64: centred covariance E[(h - mu)(h - mu)^T] (1/N)."""
        self._check()
        if not self.second_order:
            raise RuntimeError("MLPStatistics was built with second_order=False")
        key = self._sums_key()
        memo = self.__dict__.get("_cov_memo")
        if key is not None and memo is not None and memo[0] == key:
            return memo[1]
        m = self._sum / self.count
        c = torch.addr(self._gram, m, m, beta=1.0 / self.count, alpha=-1.0)  # one pass over D^2
        # the accumulated Gram is exactly symmetric (mirrored blocks), and so is c then
        c = c if torch.equal(c, c.T) else 0.5 * (c + c.T)
        self._cov_memo = (key, c)
        return c

    def _sums_key(self) -> tuple | None:
        """What ``cov`` is computed from: the count and the identity and in-place version of the sums (a new batch, a
        device move or an all-reduce changes it), so that the allocator's ~300 reads of one block's covariance per
        budgeted prune compute it once (issue 40 item 4; callers only read it). None where the tensors keep no
        version (inference-mode tensors): no memo."""
        try:
            return (self.count, id(self._gram), self._gram._version, id(self._sum), self._sum._version)
        except RuntimeError:
            return None

    @property
    def variance(self) -> torch.Tensor:
        """diag(Sigma), (D_mlp,) float64."""
        self._check()
        m = self._sum / self.count
        sq = torch.diagonal(self._gram) if self.second_order else self._sq
        return sq / self.count - m * m

    @property
    def energy(self) -> torch.Tensor:
        """E[h_j^2], (D_mlp,) float64 (= diag(Sigma) + mu^2)."""
        mu = self.mean
        return self.variance + mu * mu

    @property
    def active_prob(self) -> torch.Tensor:
        """P(h_j > 0), (D_mlp,) float64.

        Raises:
            RuntimeError: built with ``count_positive=False``, or nothing added.
        """
        self._check()
        if not self.count_positive:
            raise RuntimeError("MLPStatistics was built with count_positive=False")
        return self._positive / self.count
