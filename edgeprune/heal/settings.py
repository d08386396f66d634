"""A STARFISH heal's settings, declared once (issue 53): the section ``[heal]`` (starfish §3.2, App. B; METHODS.md §2).

``edgeprune heal``'s setting options, its ``--help-all`` "Method options" group and its recipe table ``[heal]`` are
generated from :class:`HealSection` (``edgeprune.cli.generate``); the field names are
:func:`edgeprune.jobs.heal_run.heal_run`'s keywords (``--min-lr`` = ``min_lr``). The job's own inputs (the run
directory, the calibration and evaluation images, their counts, the seed, the batch size, the devices, the output)
are not settings. Recipes of 9c01182 had these keys in ``[method]``, ``[data]`` (``holdout``) and ``[runtime]``
(``cache-targets``, ``memory-budget-mb``): still read there (``edgeprune.cli.recipe.LEGACY_SECTIONS``). The run
record's ``healing.config`` is the :class:`~edgeprune.heal.config.HealConfig` view (:meth:`HealSection.config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from edgeprune.heal.alignment import LOSSES
from edgeprune.heal.config import HealConfig
from edgeprune.heal.targets import DEFAULT_MEMORY_BUDGET_MB
from edgeprune.settings import Declared, Section, declared_of, setting


@dataclasses.dataclass(frozen=True)
class HealSection(Section):
    """How STARFISH heals: the schedule, the alignment loss, the dense targets' cache and the kept epoch."""

    name: ClassVar[str] = "heal"
    title: ClassVar[str] = "Method"  # the --help-all group of heal's method options, as before

    epochs: int = setting(10, "Passes over the calibration set (paper: 5-10).", essential=True)
    lr: float = setting(1e-4, "AdamW learning rate (cosine schedule start). The paper's 6e-4 suits uncompensated "
                        "models with hundreds of steps; 1e-4 keeps CORP's compensation (README).", essential=True)
    min_lr: float = setting(1e-6, "Cosine schedule end.")
    warmup_steps: int | None = setting(None, "Linear learning-rate warm-up steps before the cosine decay (not in the "
                                       "paper; 0 = the paper's schedule) [10% of the steps, at least 5, at most half].")
    weight_decay: float = setting(0.01, "AdamW weight decay.")
    loss: str = setting("cosine", "Block-output alignment: cosine (STARFISH eq. 1) or mse (ablation).",
                        choices=LOSSES)
    cache_targets: str | None = setting(None, "Cache the dense block outputs in DIR (safetensors shards; reusable "
                                        "across runs of the same dense model and calibration set) [recompute per "
                                        "batch].", metavar="DIR")
    memory_budget_mb: float = setting(DEFAULT_MEMORY_BUDGET_MB, "Most memory held for cached targets; beyond "
                                      "it shards are streamed from disk.")
    keep_best: bool = setting(True, "Return the epoch with the lowest alignment loss on the calibration set (the "
                              "input included), or the last epoch (the paper).", switch="pair", negation="keep-last")
    holdout: float = setting(0.0, "Fraction of the calibration images held out of training; the kept epoch is the "
                             "one with the lowest alignment loss on them (early stopping).", essential=True)

    def config(self, **inputs: Any) -> HealConfig:
        """The validated :class:`HealConfig` of these settings and the job's inputs that are config fields
        (``batch_size``, ``seed``, ``device``; missing ones at HealConfig's defaults).

        Raises:
            UserError: one line naming the first bad setting by its option.
        """
        values = self.to_dict()
        values.pop("cache_targets")  # where the targets are cached, not how the model is healed
        return HealConfig(**values, **inputs)

    def validate(self) -> "HealSection":
        """The section, checked as the heal checks it (:meth:`HealConfig.validate`).

        Raises:
            UserError: one line naming the first bad setting.
        """
        self.config()
        return self


#: the sections of a heal, in help / recipe order
HEAL_SECTIONS: tuple[type[Section], ...] = (HealSection,)


def heal_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every heal setting (``edgeprune.settings.declared_of``)."""
    return declared_of(HEAL_SECTIONS)


__all__ = ["HEAL_SECTIONS", "HealSection", "heal_declared"]
