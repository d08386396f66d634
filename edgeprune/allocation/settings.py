"""Checks of the allocation section of a prune's config that need the allocator's own rules (issue 39: each
package validates its own section; the section's field types and ranges are checked with the config itself,
``edgeprune.corp.config``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprune.allocation.rules import check_heads_setting
from edgeprune.corp.config import CorpConfig
from edgeprune.settings import Section, setting


@dataclasses.dataclass(frozen=True)
class AllocationSection(Section):
    """How a budget's allocation is chosen and checked (``edgeprune.allocation.select``; the effect of each field:
    ``edgeprune.corp.config.CorpConfig``). None = not given (``CorpConfig``'s default; given without a budget:
    refused, ``edgeprune.option_checks.refuse_ignored``)."""

    name: ClassVar[str] = "allocation"
    title: ClassVar[str] = "Allocation"

    allocation_check_images: int | None = setting(
        None, "With a budget: the candidate allocations and the per-unit sensitivities are measured on the first N "
        "calibration images (0: the proxy alone).", flag="check-images", metavar="N", unit="images",
        shown_default="32")
    allocation_sensitivity_images: int | None = setting(
        None, "With a budget: measure each unit's sensitivity on the first N check images.", flag="sensitivity-images",
        metavar="N", unit="images", shown_default="8")
    allocation_sensitivity: bool = setting(True, "Also measure each unit's error alone (a greedy candidate).",
                                           cli=False)
    allocation_anchors: int = setting(1, "Measurements per unit curve (1 or 2).", cli=False)
    allocate_heads: bool | None = setting(None, "Whole heads as allocation units (None: the budget kind's default).",
                                          cli=False)


def check_allocation_settings(cfg: CorpConfig) -> None:
    """Whole-head allocation's needs (a budget, a target with V/O statistics).

    Raises:
        UserError: one line naming the setting.
    """
    check_heads_setting(cfg)
