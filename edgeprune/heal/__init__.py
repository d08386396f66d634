"""STARFISH healing (starfish §3.2, App. B; METHODS.md §2): train the reduced layers of a pruned
ViT so that every block's output aligns (cosine, eq. 1) with the dense model's.

    from edgeprune.heal import heal
    result = heal(pruned, dense, calibration_images, epochs=10, batch_size=32)
    healed = result.model

Modules: :mod:`~edgeprune.heal.alignment` (loss, block-output hooks), :mod:`~edgeprune.heal.targets`
(calibration access, dense targets on the fly or in a disk cache), :mod:`~edgeprune.heal.trainer`
(the AdamW loop, checkpoint/resume). The CLI is ``edgeprune heal`` (:mod:`edgeprune.cli_heal`).
"""

from edgeprune.heal.alignment import (LOSSES, BlockCapture, alignment_loss, per_block_alignment,
                                      per_image_alignment)
from edgeprune.heal.targets import CalibrationSet, DenseTargets, DiskTargetCache, state_fingerprint
from edgeprune.heal.trainer import (HealResult, cosine_lr, heal, measure_alignment, reduced_modules,
                                    reduced_modules_from_record)

__all__ = [
    "LOSSES", "BlockCapture", "alignment_loss", "per_block_alignment", "per_image_alignment",
    "CalibrationSet", "DenseTargets", "DiskTargetCache", "state_fingerprint",
    "HealResult", "cosine_lr", "heal", "measure_alignment", "reduced_modules", "reduced_modules_from_record",
]
