"""Checks of settings that conflict with each other, shared by the command line and the Python API
(issue 32: no setting is silently ignored).

* :func:`refuse_sparsities_with_budget` -- a ``--flops`` / ``--params`` budget allocates the kept
  dims itself, so a sparsity given beside it would be ignored: refused, as ``--flops`` with
  ``--params`` is.
* :func:`refuse_ignored` -- a setting given where nothing reads it (``--check-images`` without a budget, ...).

Both name the settings in the caller's spelling (``edgeprune.settings.SettingError``).
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeprune.settings import SettingError

__all__ = ["refuse_ignored", "refuse_sparsities_with_budget"]


def refuse_sparsities_with_budget(budget: str | None, given: Mapping[str, Any]) -> None:
    """Refuse sparsities given together with a budget.

    Args:
        budget: the budget's kind (``"flops"``, ``"params"``, ``"latency"``, a registered one), or None when there
            is no budget (nothing to check).
        given: setting name -> value of each sparsity setting (``sparsity``, ``mlp_sparsity``, ...); None (or
            absent) = not given.

    Raises:
        SettingError: one line naming the budget and every sparsity given with it (in the caller's spelling:
            ``--flops`` / ``flops``).
    """
    if budget is None:
        return
    names = [name for name, value in given.items() if value is not None]
    if names:
        drop = ", ".join(f"{{{n}}}" for n in names)
        raise SettingError(f"{{{budget}}} replaces the sparsity: drop {drop} (the budget allocates the kept dims per "
                           "block and module; {target} chooses the modules)")


def _slices(embed_sparsity: Any) -> bool:
    """Whether ``embed_sparsity`` slices the residual stream (a number > 0, or ``"auto"``; a bad value counts as a
    slice: its own check names it)."""
    if embed_sparsity is None:
        return False
    try:
        return float(embed_sparsity) != 0.0
    except (TypeError, ValueError):
        return True


def refuse_ignored(given: Mapping[str, Any], budget: str | None) -> None:
    """Settings given (not None) that nothing would read are refused (issue 41; the command line's checks of
    9c01182, the library's since issue 53 so that a Python caller is told too): the allocation's check and
    sensitivity images without a budget, the embed slice's order or refit without a slice (the measure-and-correct
    settings refuse themselves: ``edgeprune.budget.correction.Correction.refuse_unread``).

    Args:
        given: setting name -> value as given (None = not given; ``embed_refit`` False = not given).
        budget: the budget's kind, or None.

    Raises:
        SettingError: one line naming the setting and the one it goes with (in the caller's spelling).
    """
    if budget is None:
        for name in ("allocation_check_images", "allocation_sensitivity_images"):
            if given.get(name) is not None:
                raise SettingError(f"{{{name}}} goes with {{flops}}/{{params}}/{{latency}} (it measures the budget's "
                                   "candidate allocations); without a budget there is nothing to measure")
    if not _slices(given.get("embed_sparsity")):
        for name in ("embed_order", "embed_refit"):
            if given.get(name) not in (None, False):
                raise SettingError(f"{{{name}}} goes with {{embed_sparsity}} S (S > 0 or auto: the residual-stream "
                                   "slicing it configures); without it nothing is sliced")
