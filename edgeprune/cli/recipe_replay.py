"""Exact replays of recipe files (issue 52): what a measured run's recipe keeps, and outputs that follow ``-o``.

A ``--latency`` run of prune or derive is decided by measurements (the correction round closest to the budget is
kept), so its recipe has a ``[replay]`` section with what each round measured (:func:`replay_rounds`,
:func:`replay_lines`; read back by :func:`read_replay`); a replay of the file's budget hands those out instead of
measuring (:class:`ReplayMeasurer`), makes the run's rounds (checked: else refused) and gives the run's model;
``--verify-latency`` or a budget typed on the command line measures again, said in one line
(:func:`replay_measurer`). A report the recipe wrote beside its output follows a ``-o`` typed on the command line
(:func:`follow_output`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import click
from click.core import ParameterSource

from edgeprune.cli.recipe_toml import META_FILE, META_REPLAY, non_finite, shown, toml_plain, toml_value
from edgeprune.errors import UserError

#: the section of a measured run's recipe that holds what it measured (issue 52; not options: :func:`replay_measurer`),
#: and the commands that write and read it (their ``--latency`` runs are measured and corrected)
REPLAY = "replay"
REPLAYS = ("prune", "derive")


def read_replay(path: Path, table: Any) -> list[dict[str, Any]]:
    """The ``[replay]`` section of a recipe: ``latency = [{budget-value, predicted, measured = {dense_ms,
    pruned_ms, ratio, ...}}, ...]``, one entry per round of the run's measured latency correction.

    Raises:
        UserError: another shape (one line naming the file and the field).
    """
    where = f"{path}: [{REPLAY}]"
    if not isinstance(table, dict):
        raise UserError(f"{where} must be a section, not a value")
    unknown = sorted(set(table) - {"latency"})
    if unknown:
        raise UserError(f"{where} {unknown[0]}: unknown key (the section holds latency = [...], what the run measured)")
    rounds = table.get("latency")
    if not isinstance(rounds, list) or not rounds:
        raise UserError(f"{where} latency: wants a list of the run's rounds ({{budget-value, predicted, measured}})")
    if non_finite(rounds):
        raise UserError(f"{where} latency: not a finite number in {shown(rounds)}")
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    for i, r in enumerate(rounds):
        m = r.get("measured") if isinstance(r, dict) else None
        if (not isinstance(r, dict) or not number(r.get("budget-value")) or not number(r.get("predicted"))
                or not isinstance(m, dict) or not all(number(m.get(k)) for k in ("dense_ms", "pruned_ms", "ratio"))):
            raise UserError(f"{where} latency[{i}] = {shown(r)}: wants {{budget-value = V, predicted = P, measured = "
                            "{dense_ms = D, pruned_ms = M, ratio = R}} (numbers > 0)")
    return rounds


def replay_rounds(rec: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The ``[replay]`` entries of a run whose latency was measured (``latency_check.rounds``): per round the
    budget value asked of the table, the prediction and the measurement (its plain fields); ``kept`` marks the
    round the run kept. None when nothing was measured (a replay then measures nothing either, or measures as
    the run would have: the model is the same unless the table's backend appeared)."""
    chk = rec.get("latency_check")
    rounds = chk.get("rounds") if isinstance(chk, dict) else None
    if not rounds:
        return None
    kept = int(chk.get("chosen_round") or 0)
    return [{"budget-value": float(r["budget_value"]), "predicted": float(r["predicted"]),
             "measured": {k: v for k, v in (r.get("measured_ms") or {}).items() if toml_plain(v)},
             "kept": r.get("round", i) == kept} for i, r in enumerate(rounds)]


def replay_lines(replay: list[dict[str, Any]]) -> list[str]:
    """The ``[replay]`` section of a measured run's recipe (:func:`replay_rounds`), as lines with their comment."""
    kept = next((i for i, r in enumerate(replay) if r.get("kept")), len(replay) - 1)
    lines = ["", "# What the run measured (issue 52): each round of its latency correction (the budget value the",
             "# table was asked for, its prediction, the measurement). A replay with this latency budget uses",
             "# these measurements instead of measuring again: the same rounds, the same model (the run kept "
             f"round {kept}).", "# To measure again: delete this section, or type --verify-latency.",
             f"[{REPLAY}]", "latency = ["]
    lines += [f"  {toml_value({k: v for k, v in r.items() if k != 'kept'})}," for r in replay]
    return lines + ["]"]


