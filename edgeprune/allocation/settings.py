"""Checks of the allocation section of a prune's config that need the allocator's own rules (issue 39: each
package validates its own section; the section's field types and ranges are checked with the config itself,
``edgeprune.corp.config``).
"""

from __future__ import annotations

from edgeprune.allocation.rules import check_heads_setting
from edgeprune.corp.config import CorpConfig


def check_allocation_settings(cfg: CorpConfig) -> None:
    """Whole-head allocation's needs (a budget, a target with V/O statistics).

    Raises:
        UserError: one line naming the setting.
    """
    check_heads_setting(cfg)
