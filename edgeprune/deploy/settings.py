"""A deploy's own settings, declared once (issue 53): the sections ``[deploy]`` and ``[heal]``.

``edgeprune deploy``'s setting options, their ``--help-all`` groups and recipe tables are generated from these
declarations (``edgeprune.cli.generate``); the field names are :func:`edgeprune.deploy`'s keywords
(``--heal-epochs`` = ``heal_epochs``). The prune settings a deploy hands on (the budget: ``sparsity``, ``flops``,
``params``, ``latency``, ``latency_table``; ``tokens_merge``) are the prune's own declarations
(``edgeprune.pruning.settings``, :data:`PRUNE_SETTINGS`), not declared again. The job's own inputs (the model, the
calibration and evaluation images, the seed, the batch size, the profile, the torch device, the folder, quiet) are
not settings. Deploy recipes written before these sections had ``precision`` in ``[method]`` and ``bench`` /
``bench-iterations`` in ``[runtime]``: still read there (``edgeprune.cli.recipe.LEGACY_SECTIONS``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from edgeprune.heal.settings import HealSection
from edgeprune.settings import Declared, Section, SettingError, declared_of, setting

#: the precisions a deploy can deploy
PRECISIONS = ("fp32", "fp16", "int8")
#: the prune settings a deploy hands on to its prune stage (declared in ``edgeprune.pruning.settings``)
PRUNE_SETTINGS = ("sparsity", "flops", "params", "latency", "latency_table", "tokens_merge")


@dataclasses.dataclass(frozen=True)
class DeploySection(Section):
    """What a deploy deploys and which of its optional stages run: the precision, the bench."""

    name: ClassVar[str] = "deploy"
    title: ClassVar[str] = "Deploy"

    precision: str | None = setting(None, "Deployed precision (int8: TensorRT recipe on a TensorRT profile, dynamic "
                                    "on ONNX Runtime).", choices=PRECISIONS, essential=True,
                                    shown_default="the profile's: build.precision or onnxruntime.precision")
    bench: bool = setting(True, "Bench the deployed model vs the dense one.", switch="pair")
    bench_iterations: int | None = setting(None, "Timed runs per batch size in the bench stage.", metavar="N",
                                           minimum=1, shown_default="the profile's")


@dataclasses.dataclass(frozen=True)
class DeployHealSection(Section):
    """Whether a deploy heals its pruned run (``edgeprune heal``'s job) before the export, and how long."""

    name: ClassVar[str] = "heal"
    title: ClassVar[str] = "Heal"

    heal: bool = setting(False, "Heal the pruned run with STARFISH (`edgeprune heal`) before the export.",
                         switch="pair")
    heal_epochs: int | None = setting(None, "Heal: passes over the calibration set.", metavar="N", minimum=1,
                                      shown_default=f"heal's: {HealSection.epochs}")
    heal_lr: float | None = setting(None, "Heal: AdamW learning rate, > 0.", metavar="LR",
                                    shown_default=f"heal's: {HealSection.lr:.0e}".replace("e-0", "e-"))

    def validate(self) -> "DeployHealSection":
        """The section, checked before any work.

        Raises:
            SettingError: ``heal_epochs`` / ``heal_lr`` without ``heal``; a learning rate <= 0.
        """
        for key in ("heal_epochs", "heal_lr"):
            if getattr(self, key) is not None and not self.heal:
                raise SettingError(f"{{{key}}} goes with {{heal}} (heal the pruned run before the export)")
        if self.heal_lr is not None and not self.heal_lr > 0:
            raise SettingError(f"{{heal_lr}} (the heal's learning rate) must be > 0, got {self.heal_lr}")
        return self


#: the sections of a deploy's own settings, in help / recipe order
DEPLOY_SECTIONS: tuple[type[Section], ...] = (DeploySection, DeployHealSection)


def deploy_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every setting of a deploy's own (``edgeprune.settings.declared_of``)."""
    return declared_of(DEPLOY_SECTIONS)


def deploy_sections(values: Mapping[str, Any]) -> dict[str, Section]:
    """``{section name: validated section}`` of a deploy's own settings in ``values`` (other keys ignored).

    Raises:
        SettingError: naming the first bad setting.
    """
    return {s.name: s.from_mapping({k: values[k] for k in s.field_names() if k in values}).validate()
            for s in DEPLOY_SECTIONS}


__all__ = ["DEPLOY_SECTIONS", "DeployHealSection", "DeploySection", "PRECISIONS", "PRUNE_SETTINGS",
           "deploy_declared", "deploy_sections"]
