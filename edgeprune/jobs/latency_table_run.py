"""The job of ``edgeprune latency-table``: time a model's block structures on a device profile (issue 30) into a
:class:`~edgeprune.latency.table.LatencyTable` JSON (docs/latency.md), reported as the command reports it.

Every input is checked before any timing: the profile, batch / threads, the backend being present here (a
TensorRT profile off its device: one line naming the command to run there), the output folder, an existing output
of another key (``force`` replaces it; the same key resumes it). The table's ``<table>.recipe.toml`` is the CLI's:
``write_recipe(table_path)`` is called once the table is built, when given.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from devices import load_profile
from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import check_writable
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import load_model
from edgeprune.latency.build import WHOLE, BuildOptions, build_table, settings_for
from edgeprune.latency.grid import parse_token_counts
from edgeprune.latency.table import LatencyTable
from edgeprune.zoo.registry import MissingWeightsError


@dataclasses.dataclass
class LatencyTableRunResult:
    """Outcome of :func:`latency_table_run`: the table file written and the complete table."""

    out: Path
    table: LatencyTable


def _options(batch: int | None, threads: int | None, precision: str | None, backend: str | None,
             warmup: int | None, iterations: int | None, max_seconds: float | None, statistic: str,
             interleave: bool, repeats: int | None, spread: float | None, retries: int | None, clock: str,
             force: bool, grid: dict[str, Any] | None, tokens: str | Sequence[int] | None) -> BuildOptions:
    """The build's :class:`BuildOptions` (``repeats`` / ``spread`` / ``retries`` None: the defaults of the spread
    check; ``tokens``: the token axis, added to ``grid``).

    Raises:
        UserError: a spread setting with ``repeats`` 1 (no check), a token count that is not an integer.
    """
    if repeats == 1 and (spread is not None or retries is not None):
        given = "{spread}" if spread is not None else "{retries}"
        raise SettingError(f"{given} goes with the spread check, which {{repeats}} 1 turns off (drop one of them)")
    check = {k: v for k, v in (("repeats", repeats), ("spread", spread), ("retries", retries)) if v is not None}
    if tokens is not None and not isinstance(tokens, str):
        tokens = ",".join(str(t) for t in tokens)
    counts = parse_token_counts(tokens)  # non-integers: one line; the model's limits: build_table, before timing
    return BuildOptions(**check, batch=batch, threads=threads, precision=precision, backend=backend, warmup=warmup,
                        iterations=iterations, max_seconds=max_seconds, statistic=statistic,
                        interleave=interleave, clock=clock, force=force,
                        grid={**(grid or {}), **({"tokens": counts} if counts else {})})


def latency_table_run(out: str | Path, *, model_name: str | None, device: Any = "cpu",
                      checkpoint: str | Path | None = None, random_init: bool = False, num_classes: int | None = None,
                      img_size: int | None = None, model_kwargs: dict | None = None, batch: int | None = None,
                      threads: int | None = None, precision: str | None = None, backend: str | None = None,
                      warmup: int | None = None, iterations: int | None = None, max_seconds: float | None = 1.0,
                      statistic: str = "p50", interleave: bool = True, repeats: int | None = None,
                      spread: float | None = None, retries: int | None = None, clock: str = "auto",
                      grid: dict[str, Any] | None = None, tokens: str | Sequence[int] | None = None,
                      force: bool = False, quiet: bool = False, echo: Echo = _echo,
                      write_recipe: Callable[[Path], Any] | None = None) -> LatencyTableRunResult:
    """Time one block of ``model_name``'s shape for each kept structure on a grid (MLP widths, kept heads, Q/K and
    V head dims) on the profile's backend, plus the dense model whole, into the table ``out``, as
    ``edgeprune latency-table`` does (saved after every entry: the same call resumes an interrupted build; then
    a few pruned-shape models are predicted and timed whole: the self-check).

    Args:
        device: the device profile (a shipped name, a ``.toml`` path or a ``DeviceProfile``).
        batch, threads, precision, backend, warmup, iterations, max_seconds, statistic, interleave, clock,
            repeats, spread, retries: the :class:`~edgeprune.latency.build.BuildOptions` (None: the profile's, or
            the spread check's defaults).
        grid: further limits of the grid (``edgeprune.latency.grid.make_grid``: ``max_mlp``, ...; Python only).
        tokens: a token axis ("150,100" or counts): the dense sub-blocks also timed at these token counts.
        force: replace an existing table of another key; keep a table whose self-check misses (unverified).
        write_recipe: ``(table_path)`` writes the table's recipe beside it (the CLI's) or None.

    Raises:
        UserError: no model, a bad setting or profile, ``out`` a folder or unwritable, an existing table of another
            key, a model without weights (``random_init``); RuntimeFault: the backend cannot time here;
            ``SelfCheckFailed``: the self-check missed (without ``force``).
    """
    if model_name is None:
        raise SettingError("{model_name} is required (the dense model whose blocks are timed)")
    opts = _options(batch, threads, precision, backend, warmup, iterations, max_seconds, statistic, interleave,
                    repeats, spread, retries, clock, force, grid, tokens)
    profile = load_profile(device)
    settings_for(profile, opts, model_name)  # bad batch / threads / backend, or the backend absent: before any work
    out_path = Path(out)
    if out_path.is_dir():
        raise UserError(f"-o {out} is a folder; give the table's file name (e.g. {out_path / 'table.json'})")
    check_writable(out_path.parent)
    try:
        model, _rec, _spec = load_model(None, model_name, checkpoint, random_init, num_classes, img_size, model_kwargs)
    except MissingWeightsError:  # issue 41: not "--checkpoint": the timings do not depend on the weights
        raise UserError(f"{model_name} has no weights here; a latency table times the model's shapes, not its "
                        "weights: add --random-init (or --checkpoint PATH)") from None
    anatomy = find_anatomy(model.eval())
    t0 = time.perf_counter()
    table = build_table(anatomy, profile, opts, out_path, show_progress=not quiet)
    if write_recipe is not None:
        write_recipe(out_path)
    _report(table, str(out), time.perf_counter() - t0, echo)
    return LatencyTableRunResult(out=out_path, table=table)


def _report(table: LatencyTable, out: str, seconds: float, echo: Echo) -> None:
    """The build's lines: the entries, the key, the time, the table's block formula; the self-check's predicted /
    measured whole models; a warning (stderr) for a table kept unverified."""
    k = table.key
    n = (len(table.measured["mlp"]) + len(table.measured["attn"]) + sum(bool(table.measured.get(w)) for w in WHOLE)
         + sum(len(table.measured.get(w, [])) for w in ("tokens_mlp", "tokens_attn")))
    echo(f"{out}: {n} entries on {k['device_name']} ({k['backend']} {k['backend_version']}, "
         f"batch {k['batch']}, {k['precision']}, threads {k['threads'] or 'default'}) in "
         f"{seconds:.0f} s; dense model {table.dense_model_ms:.2f} ms, "
         f"blocks {k['depth']} x ({table.block_scale:.3f} x {table.block_ms(table.dense_dims()):.2f} + "
         f"{table.block_overhead_ms:.2f}) ms, outside the blocks {table.fixed_ms:.2f} ms")
    chk = table.meta.get("self_check") or {}
    echo("self-check (predicted / measured whole): " + ", ".join(
        f"{m['name']} {m['predicted_ms']:.2f}/{m['measured_ms']:.2f} ms ({100 * m['error']:+.1f}%)"
        for m in chk.get("models", [])))
    if table.unverified:
        echo(f"warning: the self-check missed ({table.unverified}); kept unverified (--force): "
             "prune --latency will say its prediction is unverified", err=True)


__all__ = ["LatencyTableRunResult", "latency_table_run"]
