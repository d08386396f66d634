"""Settings of a NuWa derivation (nuwa §3), validated once and stored in the run record.

``edgeprune derive`` builds a :class:`DeriveConfig` from its options; :func:`edgeprune.nuwa.derive`
takes the same object; the record stores it as ``config`` (``dataclasses.asdict``). The budget
(``flops=`` / ``params=``) is an argument of the derivation, not a setting: one prepared anchor
serves many budgets (:func:`edgeprune.nuwa.derive.derive_from`). The measure-and-correct settings of a latency
budget (``verify_budget``, ``correction_tolerance``, ``correction_rounds``) are the prune's
(:mod:`edgeprune.budget.correction_loop`, :mod:`edgeprune.nuwa.measured`).
"""

from __future__ import annotations

import dataclasses

from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.nuwa.head import HEAD_MODES
from edgeprune.nuwa.ofp_mha import KEY_BIAS_MODES
from edgeprune.nuwa.ofp_mlp import DEFAULT_RIDGE_ALPHA
from edgeprune.nuwa.skp import SKPConfig
from edgeprune.budget.correction import DEFAULTS as CORRECTION, check_correction
from edgeprune.torch_device import resolve_device


@dataclasses.dataclass
class DeriveConfig:
    """Settings of a derivation (SKP settings in ``skp``).

    Attributes:
        skp: :class:`SKPConfig`; ``skp.steps = 0`` skips SKP (anchor = base model).
        head: "suppress" (default) or "slice".
        val_size: held-out target-class images (from the labeled data) for SKP checkpoints and rho.
        calib_size: calibration images drawn from the labeled data when none are given.
        rho: fixed retained-energy ratio (None = search ``rho_grid``).
        rho_grid: candidate ratios (None = adaptive, :func:`edgeprune.nuwa.budget.rho_candidates`).
        key_bias: "drop" (default) or "augment" -- see :mod:`edgeprune.nuwa.ofp_mha`.
        ridge_alpha: scale-free ridge of the fc2 least-squares re-fit.
        refit: False = plain removal of the low-activation channels (ablation).
        round_to: every pruned dim is a multiple of this.
        cache: use the on-disk SVD cache (the in-memory one is always used).
        batch_size: batch size of calibration and evaluation passes.
        seed: data split / sampling seed.
        device: torch device of the data passes -- SKP training, the calibration statistics and
            every evaluation: "cpu", "cuda", "cuda:N" or "auto" (cuda when available, else cpu),
            resolved by :meth:`validate` (the resolved name is recorded). The SVD factors, the
            least-squares re-fits (float64) and the surgery run on the CPU, and the derived model
            is returned on the CPU (:mod:`edgeprune.nuwa.derive`, "Devices").
        verify_budget, correction_tolerance, correction_rounds: with a budget whose cost model is measured (a
            latency table) whose backend runs here, the derived model is benched against the base model; when it
            misses the budget by more than ``correction_tolerance`` (a fraction), the dims are re-planned with a
            corrected budget from the same anchor, statistics and factors, at most ``correction_rounds`` times
            (:mod:`edgeprune.nuwa.measured`); ``verify_budget=False`` records the prediction only.
    """

    skp: SKPConfig = dataclasses.field(default_factory=SKPConfig)
    head: str = "suppress"
    val_size: int = 300
    calib_size: int = 128
    rho: float | None = None
    rho_grid: tuple[float, ...] | None = None
    key_bias: str = "drop"
    ridge_alpha: float = DEFAULT_RIDGE_ALPHA
    refit: bool = True
    round_to: int = 8
    cache: bool = True
    batch_size: int = 64
    seed: int = 0
    device: str = "cpu"
    verify_budget: bool = CORRECTION["verify_budget"]  # issue 40 item 5: measure a latency budget, correct it
    correction_tolerance: float = CORRECTION["correction_tolerance"]
    correction_rounds: int = CORRECTION["correction_rounds"]

    def validate(self) -> None:
        """Raises UserError for out-of-range settings, an unknown device or CUDA not available;
        resolves ``device`` ("auto" -> cuda / cpu)."""
        if self.head not in HEAD_MODES:
            raise UserError(f"head mode must be one of {', '.join(HEAD_MODES)}, got {self.head!r}")
        if self.key_bias not in KEY_BIAS_MODES:
            raise UserError(f"key bias mode must be one of {', '.join(KEY_BIAS_MODES)}")
        if self.rho is not None and not 0.0 <= self.rho <= 1.0:
            raise SettingError(f"{{rho}} must be in [0, 1], got {self.rho}")
        if self.ridge_alpha < 0:
            raise UserError(f"ridge alpha must be >= 0, got {self.ridge_alpha}")
        if self.round_to < 1:
            raise UserError(f"round_to must be >= 1, got {self.round_to}")
        for name in ("val_size", "calib_size", "batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        s = self.skp
        if s.steps < 0 or s.batch_size < 1 or s.eval_every < 1:
            raise UserError("SKP steps must be >= 0, batch size and eval interval >= 1")
        if s.lr_beta < 0 or s.lr_mask < 0 or s.weight_decay < 0:
            raise UserError("SKP learning rates and weight decay must be >= 0")
        check_correction(self.verify_budget, self.correction_tolerance, self.correction_rounds)
        self.device = resolve_device(self.device)
