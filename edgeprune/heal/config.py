"""Settings of a STARFISH heal (starfish §3.2, App. B; METHODS.md §2), validated once.

``edgeprune heal`` builds a :class:`HealConfig` from its options, :func:`edgeprune.heal.heal` takes
the same object, and the healed run's record stores it as ``healing.config``
(``dataclasses.asdict``).
"""

from __future__ import annotations

import dataclasses
import math

from edgeprune.errors import UserError
from edgeprune.heal.alignment import LOSSES
from edgeprune.heal.targets import DEFAULT_MEMORY_BUDGET_MB
from edgeprune.torch_device import resolve_device


@dataclasses.dataclass
class HealConfig:
    """STARFISH settings.

    Attributes:
        epochs: passes over the calibration set (>= 1; paper: 5-10).
        batch_size: images per optimiser step (paper: 32).
        lr, min_lr: AdamW learning rate, decayed per step with a cosine schedule to ``min_lr``
            (paper: 6e-4 -> 1e-6; default lr 1e-4 keeps CORP's compensation, see the trainer).
        weight_decay: AdamW decoupled weight decay (torch's default 0.01; not in the paper).
        loss: block-output alignment, ``"cosine"`` (eq. 1) or ``"mse"`` (ablation, App. B.1).
        seed: seeds torch and the per-epoch shuffling (and the holdout split).
        warmup_steps: linear learning-rate warm-up steps before the cosine decay; None = 10% of
            the steps, at least 5, at most half (not in the paper); 0 = the paper's schedule.
        holdout: fraction of the calibration images kept out of training to pick the epoch, [0, 1).
        keep_best: return the epoch with the lowest alignment loss (the input weights included).
        memory_budget_mb: most memory (MB) held for cached dense targets.
        device: torch device the models, images and gradients live on while healing: "cpu",
            "cuda", "cuda:N" or "auto" (cuda when ``torch.cuda.is_available()``, else cpu);
            resolved when the config is built (the resolved name is stored and recorded, never
            "auto"). See :func:`edgeprune.heal.heal` for what runs where.
    """

    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-4
    min_lr: float = 1e-6
    weight_decay: float = 0.01
    loss: str = "cosine"
    seed: int = 0
    warmup_steps: int | None = None
    holdout: float = 0.0
    keep_best: bool = True
    memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises UserError for an out-of-range setting (one line, naming the option), an unknown
        device, or a CUDA device that is not available. Resolves ``device`` ("auto" -> cuda/cpu)."""
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise UserError(f"--epochs must be an integer >= 1, got {self.epochs}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise UserError(f"--batch-size must be an integer >= 1, got {self.batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr (learning rate) must be > 0, got {self.lr}")
        if not (0 <= self.min_lr <= self.lr):
            raise UserError(f"--min-lr (minimum learning rate) must be in [0, lr={self.lr}], got {self.min_lr}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise UserError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.loss not in LOSSES:
            raise UserError(f"unknown loss {self.loss!r} (choose from {', '.join(LOSSES)})")
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool)
                                              or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            raise UserError(f"--warmup-steps (warm-up steps) must be an integer >= 0, got {self.warmup_steps}")
        if not (0.0 <= self.holdout < 1.0):
            raise UserError(f"--holdout must be a fraction in [0, 1), got {self.holdout}")
        if self.memory_budget_mb is None or not self.memory_budget_mb > 0:
            raise UserError(f"--memory-budget-mb must be > 0, got {self.memory_budget_mb}")
        self.device = resolve_device(self.device)  # UserError: unknown device / no CUDA / no such index

    @classmethod
    def from_settings(cls, **settings) -> "HealConfig":
        """Build from keywords, rejecting unknown names with a UserError (not a TypeError)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - fields)
        if unknown:
            raise UserError(f"unknown heal setting(s) {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
        return cls(**settings)
