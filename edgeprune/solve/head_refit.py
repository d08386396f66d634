"""Classifier refit: the pruned model's linear head re-fitted to the dense model's outputs.

The output bias correction (``edgeprune.solve.output_bias``) fits one constant to the output
difference. The head ``y = W f + b`` is linear in the pruned model's final features ``f`` (the
head's input), so the whole head can be fitted in closed form to what the dense model outputs on
the calibration images -- label-free, like every other fit in CORP:

    (W*, b*) = argmin_{W, b}  sum_i || y_dense(x_i) - W f_pruned(x_i) - b ||^2  +  lam ||W - W0||_F^2

a ridge regression pulled toward the dense head ``W0`` (the bias is not penalised). With the
centred statistics over the k images (``mu_f``, ``mu_y``; ``G_ff = sum (f - mu_f)(f - mu_f)^T``,
``G_fy = sum (f - mu_f)(y - mu_y)^T``) the solution is

    (W* - W0)^T = (G_ff + lam I)^-1 (G_fy - G_ff W0^T),        b* = mu_y - W* mu_f,

with ``lam = alpha tr(G_ff) / D`` (scale-free, as every ridge in edgeprune). ``alpha -> inf``
gives ``W* = W0`` and ``b* = b0 + mean(y_dense - y_pruned)``: exactly the output bias correction.
alpha is chosen by K-fold cross-validation over the images (image i in fold ``i mod K``) among
:data:`ALPHAS` and infinity (the bias correction itself), so the refit is used only where it
predicts the dense outputs of held-out calibration images better than the constant does.

Small calibration sets degrade gracefully (issue 32): a cross-validation training split whose
centred features have no spread (a single image: ``G_ff = 0`` and ``G_fy = 0``) has the exact
solution ``W* = W0``, the bias correction, and is solved as such (no singular system); the refit
itself needs :data:`MIN_IMAGES` images (every training split then holds two). With fewer, the
output correction folds the bias alone and its record carries a ``note`` saying so
(:func:`refit_note`); asking for the refit explicitly with fewer correction images than that
(``--head-refit --bias-correction 2``, or ``--head-refit`` with the correction off) is refused
before any work (:func:`check_refit_request`). Every
quantity is a sum over images (:class:`RefitStatistics`), so under torchrun the ranks' sums are
all-reduced and every rank fits the same head. (Our addition: docs/methods.md "Classifier refit".)
"""

from __future__ import annotations

import math
import torch

from edgeprune.settings import SettingError

__all__ = ["ALPHAS", "FOLDS", "MIN_IMAGES", "RefitStatistics", "refit_statistics", "fit_head", "refit_note",
           "check_refit_request"]

#: scale-free ridge strengths tried by the cross-validation (plus infinity = bias only)
ALPHAS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
#: folds of the cross-validation
FOLDS = 8
#: fewest calibration images the refit runs on (each cross-validation training split holds >= 2)
MIN_IMAGES = 3


def refit_note(images: int) -> str | None:
    """Why the refit is skipped for ``images`` correction images (None: it runs)."""
    if images >= MIN_IMAGES:
        return None
    return (f"classifier refit skipped: {images} calibration image(s), the refit needs at least {MIN_IMAGES}; "
            "the bias correction alone was folded")


def check_refit_request(head_refit: bool | None, images: int) -> None:
    """Refuse an explicit refit (``head_refit=True``) that cannot run: the output correction off
    (``images == 0``) or fewer than :data:`MIN_IMAGES` correction images asked for.

    Args:
        head_refit: True (asked), False (off) or None (auto: degrades with a note).
        images: the correction's images (``edgeprune.corp.bias_correction_used``).

    Raises:
        UserError: naming ``--head-refit`` and ``--bias-correction``.
    """
    if head_refit is not True:
        return
    if images == 0:
        raise SettingError("{head_refit} needs the output correction on: add {bias_correction_images} N "
                           f"(N >= {MIN_IMAGES}; the correction is off without {{flops}}/{{params}})")
    if images < MIN_IMAGES:
        raise SettingError(f"{{head_refit}} needs {{bias_correction_images}} >= {MIN_IMAGES} (its cross-validation "
                           f"fits on all images but one fold), got {images}")


