"""Checks of the embed-slice settings of :class:`~edgeprune.corp.CorpConfig` (issue 33)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprune.errors import UserError
from edgeprune.settings import Section, SettingError, setting

#: when the residual stream is sliced relative to the width pruning
EMBED_ORDERS = ("first", "last")
#: ``embed_sparsity`` value that lets the budget choose D' (``edgeprune.pruning.embed_auto``)
AUTO = "auto"


def is_auto(cfg) -> bool:
    """Whether ``cfg.embed_sparsity`` asks the budget to choose D' (``"auto"``)."""
    return isinstance(cfg.embed_sparsity, str) and cfg.embed_sparsity == AUTO


def parse_embed_sparsity(text):
    """``--embed-sparsity`` text: ``"auto"`` or a number (range checked with the config); None stays None.

    Raises:
        UserError: anything else.
    """
    if text is None or not isinstance(text, str):
        return text
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise SettingError(f"{{embed_sparsity}} must be a number in [0, 1) or 'auto', got {text!r}") from None


def _is_sparsity(s) -> bool:
    return not isinstance(s, bool) and isinstance(s, (int, float)) and 0.0 <= float(s) < 1.0


def check_embed_settings(cfg) -> None:
    """``cfg.embed_sparsity`` in [0, 1) or ``"auto"``, ``cfg.embed_order`` one of :data:`EMBED_ORDERS`,
    ``cfg.embed_refit`` a bool, ``cfg.embed_candidates`` None or a non-empty sequence of sparsities.
    A sliced model (a number > 0 or ``"auto"``) cannot take a latency budget (the table is measured
    at the dense D: it cannot price a sliced model). ``"auto"`` needs a FLOPs or params budget, order
    ``first`` and ``allocation_check_images`` >= 1 (its candidates are judged on those images).

    Raises:
        UserError: naming the bad setting.
    """
    s = cfg.embed_sparsity
    if not (is_auto(cfg) or _is_sparsity(s)):
        raise SettingError(f"{{embed_sparsity}} must be a number in [0, 1) or 'auto', got {s!r}")
    if cfg.embed_order not in EMBED_ORDERS:
        raise UserError(f"unknown embed order {cfg.embed_order!r} (choose from {', '.join(EMBED_ORDERS)})")
    if not isinstance(cfg.embed_refit, bool):
        raise UserError(f"embed refit must be True or False, got {cfg.embed_refit!r}")
    c = cfg.embed_candidates
    if c is not None and (isinstance(c, (str, bytes)) or not hasattr(c, "__len__") or not len(c)
                          or not all(_is_sparsity(v) for v in c)):
        raise UserError(f"embed candidates must be a non-empty list of numbers in [0, 1), got {c!r}")
    if (is_auto(cfg) or s) and cfg.budget is not None and not cfg.budget.model_class.prices_sliced_models:
        raise SettingError(f"{{embed_sparsity}} {s} cannot be priced with --{cfg.budget.kind} (its table is measured "
                           "at the dense embed dim); use {flops} or {params}")
    if not is_auto(cfg):
        if c is not None:
            raise UserError("embed candidates go with embed_sparsity='auto' (they would be ignored)")
        return
    if cfg.budget is None:
        raise SettingError("{embed_sparsity} auto needs a budget ({flops}/{params}) to choose D' for; "
                           "give a number without one")
    if cfg.embed_order != "first":
        raise SettingError("{embed_sparsity} auto slices first (the budget is spent on the sliced model); "
                           "drop {embed_order} last")
    if cfg.allocation_check_images < 1:
        raise SettingError("{embed_sparsity} auto judges its candidates on the check images; give "
                           "{allocation_check_images} >= 1")


@dataclasses.dataclass(frozen=True)
class EmbedSection(Section):
    """The residual-width slice (``edgeprune.embed``, docs/embed.md); checked with the rest of the prune's settings
    by :func:`check_embed_settings`."""

    name: ClassVar[str] = "embed"
    title: ClassVar[str] = "Embed slice"

    embed_sparsity: float | str = setting(
        0.0, "Also slice the residual stream (embedding dim D) to D' = (1-S) D, rotated into its principal subspace "
        "(docs/embed.md). auto (with --flops/--params): the budget chooses D' among S = 0, 0.125, 0.25 by the output "
        "error on the check images; costs one whole prune (calibration pass included) per candidate.",
        metavar="S|auto", kind="text", shown_default="0")
    embed_order: str | None = setting(None, "Slice the stream before (first) or after (last) the width pruning.",
                                      choices=EMBED_ORDERS, shown_default="first")
    embed_refit: bool = setting(False, "Ridge re-fit of the writers to the dense stream.", switch="flag")
    embed_candidates: tuple | None = setting(None, "The sparsities embed auto tries (None: EMBED_CANDIDATES).",
                                             cli=False)

    def validate(self) -> "EmbedSection":
        """The section with ``embed_sparsity`` as a number or ``"auto"`` (the command line's text parsed once; its
        range and its fit with the budget: :func:`check_embed_settings`).

        Raises:
            UserError: text that is neither a number nor ``auto``.
        """
        parsed = parse_embed_sparsity(self.embed_sparsity)
        return self if parsed == self.embed_sparsity and type(parsed) is type(self.embed_sparsity) else \
            self.replace(embed_sparsity=parsed)
