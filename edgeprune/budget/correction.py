"""The measure-and-correct settings of a measured budget (issue 40; issue 53 item 4: one declaration for prune and
derive): :class:`Correction`, the section ``[correction]``.

With a budget whose cost model is measured (a latency table) and whose backend runs here, the pruned (derived)
model is benched against the dense (base) one; when it misses the budget by more than ``correction_tolerance``, it is
re-allocated (re-planned) with a corrected budget from the same statistics, at most ``correction_rounds`` times
(``edgeprune.budget.correction_loop``, ``edgeprune.nuwa.measured``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from edgeprune.settings import Section, SettingError, setting


def check_correction(verify_budget: Any, tolerance: Any, rounds: Any) -> None:
    """The three measure-and-correct settings, whoever holds them (``CorpConfig``, ``DeriveConfig``,
    :class:`Correction`).

    Raises:
        SettingError: one line naming the setting (in the caller's spelling: ``edgeprune.settings``).
    """
    if not isinstance(verify_budget, bool):
        raise SettingError(f"{{verify_budget}} must be True or False, got {verify_budget!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise SettingError(f"{{correction_tolerance}} must be a fraction in (0, 1) (0.03 = 3%), got {tolerance!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 0 <= rounds <= 10:
        raise SettingError(f"{{correction_rounds}} must be an integer in [0, 10], got {rounds!r}")


#: the values of the settings nobody gave (``Correction.resolved``; ``CorpConfig`` and ``DeriveConfig`` default to them)
DEFAULTS = {"verify_budget": True, "correction_tolerance": 0.03, "correction_rounds": 3}


@dataclasses.dataclass(frozen=True)
class Correction(Section):
    """The measure-and-correct loop's settings (``Correction(verify, tolerance, rounds)``; module doc). None = not
    given (:data:`DEFAULTS`, :meth:`resolved`): a setting given without a latency budget is refused
    (``edgeprune.option_checks.refuse_ignored``)."""

    name: ClassVar[str] = "correction"
    title: ClassVar[str] = "Latency correction"

    verify_budget: bool | None = setting(
        None, "With --latency: bench the {made} model against the {reference} one (interleaved) on the table's "
        "backend when it is present here, and record predicted vs measured latency.", flag="verify-latency",
        switch="pair", shown_default="on")
    correction_tolerance: float | None = setting(
        None, "With --latency: {redo} while the measured latency misses the budget by more than this fraction.",
        flag="latency-tolerance", metavar="F", unit="fraction", shown_default="0.03")
    correction_rounds: int | None = setting(
        None, "With --latency: at most N times {redo} with the corrected budget, 0-10.", flag="latency-rounds",
        metavar="N", shown_default="3")

    def validate(self) -> "Correction":
        """The section, its given settings checked (:func:`check_correction`).

        Raises:
            SettingError: naming the setting.
        """
        r = self.resolved()
        check_correction(r.verify_budget, r.correction_tolerance, r.correction_rounds)
        return self

    @classmethod
    def of(cls, holder: Any) -> "Correction":
        """The three settings as a flat config holds them (``CorpConfig``, ``DeriveConfig``: attributes of the
        same names)."""
        return cls(**{k: getattr(holder, k) for k in DEFAULTS})

    @property
    def replans(self) -> bool:
        """Whether a miss may be corrected at all: measured (``verify_budget``) with at least one round."""
        r = self.resolved()
        return bool(r.verify_budget) and int(r.correction_rounds) >= 1

    def not_asked(self) -> str | None:
        """The record's reason when the measurement is turned off (``verify_budget=False``), else None."""
        return "not asked (--no-verify-latency)" if self.verify_budget is False else None

    def refuse_unread(self, budget_kind: str | None) -> None:
        """Settings of this section given (not None) that nothing would read, refused (issue 41, as
        ``edgeprune.option_checks.refuse_ignored`` refuses the others): any of them without a ``latency`` budget,
        the tolerance or the rounds with the measurement off.

        Raises:
            SettingError: one line naming the setting and the one it goes with (in the caller's spelling).
        """
        verify = self.verify_budget
        if budget_kind != "latency" and verify is not None:
            flag = "{verify_budget}" if verify else "{not:verify_budget}"
            raise SettingError(f"{flag} goes with {{latency}} (it benches the pruned model against the dense one on "
                               "the latency table's backend); without a latency budget there is nothing to verify")
        for name, value in self.items():
            if name == "verify_budget" or value is None:
                continue
            if budget_kind != "latency":
                raise SettingError(f"{{{name}}} goes with {{latency}} (the measure-and-correct loop of a latency "
                                   "budget); without one there is nothing to correct")
            if verify is False:
                raise SettingError(f"{{{name}}} needs the measurement that {{not:verify_budget}} turns off")

    def resolved(self) -> "Correction":
        """The section with every setting nobody gave at its :data:`DEFAULTS` value."""
        return self.replace(**{k: DEFAULTS[k] for k, v in self.items() if v is None})


__all__ = ["Correction", "DEFAULTS", "check_correction"]
