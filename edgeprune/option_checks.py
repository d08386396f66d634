"""Checks of settings that conflict with each other, shared by the command line and the Python API
(issue 32: no setting is silently ignored).

* :func:`refuse_sparsities_with_budget` -- a ``--flops`` / ``--params`` budget allocates the kept
  dims itself, so a sparsity given beside it would be ignored: refused, as ``--flops`` with
  ``--params`` is.
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeprune.errors import UserError

__all__ = ["refuse_sparsities_with_budget"]


def refuse_sparsities_with_budget(budget: str | None, given: Mapping[str, Any]) -> None:
    """Refuse sparsities given together with a budget.

    Args:
        budget: the budget's option (``"--flops"`` / ``"--params"``, or the API's ``"flops="``), or
            None when there is no budget (nothing to check).
        given: option name -> value of each sparsity setting; None (or absent) = not given.

    Raises:
        UserError: one line naming the budget and every sparsity given with it.
    """
    if budget is None:
        return
    names = [name for name, value in given.items() if value is not None]
    if names:
        raise UserError(f"{budget} replaces the sparsity: drop {', '.join(names)} (the budget allocates the "
                        "kept dims per block and module; --target chooses the modules)")