def tokens_choice(ctx: click.Context, rec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``(values, notes)`` of a ``--tokens-merge auto`` run whose candidates were measured: its recipe replays the
    chosen schedule (the ``[replay]`` section holds that candidate's measurements only); else ``({}, {})``."""
    auto = rec.get("tokens_auto")
    if ctx.params.get("tokens_merge") != "auto" or not isinstance(auto, dict) or replay_rounds(rec) is None:
        return {}, {}
    chosen = auto.get("chosen")
    text = ",".join(str(r) for r in chosen) if isinstance(chosen, list) else str(chosen)
    return {"tokens-merge": text}, {"tokens-merge": f'the run asked "auto", which chose {text} after each candidate\'s '
                                                   "measured correction: its replay prunes with that schedule"}


class ReplayMeasurer:
    """The measurer of a replay (``edgeprune.budget.correction_loop.Measurer``): hands out the recorded measurement
    of each round in turn, measures nothing; :meth:`check` then confirms that the replay made the run's rounds."""

    def __init__(self, rounds: list[dict[str, Any]], where: str) -> None:
        self.rounds, self.where, self.calls = rounds, where, 0

    def __call__(self, dense: Any, pruned: Any) -> dict[str, Any]:
        if self.calls >= len(self.rounds):
            raise UserError(f"{self.where}: the replay asks for round {self.calls} of the latency correction, the run "
                            f"made {len(self.rounds)}: {self._why}")
        self.calls += 1
        return dict(self.rounds[self.calls - 1]["measured"])

    _why = ("the recorded measurements do not fit this prune (an option typed on the command line, the data or the "
            "latency table changed); type --verify-latency to measure again")

    def check(self, rec: dict[str, Any]) -> str:
        """The line that says the replay used the recorded measurements, after confirming each round asked the
        table for the run's value and got the run's prediction.

        Raises:
            UserError: another round than the run's (nothing is written yet).
        """
        chk = rec.get("latency_check") or {}
        got = [(float(r["budget_value"]), float(r["predicted"])) for r in chk.get("rounds") or []]
        want = [(float(r["budget-value"]), float(r["predicted"])) for r in self.rounds]
        for i, (g, w) in enumerate(zip(got, want)):
            if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(g, w)):
                raise UserError(f"{self.where}: round {i} of the replay asked the table for {g[0]:.6g} (predicted "
                                f"{g[1]:.6g}), the run for {w[0]:.6g} (predicted {w[1]:.6g}): {self._why}")
        if len(got) != len(want):
            raise UserError(f"{self.where}: the replay made {len(got)} rounds of the latency correction, the run "
                            f"{len(want)}: {self._why}")
        chk["replayed"] = f"the measurements recorded in {self.where} (nothing measured again)"
        return (f"latency: the {len(want)} measurement(s) recorded in {self.where} replayed, nothing measured again: "
                f"the run's rounds, round {chk.get('chosen_round', 0)} kept (--verify-latency: measure again)")


def replay_measurer(ctx: click.Context, say: Callable[[str], None] = click.echo) -> ReplayMeasurer | None:
    """The measurer of a recipe's ``[replay]`` section (:class:`ReplayMeasurer`) when the replay is of the file's
    own latency budget, else None. Not used (said in one line): a budget typed on the command line (a new budget
    is measured), or ``--verify-latency`` / ``--no-verify-latency`` typed (measure again / do not measure)."""
    rounds = ctx.meta.get(META_REPLAY)
    if not rounds:
        return None
    where = f"{ctx.meta.get(META_FILE)} [{REPLAY}]"
    typed = [f"--{n}" for n in ("latency", "flops", "params") if n in ctx.params
             and ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
    if ctx.get_parameter_source("verify_budget") == ParameterSource.COMMANDLINE:
        typed.append("--verify-latency" if ctx.params.get("verify_budget") else "--no-verify-latency")
    if typed or ctx.get_parameter_source("latency") != ParameterSource.DEFAULT_MAP:
        say(f"the recorded measurements of {where} are not used ({', '.join(typed) or 'no latency budget'} "
            "on the command line)")
        return None
    return ReplayMeasurer(rounds, where)


def _same_path(a: Path, b: Path) -> bool:
    return a.resolve(strict=False) == b.resolve(strict=False)


def follow_output(ctx: click.Context, name: str, output_name: str, suffix: str) -> Path | None:
    """The new value of an output-derived path option (issue 52: a report the recipe wrote beside its
    output) when ``-o`` moved the output of a replay: parameter ``name`` came from the recipe, the output
    (parameter ``output_name``) was typed on the command line and differs from the recipe's, and the
    recipe's value lies in the folder of the recipe's output. Then ``<new output's stem><suffix>`` beside
    the new output (never the old report: a replay elsewhere leaves the first run's files as they are);
    else None (the value stays: an existing file is then refused without ``--force``)."""
    if (ctx.get_parameter_source(name) != ParameterSource.DEFAULT_MAP
            or ctx.get_parameter_source(output_name) != ParameterSource.COMMANDLINE):
        return None
    old_out = (ctx.default_map or {}).get(output_name)
    new_out, value = ctx.params.get(output_name), ctx.params.get(name)
    if old_out is None or new_out is None or value is None:
        return None
    old_out, new_out, value = Path(old_out), Path(new_out), Path(value)
    if _same_path(old_out, new_out) or not _same_path(value.parent, old_out.parent):
        return None
    return new_out.with_name(new_out.stem + suffix)


__all__ = ["REPLAY", "REPLAYS", "ReplayMeasurer", "follow_output", "read_replay", "replay_lines", "replay_measurer",
           "replay_rounds", "tokens_choice"]
