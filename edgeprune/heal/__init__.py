"""STARFISH healing (starfish §3.2, App. B; METHODS.md §2): train the reduced layers of a pruned
ViT so that every block's output aligns (cosine, eq. 1) with the dense model's.

    from edgeprune.heal import heal
    result = heal(pruned, dense, calibration_images, epochs=10, batch_size=32)
    healed = result.model

Modules: :mod:`~edgeprune.heal.alignment` (loss, block-output hooks), :mod:`~edgeprune.heal.targets`
(calibration access, dense targets on the fly or in a disk cache), :mod:`~edgeprune.heal.trainer`
(:func:`heal`), :mod:`~edgeprune.heal.loop` (its steps), :mod:`~edgeprune.heal.measure` (eval passes),
:mod:`~edgeprune.heal.determinism`, :mod:`~edgeprune.heal.checkpoint` (resume), :mod:`~edgeprune.heal.config`
(:class:`HealConfig`), :mod:`~edgeprune.heal.reduced` (which layers train),
:mod:`~edgeprune.heal.schedule` (learning rate), :mod:`~edgeprune.heal.runs` (healing a run
directory). The CLI is ``edgeprune heal`` (:mod:`edgeprune.cli.heal`).
"""

from edgeprune.heal.alignment import (LOSSES, BlockCapture, alignment_loss, per_block_alignment,
                                      per_image_alignment)
from edgeprune.heal.targets import CalibrationSet, DenseTargets, DiskTargetCache, state_fingerprint
from edgeprune.heal.config import HealConfig
from edgeprune.heal.reduced import reduced_modules, reduced_modules_from_record
from edgeprune.heal.schedule import cosine_lr
from edgeprune.heal.measure import measure_alignment
from edgeprune.heal.trainer import HealResult, heal

__all__ = [
    "LOSSES", "BlockCapture", "alignment_loss", "per_block_alignment", "per_image_alignment",
    "CalibrationSet", "DenseTargets", "DiskTargetCache", "state_fingerprint",
    "HealConfig", "HealResult", "cosine_lr", "heal", "measure_alignment", "reduced_modules",
    "reduced_modules_from_record",
]
