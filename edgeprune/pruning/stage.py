"""Stages of the one-shot prune (issue 39): a small class each, run in order on one :class:`PruneState`.

A stage checks its section of the config before any pass (:meth:`Stage.check`), runs on the state
(:meth:`Stage.run`: the model is pruned in place, ``state.config`` may change for the stages after it) and adds
to the record (``state.info`` / ``state.record_parts``). The built-in order (``edgeprune.pruning.stages``):

    embed (first) -> CORP (statistics -> allocation -> plan -> solve -> cut) -> embed (last)
    -> class-token last block -> token merging (``tokens_stage.py``) -> output correction

A new stage is one file with a :class:`Stage` subclass registered with ``@register_stage("name", after=...)``
(tests/test_pruning_stages.py registers a toy one inside the test).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.anatomy import ViTAnatomy
from edgeprune.calibration.collect import calibration_device
from edgeprune.corp.config import CorpConfig
from edgeprune.errors import UserError
from edgeprune.phases import reached
from edgeprune.registry import Registry


@dataclasses.dataclass
class PruneState:
    """What the stages share during one prune.

    Attributes:
        model: the model being pruned in place (a copy of the caller's unless ``inplace``).
        anatomy: its anatomy (replaced by a stage that changes the model's structure, e.g. the embed slice).
        config: the config the next stage reads (a stage may hand on another one: a budget made absolute).
        asked: the config as the caller gave it (the record's ``config``).
        batches: callable returning fresh calibration batches (B, C, H, W).
        num_images: the calibration set's size, or None when unknown.
        progress: show progress bars.
        device: the torch device of the calibration passes (``edgeprune.calibration.collect.calibration_device``
            around the stages whose ``calibration_device`` is set).
        info: what the stages report for the record (``blocks``, ``allocation``, ``embed``, timings ...).
        record: entries a stage adds to the run record (top-level keys; a stage's own name is a good key).
        extra: stage-private values handed from one stage to a later one (e.g. the dense outputs of the output
            correction), by stage name.
    """

    model: nn.Module
    anatomy: ViTAnatomy
    config: CorpConfig
    asked: CorpConfig
    batches: Callable[[], Iterable[torch.Tensor]]
    num_images: int | None
    progress: bool = False
    device: str = "cpu"
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    record: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Stage:
    """One step of the prune (module doc). Subclasses set ``name`` (by the registration) and override
    :meth:`check` and/or :meth:`run`."""

    name = ""
    #: run inside ``calibration_device(state.device)`` (the stages whose passes collect statistics)
    calibration_device = False

    def check(self, state: PruneState) -> None:
        """Checks that need the model but no calibration pass (before any stage runs).

        Raises:
            UserError: one line naming the setting.
        """

    def prepare(self, state: PruneState) -> None:
        """Work before the first stage runs that needs the unpruned model (e.g. a pass over it)."""

    def run(self, state: PruneState) -> None:
        """The stage's work on ``state`` (the model in place)."""


#: stage name -> class (the one lookup); :data:`_ORDER` holds the order they run in
STAGES: Registry[type[Stage]] = Registry("stage")
_ORDER: list[str] = []


def register_stage(name: str, *, after: str | None = None, before: str | None = None):
    """Class decorator: add a :class:`Stage` subclass under ``name``, after the stage ``after`` or before the
    stage ``before`` (at the end when neither). Registering a name again replaces it in place.

    Raises:
        UserError: ``after`` / ``before`` not registered (one line listing the stages), or both given.
    """
    def deco(cls: type[Stage]) -> type[Stage]:
        cls.name = name
        if name in STAGES:
            STAGES.register(name, cls, replace=True)
            return cls
        if after is not None and before is not None:
            raise UserError("register a stage either after or before another one, not both")
        anchor = after if after is not None else before
        if anchor is not None and anchor not in STAGES:
            raise STAGES.unknown(anchor, _ORDER)
        pos = len(_ORDER) if anchor is None else _ORDER.index(anchor) + (1 if after is not None else 0)
        STAGES.register(name, cls)
        _ORDER.insert(pos, name)
        return cls
    return deco


def unregister_stage(name: str) -> None:
    """Remove a registered stage (tests that register a toy stage clean up with this; no error if there is none)."""
    STAGES.unregister(name, missing_ok=True)
    _ORDER[:] = [n for n in _ORDER if n != name]


def stage_names() -> list[str]:
    """The registered stages, in the order they run."""
    return list(_ORDER)


def run_stages(state: PruneState, after_checks: Callable[[PruneState], None] | None = None) -> PruneState:
    """Check every registered stage, call ``after_checks`` (the caller's work between the checks and the first
    pass: the dense model's summary, the calibration batches), prepare every stage, then run them in order.

    Raises:
        UserError: a stage's check.
    """
    names = stage_names()
    stages = [STAGES.get(n)() for n in names]
    for s in stages:
        s.check(state)
    reached("checked")
    if after_checks is not None:
        after_checks(state)
    for s in stages:
        s.prepare(state)
    for name, s in zip(names, stages):
        reached(f"stage {name}")
        with calibration_device(state.device) if s.calibration_device else contextlib.nullcontext():
            s.run(state)
    return state
