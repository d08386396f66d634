"""The head section of a prune's settings (issue 53): the output correction (``edgeprune.pruning.output``:
the classifier's bias correction and refit, ``edgeprune.solve.output_bias`` / ``head_refit``) and the class-token
last block (``edgeprune.layers.class_token_block``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprune.layers.class_token_block import LAST_BLOCK_CHOICES
from edgeprune.settings import Section, setting


@dataclasses.dataclass(frozen=True)
class HeadSection(Section):
    """What a prune does to the model's output head (``CorpConfig`` documents each field's effect)."""

    name: ClassVar[str] = "head"
    title: ClassVar[str] = "Output head"

    bias_correction_images: int | None = setting(
        None, "Fold the pruned model's mean output shift against the dense model, measured on the first N calibration "
        "images, into the classifier bias (models with a linear head; 0 = off).", flag="bias-correction",
        metavar="N", unit="images", minimum=0, shown_default="all images with a budget, else 0")
    head_refit: bool | None = setting(
        None, "With the output correction on: re-fit the classifier head (weights and bias) to the dense model's "
        "outputs, ridge toward the dense head with its strength chosen by cross-validation (the bias correction alone "
        "is one of the candidates).", switch="pair", shown_default="on whenever the correction runs")
    last_block: str = setting(
        "auto", "cls: the pruned model's last block computes only the class token its classifier reads (exact; the "
        "other tokens' queries, attention rows, proj and MLP are dropped); full: every token (auto: cls with a budget "
        "where the classifier reads the class token).", choices=LAST_BLOCK_CHOICES, shown_default="auto")


__all__ = ["HeadSection"]