class RefitStatistics:
    """Per-fold float64 sums of the regression ``y_dense ~ W f_pruned + b``.

    Attributes (fold index first, K = ``folds``): ``n`` (K,), ``sf`` (K, D), ``sy`` (K, C),
    ``sff`` (K, D, D), ``sfy`` (K, D, C), ``syy`` (K,) (sum of ||y||^2).
    """

    def __init__(self, in_features: int, out_features: int, folds: int = FOLDS) -> None:
        D, C, K = int(in_features), int(out_features), int(folds)
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.n, self.sf, self.sy = z(K), z(K, D), z(K, C)
        self.sff, self.sfy, self.syy = z(K, D, D), z(K, D, C), z(K)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every sum, for an all-reduce."""
        return [self.n, self.sf, self.sy, self.sff, self.sfy, self.syy]

    def add(self, features: torch.Tensor, targets: torch.Tensor, image_index: torch.Tensor) -> None:
        """Add images: ``features`` (B, D) pruned head inputs, ``targets`` (B, C) dense outputs,
        ``image_index`` (B,) their indices in the whole calibration set (fold = index mod K)."""
        f, y = features.detach().double().cpu(), targets.detach().double().cpu()
        fold = image_index.long().cpu() % self.n.shape[0]
        for k in fold.unique().tolist():
            m = fold == k
            fk, yk = f[m], y[m]
            self.n[k] += fk.shape[0]
            self.sf[k] += fk.sum(0)
            self.sy[k] += yk.sum(0)
            self.sff[k] += fk.T @ fk
            self.sfy[k] += fk.T @ yk
            self.syy[k] += (yk * yk).sum()


def _solve(n, sf, sy, sff, sfy, w0: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, b) from summed statistics (module doc); alpha = inf: W0 and the bias correction."""
    mf, my = sf / n, sy / n
    gff = sff - n * torch.outer(mf, mf)
    if math.isinf(alpha) or float(torch.diagonal(gff).sum()) <= 1e-9 * float(torch.diagonal(sff).sum()):
        return w0, my - w0 @ mf  # bias only; features without spread (one image): its exact solution
    gfy = sfy - n * torch.outer(mf, my)
    D = gff.shape[0]
    lam = alpha * float(torch.diagonal(gff).sum().clamp_min(1e-300)) / D
    a = gff + lam * torch.eye(D, dtype=torch.float64)
    dw = torch.linalg.solve(a, gfy - gff @ w0.T).T
    w = w0 + dw
    return w, my - w @ mf


def _error(n, sf, sy, sff, sfy, syy, w: torch.Tensor, b: torch.Tensor) -> float:
    """sum_i ||y_i - W f_i - b||^2 from the sums of the images it runs over."""
    return float(syy - 2 * torch.trace(w @ sfy) - 2 * (b @ sy) + torch.trace(w @ sff @ w.T)
                 + 2 * (b @ (w @ sf)) + n * (b @ b))


def fit_head(stats: RefitStatistics, weight: torch.Tensor, alphas=ALPHAS) -> dict:
    """Cross-validated ridge refit of a classifier ``y = W f + b`` (module doc).

    Args:
        stats: the sums over the calibration images (all ranks' already reduced).
        weight: W0, (C, D), the head's weight before the refit (pruned model = dense head).
        alphas: finite scale-free ridge strengths to try (infinity, the bias correction, always is).

    Returns:
        dict with ``weight`` (C, D) and ``bias`` (C,) float64 of the chosen fit, ``alpha`` (float,
        ``inf`` = bias correction only), ``cv_error`` {alpha: mean squared output error per image
        on held-out folds}, ``images``.

    Raises:
        ValueError: fewer than 2 non-empty folds, or shapes that do not match ``weight``.
    """
    w0 = weight.detach().double().cpu()
    if stats.sfy.shape[1:] != (w0.shape[1], w0.shape[0]):
        raise ValueError(f"refit statistics {tuple(stats.sfy.shape[1:])} do not match the head {tuple(w0.shape)}")
    full = [t.sum(0) for t in (stats.n, stats.sf, stats.sy, stats.sff, stats.sfy, stats.syy)]
    folds = [k for k in range(stats.n.shape[0]) if stats.n[k] > 0]
    if len(folds) < 2:
        raise ValueError("the classifier refit needs images in at least 2 folds")
    cv: dict[float, float] = {}
    for alpha in (*alphas, math.inf):
        err = 0.0
        for k in folds:
            train = [f - t[k] for f, t in zip(full, (stats.n, stats.sf, stats.sy, stats.sff, stats.sfy, stats.syy))]
            w, b = _solve(*train[:5], w0, alpha)
            err += _error(stats.n[k], stats.sf[k], stats.sy[k], stats.sff[k], stats.sfy[k], stats.syy[k], w, b)
        cv[alpha] = err / float(full[0])
    # ties to rounding (relative to the targets' variance per image): the stronger ridge
    n = float(full[0])
    spread = float(full[5] - full[2] @ full[2] / n) / n
    low = min(cv.values())
    best = max(a for a, e in cv.items() if e <= low + 1e-9 * max(low, spread, 1e-300))
    w, b = _solve(*full[:5], w0, best)
    return {"weight": w, "bias": b, "alpha": best, "cv_error": cv, "images": int(full[0])}


def refit_statistics(features: torch.Tensor, dense_rows: torch.Tensor, first_image: int = 0,
                     folds: int = FOLDS) -> RefitStatistics:
    """The refit's sums over this process's images: the pruned model's head inputs against the
    dense outputs of the same images.

    Args:
        features: (k_local, D) the pruned model's head inputs, in calibration-set order.
        dense_rows: (>= k_local, C) the dense model's outputs of the same images, same order
            (``OutputSums.rows`` of the calibration pass).
        first_image: index in the whole calibration set of the first of these images (under
            torchrun: this rank's share), which fixes each image's fold.

    Raises:
        ValueError: fewer dense rows than features.
    """
    k = features.shape[0]
    if dense_rows.shape[0] < k:
        raise ValueError(f"{dense_rows.shape[0]} dense outputs for {k} images")
    stats = RefitStatistics(features.shape[1], dense_rows.shape[1], folds)
    stats.add(features, dense_rows[:k], torch.arange(first_image, first_image + k))
    return stats
