"""The criterion registry: importance objects that score channels (higher = kept).

A criterion is a small class with a ``name``, the statistics it ``needs`` from the calibration
pass, the kinds of channel it ranks (``applies_to``) and a ``scores(stats, weight)`` method;
``@register_criterion("name")`` makes it usable as ``CorpConfig(mlp_criterion="name")`` (and
``vo_criterion`` when it applies to V dims). A new criterion is one class plus one registration::

    @register_criterion("toy")
    class Toy(Criterion):
        needs = frozenset({"energy"})
        def scores(self, stats, weight):
            return stats.energy

The calibration pass asks :func:`get_criterion` what to collect (``Criterion.needs``) instead of
testing names.
"""

from __future__ import annotations

from typing import Callable

import torch

from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.registry import Registry

#: what a criterion may declare in ``needs``: "energy" = the per-channel second moments of the
#: layer's input (an :class:`MLPStatistics` pass), "positive" = also the fraction of positive
#: activations (``MLPStatistics(count_positive=True)``, ``active_prob``). A criterion needing
#: nothing (``magnitude``) reads the weight alone: without compensation no statistics pass is made.
STATISTICS = ("energy", "positive")

#: the channel kinds a criterion may rank: "mlp" (MLP hidden channels, input of fc2) and "vo"
#: (V dims, input of attn.proj; not post-GELU, so sign-based criteria do not apply)
KINDS = ("mlp", "vo")


class Criterion:
    """Importance of a Linear layer's input channels (the base class of every criterion).

    Attributes:
        name: the registered name (set by :func:`register_criterion`).
        needs: statistics the calibration pass must collect (subset of :data:`STATISTICS`).
        applies_to: channel kinds it ranks (subset of :data:`KINDS`).
    """

    name: str = ""
    needs: frozenset = frozenset({"energy"})
    applies_to: frozenset = frozenset(KINDS)

    def scores(self, stats: MLPStatistics | None, weight: torch.Tensor) -> torch.Tensor:
        """Channel scores (C,) float64, higher = more important.

        Args:
            stats: statistics of the layer's input channels (None when ``needs`` is empty and
                no compensation asked for them).
            weight: the consuming layer's weight (D_out, C) (``fc2.weight`` / ``proj.weight``).
        """
        raise NotImplementedError


#: criterion name -> the registered instance (registering a name again replaces it)
CRITERIA: Registry[Criterion] = Registry("criterion")


def register_criterion(name: str) -> Callable[[type], type]:
    """Class decorator: register an instance of a :class:`Criterion` subclass under ``name``
    (replacing any criterion of that name)."""

    def wrap(cls: type) -> type:
        obj = cls()
        obj.name = name
        CRITERIA.register(name, obj, replace=True)
        return cls

    return wrap


def unregister_criterion(name: str) -> None:
    """Remove the criterion registered as ``name`` (no error if there is none): for criteria that
    live only as long as a test or an experiment."""
    CRITERIA.unregister(name, missing_ok=True)


def list_criteria(kind: str | None = None) -> tuple[str, ...]:
    """Registered criterion names, in registration order (those ranking ``kind`` when given)."""
    return tuple(n for n, c in CRITERIA.items() if kind is None or kind in c.applies_to)


def get_criterion(name: str, kind: str = "mlp") -> Criterion:
    """The criterion registered as ``name`` for channels of ``kind`` ("mlp" or "vo").

    Raises:
        UserError: no criterion of that name ranks ``kind``; one line listing the ones that do.
    """
    crit = CRITERIA.find(name)
    if crit is None or kind not in crit.applies_to:
        what = {"mlp": "MLP", "vo": "V/O"}.get(kind, kind)
        raise CRITERIA.unknown(name, list_criteria(kind), f"{what} criterion")
    return crit
