"""Ridge re-fit of the stream writers of a sliced model to the dense stream (issue 33, our formulation).

The slice keeps ``x' = B V^T x`` of every write, so the sliced stream drifts from the projection of
the dense stream as soon as the readers see a changed input. Two streams go block by block over the
calibration images (as ``edgeprune.sequential``, METHODS.md §5): the dense (folded, unsliced) ``x``
and the sliced ``x~``. For each writer (``proj``, then ``fc2``) with input ``z~`` in the sliced model
(the heads' outputs, the MLP hidden) the new weights solve

    min_{W, b}  sum_tokens || P x_after - (x~ + W z~ + b) ||^2 + lam ||W||_F^2,     P = B V^T,

i.e. the write that brings the sliced stream back to the projected dense stream after that sub-layer:
``W = Cov(t, z~) (Cov(z~) + lam I)^-1``, ``b = mean(t) - W mean(z~)`` with ``t = P x_after - x~``,
``lam = max(alpha, 1e-9) * mean diag Cov(z~)`` (scale-free, as ``edgeprune.solve.mlp_ridge``); float64 solve.
The moments are float64 products: a float32 Gram carries noise of ~1e-7 |E z z^T| (1e-10 here, seen on a
rank-deficient head output whose true small eigenvalues are 1e-17), which swamps the small eigenvalues of
Cov(z~) and made the alpha -> 0 fit depend on the BLAS's summation order (a flaky exactness test, issue 43);
in float64 an exactly representable write is re-fit exactly (tests/test_embed.py). The streams of all calibration
images are held in
memory (N x n x D float32 each).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.anatomy import ViTAnatomy
from edgeprune.embed.rotate import ones_complement


class WriterFit:
    """Accumulates ``z``/``t`` moments of one writer and solves the ridge fit (module doc)."""

    def __init__(self) -> None:
        self.n = 0
        self.sz = self.st = self.gzz = self.gzt = None

    def add_batch(self, z: torch.Tensor, t: torch.Tensor) -> None:
        """``z`` (..., d_in), ``t`` (..., D') rows of one batch; the products are taken in float64."""
        z = z.reshape(-1, z.shape[-1]).double()
        t = t.reshape(-1, t.shape[-1]).double()
        parts = (z.sum(0), t.sum(0), z.T @ z, z.T @ t)
        if self.sz is None:
            self.sz, self.st, self.gzz, self.gzt = parts
        else:
            old = (self.sz, self.st, self.gzz, self.gzt)
            self.sz, self.st, self.gzz, self.gzt = (a + b for a, b in zip(old, parts))
        self.n += z.shape[0]

    def solve(self, alpha: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(W (D', d_in), b (D',), lam) float64."""
        mz, mt = self.sz / self.n, self.st / self.n
        czz = self.gzz / self.n - torch.outer(mz, mz)
        czt = self.gzt / self.n - torch.outer(mz, mt)
        lam = float(max(alpha, 1e-9) * czz.diagonal().mean().clamp_min(1e-12))  # floor: a singular Cov(z~)
        evals, evecs = torch.linalg.eigh((czz + czz.T) / 2)  # eigen-solve: robust where Cov(z~) is singular
        w = (evecs @ ((evecs.T @ czt) / (evals.clamp_min(0) + lam)[:, None])).T
        return w, mt - w @ mz, lam


def _input_of(module: nn.Module, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(``run()``'s result, the input ``module`` saw during it)."""
    seen: list[torch.Tensor] = []
    h = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        out = run()
    finally:
        h.remove()
    return out, seen[0]


def _set_writer(lin: nn.Linear, w: torch.Tensor, b: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.copy_(w.float())
        if lin.bias is not None:
            lin.bias.copy_(b.float())


def _refit_sublayer(xs: list[torch.Tensor], xd: list[torch.Tensor], dense_step, sliced_run, writer: nn.Linear,
                    p: torch.Tensor, alpha: float) -> float:
    """Fit one writer over the stored streams (in place: ``xd`` / ``xs`` advance past the sub-layer)."""
    fit = WriterFit()
    for i, x in enumerate(xs):
        xd[i] = dense_step(xd[i])
        _, z = _input_of(writer, lambda: sliced_run(x))
        fit.add_batch(z, xd[i] @ p.T - x)
    w, b, lam = fit.solve(alpha)
    _set_writer(writer, w, b)
    for i, x in enumerate(xs):
        xs[i] = x + sliced_run(x)
    return lam


def refit_writers(dense: ViTAnatomy, sliced: ViTAnatomy, v: torch.Tensor,
                  batches: Callable[[], Iterable[torch.Tensor]], alpha: float = 1e-3) -> dict:
    """Re-fit every full block's ``proj`` and ``fc2`` of ``sliced`` to ``dense``'s stream, in place.

    Args:
        dense: the folded, unsliced model (``edgeprune.embed.fold``; LayerScales folded).
        sliced: the same model after ``rotate_and_slice`` with basis ``v`` (D, D'-1).
        batches: calibration batches (B, C, H, W).
        alpha: scale-free ridge strength.

    Returns:
        record: ``alpha``, ``blocks`` refitted, ``skipped`` (class-token blocks), ``seconds``,
        ``stream_error`` (relative ``||x~ - P x||`` over the calibration tokens at the final norm's
        input, after the refit) and ``stream_error_slice`` (the same for the slice alone).
    """
    t0 = time.perf_counter()
    p = (ones_complement(sliced.embed_dim) @ v.T).float()
    with torch.no_grad():
        xd = [dense.vit._pos_embed(dense.vit.patch_embed(x)) for x in batches()]
        xs = [x @ p.T for x in xd]
        plain = list(xs)
        for bs in sliced.blocks:  # the slice's own final stream, for the record
            plain = [bs.block(x) for x in plain]
        done, skipped = 0, []
        for bd, bs in zip(dense.blocks, sliced.blocks):
            if bs.query_tokens is not None or bd.query_tokens is not None:
                skipped.append(bs.index)
                xd = [bd.block(x) for x in xd]
                xs = [bs.block(x) for x in xs]
                continue
            _refit_sublayer(xs, xd, lambda x, b=bd.block: x + b.attn(b.norm1(x)),
                            lambda x, b=bs.block: b.attn(b.norm1(x)), bs.proj, p, alpha)
            _refit_sublayer(xs, xd, lambda x, b=bd.block: x + b.mlp(b.norm2(x)),
                            lambda x, b=bs.block: b.mlp(b.norm2(x)), bs.fc2, p, alpha)
            done += 1
        ref = max(sum(float((d @ p.T).pow(2).sum()) for d in xd), 1e-300)
        err = sum(float((s - d @ p.T).pow(2).sum()) for s, d in zip(xs, xd))
        err_plain = sum(float((s - d @ p.T).pow(2).sum()) for s, d in zip(plain, xd))
    return {"alpha": alpha, "blocks": done, "skipped": skipped, "seconds": time.perf_counter() - t0,
            "stream_error": (err / ref) ** 0.5, "stream_error_slice": (err_plain / ref) ** 0.5}
