"""Checks of the embed-slice settings of :class:`~edgeprune.corp.CorpConfig` (issue 33)."""

from __future__ import annotations

from edgeprune.errors import UserError

#: when the residual stream is sliced relative to the width pruning
EMBED_ORDERS = ("first", "last")


def check_embed_settings(cfg) -> None:
    """``cfg.embed_sparsity`` in [0, 1), ``cfg.embed_order`` one of :data:`EMBED_ORDERS`,
    ``cfg.embed_refit`` a bool.

    Raises:
        UserError: naming the bad setting.
    """
    s = cfg.embed_sparsity
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= float(s) < 1.0:
        raise UserError(f"--embed-sparsity must be a number in [0, 1), got {s!r}")
    if cfg.embed_order not in EMBED_ORDERS:
        raise UserError(f"unknown embed order {cfg.embed_order!r} (choose from {', '.join(EMBED_ORDERS)})")
    if not isinstance(cfg.embed_refit, bool):
        raise UserError(f"embed refit must be True or False, got {cfg.embed_refit!r}")
