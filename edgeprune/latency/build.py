"""Build a latency table for one model on one device profile (``edgeprune latency-table``).

:func:`build_table` times every grid entry (:mod:`edgeprune.latency.grid`) with the chosen timing
backend (:mod:`edgeprune.latency.measure`), then the whole dense model, the model without its blocks
and the dense block whole (:mod:`edgeprune.latency.selfcheck`), and writes the
:class:`~edgeprune.latency.table.LatencyTable`; then it predicts and times a few pruned-shape whole
models (the self-check) and marks the table complete only when they agree (issue 40): else
:class:`SelfCheckFailed` (exit 1) names the part that is off, unless ``force`` keeps it unverified.

Defaults for a machine shared with other work (issue 40, item 2): one CPU thread timed by its CPU
time, every entry interleaved with the dense sub-block, and the spread check (``repeats`` groups per
entry, timed again up to ``retries`` times when they disagree by more than ``spread``); the table's
``meta.settings`` says which were used.

Cache key and resume: the table's ``key`` holds the model dims, tokens, batch, precision, backend
and its version, the device name (CPU model or GPU name) and threads. After every measured entry
the partial table is saved atomically to the output (``meta["complete"] = false``); a rerun with
the same key and grid resumes, skipping the entries already measured. An existing output with a
different key (or grid) is refused unless ``force`` (then it is rebuilt from scratch).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import math
from pathlib import Path
from typing import Any

from devices import pruning_rules
from edgeprune._version import __version__
from edgeprune.errors import RuntimeFault, UserError
from edgeprune.latency import load, relative, selfcheck, shape_change
from edgeprune.latency.chains import level_model
from edgeprune.latency.grid import Grid, check_token_counts, make_grid, shape_of
from edgeprune.latency.measure import TimingSettings, Timer, attn_subblock, for_whole, get_timer, mlp_subblock
from edgeprune.latency.relative import References
from runners.clock import clock_for
from edgeprune.latency.schema import CHAIN_KINDS, WHOLE_KINDS
from edgeprune.latency.surface import LEVEL_MODELS
from edgeprune.latency.selfcheck import SelfCheckFailed, conclude, finish
from edgeprune.latency.table import LatencyTable
from edgeprune.latency.token_axis import TOKEN_KINDS, add_axis, counts_of, time_tokens
from edgeprune.latency.timing_checks import PRECISIONS, _check_backend, _check_way, unavailable_message  # noqa: F401
from edgeprune.progress import progress


#: key fields that must match for a partial table to be resumed
KEY_FIELDS = ("embed_dim", "depth", "num_heads", "head_dim", "mlp_hidden", "tokens", "batch", "precision",
              "backend", "backend_version", "device_name", "profile", "threads", "mlp_gated")


#: the way of timing recorded in ``meta["settings"]`` that must match for a resume (issue 41: a resume
#: with other ``--iterations`` / ``--warmup`` / ``--max-seconds`` left the first run's values recorded)
RESUME_SETTINGS = ("statistic", "interleave", "clock", "warmup", "iterations", "max_seconds", "min_iterations",
                   "cuda_graphs", "repeats", "spread", "retries")


@dataclasses.dataclass
class BuildOptions:
    """Settings of one table build (``None``: the profile's).

    Attributes:
        batch: images per timed batch (default: the largest of the profile's bench batch sizes
            up to 8, else its smallest).
        threads: intra-op threads (CPU backends).
        precision: the backend's precision.
        backend: timing backend name (:func:`~edgeprune.latency.measure.list_timers`).
        warmup, iterations: per entry (default: the profile's ``[bench]``); the timed runs of an
            entry also stop after ``max_seconds`` (at least ``min_iterations``).
        statistic: ``p50`` or ``min`` of an entry's timed runs.
        clock: ``wall``, ``cpu`` (thread CPU time; one thread on the CPU only) or ``auto``
            (``cpu`` for one thread on the CPU, else ``wall``).
        interleave: time each entry against the dense sub-block round by round and keep the
            ratios (:mod:`edgeprune.latency.relative`; steady on a machine whose load drifts; default).
        repeats, spread, retries: the spread check (:class:`~edgeprune.latency.measure.TimingSettings`).
        force: replace an existing output built with another key; keep a table whose self-check
            misses (marked unverified) instead of failing.
        grid: keyword limits for :func:`~edgeprune.latency.grid.make_grid` (``max_mlp``, ...).
    """

    batch: int | None = None
    threads: int | None = None
    precision: str | None = None
    backend: str | None = None
    warmup: int | None = None
    iterations: int | None = None
    max_seconds: float | None = None
    statistic: str = "p50"
    interleave: bool = True
    clock: str = "auto"
    repeats: int = 3
    spread: float = 0.05
    retries: int = 2
    force: bool = False
    grid: dict = dataclasses.field(default_factory=dict)


def default_batch(profile: Any) -> int:
    """The profile's table batch: its largest bench batch size <= 8, else its smallest."""
    sizes = sorted(profile.bench.batch_sizes)
    small = [b for b in sizes if b <= 8]
    return small[-1] if small else sizes[0]


def settings_for(profile: Any, opts: BuildOptions, model: str = "M") -> tuple[Timer, TimingSettings, int]:
    """``(timer, settings, batch)`` for ``opts`` on ``profile``, checked before any work.

    Raises:
        UserError: bad batch / threads, unknown backend.
        RuntimeFault: the backend cannot time here (the message says what is missing; for a
            TensorRT profile it names the command to run on the device).
    """
    batch = default_batch(profile) if opts.batch is None else opts.batch
    if batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    if opts.threads is not None and opts.threads < 1:
        raise UserError(f"--threads must be >= 1, got {opts.threads}")
    backend = opts.backend or profile.backend
    timer = get_timer(backend)
    on_gpu = profile.uses_tensorrt
    s = TimingSettings(device="cuda" if on_gpu else "cpu",
                       threads=opts.threads if opts.threads is not None else profile.threads,
                       precision=opts.precision or profile.precision,
                       warmup=profile.bench.warmup if opts.warmup is None else opts.warmup,
                       iterations=profile.bench.iterations if opts.iterations is None else opts.iterations,
                       cuda_graphs=bool(profile.bench.cuda_graphs and on_gpu), profile=profile,
                       max_seconds=opts.max_seconds, statistic=opts.statistic, clock=opts.clock,
                       repeats=opts.repeats, spread=opts.spread, retries=opts.retries)
    if s.clock == "auto":
        s.clock = clock_for(s.device, s.threads)
    _check_way(s)
    if s.iterations < 1 or s.warmup < 0:
        raise UserError(f"need --iterations >= 1 and --warmup >= 0, got {s.iterations}, {s.warmup}")
    _check_backend(profile, backend, timer, s)
    reason = timer.unavailable(s)
    if reason is not None:
        raise RuntimeFault(unavailable_message(profile, backend, reason, model))
    return timer, s, batch


def make_key(shape: dict[str, int], profile: Any, timer: Timer, s: TimingSettings, batch: int) -> dict[str, Any]:
    """The table's cache key (:data:`KEY_FIELDS`)."""
    return {**shape, "batch": batch, "precision": s.precision, "backend": timer.name,
            "backend_version": timer.version(), "device_name": timer.device_name(s),
            "profile": profile.name, "threads": s.threads}


def empty_table(key: dict, rules: dict, grid: Grid, s: TimingSettings, interleave: bool = False) -> LatencyTable:
    """A table with every entry unmeasured (NaN), ``meta["complete"] = False``."""
    nan = math.nan
    attn = [[[nan for _ in grid.v] for _ in grid.qk] for _ in grid.heads]
    t = LatencyTable(
        key=key, rules=rules, mlp={"widths": list(grid.mlp), "ms": [nan] * len(grid.mlp)},
        attn={"heads": list(grid.heads), "qk": list(grid.qk), "v": list(grid.v), "ms": attn},
        fixed_ms=nan, dense_model_ms=nan, block_overhead_ms=nan, block_scale=nan,
        measured={"mlp": [], "attn": [], "model": False, "outside": False, "block": False,
                  **{kind: False for kind in (*CHAIN_KINDS, *LEVEL_MODELS, *shape_change.MODELS)}},
        meta={"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "edgeprune": __version__, "complete": False,
              "settings": {"warmup": s.warmup, "iterations": s.iterations, "statistic": s.statistic,
                           "interleave": interleave, "clock": s.clock,
                           "max_seconds": s.max_seconds, "min_iterations": s.min_iterations,
                           "repeats": s.repeats, "spread": s.spread, "retries": s.retries,
                           "cuda_graphs": s.cuda_graphs, "input": "(batch, tokens, embed_dim) noise"}})
    add_axis(t, grid.tokens)  # the token axis (opt-in): a table without it is written exactly as before
    return t


def start_or_resume(out: Path, key: dict, rules: dict, grid: Grid, s: TimingSettings,
                    opts: BuildOptions) -> LatencyTable:
    """The partial table at ``out`` when its key, rules, grid and way of timing
    (:data:`RESUME_SETTINGS`) match; else a fresh one.

    Raises:
        UserError: ``out`` exists with another key / grid / statistic / interleaving (or is not a
            table) and not ``opts.force``.
    """
    fresh = empty_table(key, rules, grid, s, opts.interleave)
    if not out.exists():
        return fresh
    hint = "(use --force to replace it, or another -o)"
    try:
        old = LatencyTable.load(out, allow_partial=True)
    except UserError as err:
        if opts.force:
            return fresh
        why = str(err) if "--force" in str(err) else f"{err} {hint}"
        raise UserError(f"{out} exists and is not a latency table this command can resume: {why}") from None
    if opts.force:  # replace it; but a table whose self-check failed keeps its entries (--force: keep it)
        return old if _same(old, fresh, key) and _check_failed(old) else fresh
    differ = [k for k in KEY_FIELDS if old.key.get(k) != key.get(k)]
    if differ:
        raise UserError(f"{out} exists with another key ({differ[0]}: {old.key.get(differ[0])!r} there, "
                        f"{key.get(differ[0])!r} now) {hint}")
    for name in RESUME_SETTINGS:  # issue 41: a resume with other timing settings would mix two ways of timing
        was, now = old.meta.get("settings", {}).get(name), fresh.meta["settings"][name]
        if was != now:
            option = f"--{name.replace('_', '-')}"
            raise UserError(f"{out} exists with another {name} ({was} there, {now} now): a resume times the rest "
                            f"of the entries as the first run did (give its {option}) {hint}")
    same_grid = (old.rules == rules and old.mlp["widths"] == fresh.mlp["widths"] and counts_of(old) == counts_of(fresh)
                 and all(old.attn[a] == fresh.attn[a] for a in ("heads", "qk", "v")))
    if not same_grid:
        raise UserError(f"{out} exists with another grid or pruning rules {hint}")
    return old


def _same(old: LatencyTable, fresh: LatencyTable, key: dict) -> bool:
    """``old`` has ``fresh``'s key, way of timing and grid."""
    return (all(old.key.get(k) == key.get(k) for k in KEY_FIELDS) and old.rules == fresh.rules
            and all(old.meta.get("settings", {}).get(n) == fresh.meta["settings"][n] for n in RESUME_SETTINGS)
            and old.mlp["widths"] == fresh.mlp["widths"] and counts_of(old) == counts_of(fresh)
            and all(old.attn[a] == fresh.attn[a] for a in ("heads", "qk", "v")))


def _check_failed(t: LatencyTable) -> bool:
    return (t.meta.get("self_check") or {}).get("passed") is False


#: the entries besides the grid, timed whole (:data:`edgeprune.latency.schema.WHOLE_KINDS`)
WHOLE = WHOLE_KINDS


def _entries(grid: Grid) -> list[tuple[str, tuple[int, ...]]]:
    """Everything to time, in order: MLP widths, attention points, then the whole model, the model
    without its blocks, the dense block and a chain of them."""
    return ([("mlp", (w,)) for w in grid.mlp] + [("attn", p) for p in grid.attn_points()]
            + [(f"tokens_{part}", (n,)) for n in grid.tokens for part in ("mlp", "attn")]
            + [("tokens_merge", (n,)) for n in ([*grid.tokens, grid.full_tokens] if grid.tokens else [])]
            + [(kind, ()) for kind in WHOLE])


def _is_measured(t: LatencyTable, kind: str, dims: tuple[int, ...]) -> bool:
    if kind == "mlp":
        return dims[0] in t.measured["mlp"]
    if kind == "attn":
        return list(dims) in t.measured["attn"]
    if kind in TOKEN_KINDS:
        return dims[0] in t.measured.get(kind, [])
    return bool(t.measured.get(kind))


def _entry_module(t: LatencyTable, kind: str, dims: tuple[int, ...], anatomy: Any,
                  batch: int) -> tuple[Any, tuple[int, ...]]:
    """``(module, input shape)`` of one entry: a sub-block of ``dims`` or the whole model."""
    D, T = t.key["embed_dim"], t.key["tokens"]
    if kind == "mlp":
        return mlp_subblock(anatomy.blocks[0], D, dims[0]), (batch, T, D)
    if kind == "attn":
        return attn_subblock(anatomy.blocks[0], D, *dims), (batch, T, D)
    if kind == "block":
        return copy.deepcopy(anatomy.blocks[0].block).eval(), (batch, T, D)
    if kind in CHAIN_KINDS:
        return selfcheck.chain_module(t, anatomy, kind), (batch, T, D)
    image = (batch, anatomy.in_chans, *anatomy.img_size)
    if kind in LEVEL_MODELS:
        return level_model(t, anatomy, kind), image
    if kind in shape_change.MODELS:
        return selfcheck.pruned_model(anatomy, shape_change.blocks_of(t, kind)), image
    return (selfcheck.outside_model(anatomy) if kind == "outside" else anatomy.model), image


def _record(t: LatencyTable, kind: str, dims: tuple[int, ...], ms: float) -> None:
    """Store one entry's time in ``t`` and mark it measured."""
    if kind == "mlp":
        t.mlp["ms"][t.mlp["widths"].index(dims[0])] = ms
        t.measured["mlp"].append(dims[0])
    elif kind == "attn":
        h, q, v = dims
        t.attn["ms"][t.attn["heads"].index(h)][t.attn["qk"].index(q)][t.attn["v"].index(v)] = ms
        t.measured["attn"].append([h, q, v])
    elif kind == "model":
        t.dense_model_ms = ms
    else:
        t.meta.setdefault("parts", {})[f"{kind}_ms"] = None if math.isnan(ms) else ms
    if kind in WHOLE:
        t.measured[kind] = True


def _time_entry(t: LatencyTable, kind: str, dims: tuple[int, ...], anatomy: Any, timer: Timer,
                s: TimingSettings, batch: int, refs: References | None) -> None:
    """Time one entry (alone, or interleaved with ``refs``) and record it in ``t`` (an entry that needed more
    than one attempt, or whose spread stayed too large, goes to ``meta["spread"]``)."""
    if kind in TOKEN_KINDS:
        got = time_tokens(t, kind, dims[0], anatomy, timer, s, batch, refs)
    else:
        module, shape = _entry_module(t, kind, dims, anatomy, batch)
        got = (timer.measure(module, shape, for_whole(s) if kind in WHOLE else s) if refs is None
               else refs.measure(kind, module, shape))
    if got.attempts > 1 or got.spread > s.spread:
        name = f"{kind} {','.join(map(str, dims))}".strip()
        t.meta.setdefault("spread", {})[name] = {"spread": got.spread, "attempts": got.attempts}
    if kind in TOKEN_KINDS:
        return
    if refs is None:
        _record(t, kind, dims, got.value)
        return
    assert got.reference_ms is not None
    relative.record(t, kind, dims, got.value, got.reference_ms)
    _record(t, kind, dims, float("nan"))
    relative.apply(t)


#: times :func:`finish` may re-time the block chain when its entries disagree (the machine's load moved)
FINISH_ATTEMPTS = 3


def _finish_retimed(t: LatencyTable, grid: Grid, anatomy: Any, timer: Timer, s: TimingSettings, batch: int,
                    refs: References | None, out: Path, force: bool = False) -> LatencyTable:
    """:func:`finish`, re-timing the entries it marks unmeasured (the block chain timed under a load that moved)
    up to :data:`FINISH_ATTEMPTS` times before giving up (the table saved: a rerun times them again); with
    ``force`` the last attempt leaves the chains that still disagree out (``meta.parts.left_out``) and the
    self-check judges the table.

    Raises:
        RuntimeFault: the chain still disagrees after the last attempt (not with ``force``).
    """
    for attempt in range(FINISH_ATTEMPTS):
        try:
            return finish(t, keep_disordered=force and attempt == FINISH_ATTEMPTS - 1)
        except RuntimeFault:
            t.save(out)
            if attempt == FINISH_ATTEMPTS - 1:
                raise
            for kind, dims in [e for e in _entries(grid) if not _is_measured(t, *e)]:
                _time_entry(t, kind, dims, anatomy, timer, s, batch, refs)
                t.save(out)
    raise AssertionError("unreachable")


def build_table(anatomy: Any, profile: Any, opts: BuildOptions, out: str | Path, *,
                show_progress: bool = True) -> LatencyTable:
    """Time the grid of ``anatomy``'s (dense) block shape on ``profile`` and write the table.

    Args:
        anatomy: :class:`~edgeprune.anatomy.ViTAnatomy` of the dense model (its ``model`` is
            timed whole once).
        profile: a :class:`~devices.DeviceProfile` (backend, batch sizes, precision, threads,
            bench settings, pruning rules).
        opts: :class:`BuildOptions`.
        out: the JSON file (saved after every entry; resumed when it holds a partial table of the
            same key).
        show_progress: a progress bar / progress lines (:mod:`edgeprune.progress`).

    Returns:
        The complete :class:`LatencyTable` (also at ``out``).

    Raises:
        UserError: bad options, a pruned / non-uniform model, an existing output of another key
            without ``opts.force``; RuntimeFault: the backend is absent (see :func:`settings_for`).
    """
    out = Path(out)
    timer, s, batch = settings_for(profile, opts)
    shape = shape_of(anatomy)
    rules = pruning_rules(profile, s.precision)  # a GPU profile's head-dim rule is its precision's (issue 40)
    grid_opts = dict(opts.grid)
    if grid_opts.get("tokens"):  # the token axis: checked against the model before any timing
        grid_opts["tokens"] = check_token_counts(list(grid_opts["tokens"]), shape["tokens"],
                                                 int(getattr(anatomy.vit, "num_prefix_tokens", 0)))
    grid = make_grid(shape, rules, **grid_opts)
    t = start_or_resume(out, make_key(shape, profile, timer, s, batch), rules, grid, s, opts)
    todo = [e for e in _entries(grid) if not _is_measured(t, *e)]
    if not todo and t.complete and not (opts.force and _check_failed(t)):
        return t  # nothing to time
    checks = len(selfcheck.FRACTIONS) + (1 if grid.tokens else 0) + 1  # + the dense model timed again
    t.meta.setdefault("load", {})["start"] = load.snapshot(s.clock)  # issue 52: the self-check names a load that moved
    refs = References(timer, anatomy, t.key, s, batch) if opts.interleave else None
    bar = progress(None, desc="latency table", enabled=show_progress, total=len(todo) + checks, unit="entry")
    try:
        for kind, dims in todo:
            bar.set_postfix(entry=f"{kind}{list(dims) if dims else ''}")
            _time_entry(t, kind, dims, anatomy, timer, s, batch, refs)
            t.save(out)
            bar.update(1)
        t = _finish_retimed(t, grid, anatomy, timer, s, batch, refs, out, opts.force)

        def measure(model: Any) -> float:  # a self-check model, timed as the dense one (interleaved: x references)
            bar.set_postfix(entry="self-check")
            image = (batch, anatomy.in_chans, *anatomy.img_size)
            if refs is None:
                return _counted(bar, timer.measure(model, image, for_whole(s)).value)
            both = t.meta["reference_ms"]["attn"] + t.meta["reference_ms"]["mlp"]
            return _counted(bar, refs.measure("model", model, image).value * both)

        check = selfcheck.run_check(t, anatomy, measure)
    finally:
        bar.close()
        if refs is not None:
            refs.close()
    return conclude(t, check, opts.force, out)


def _counted(bar: Any, ms: float) -> float:
    bar.update(1)
    return ms


__all__ = ["BuildOptions", "KEY_FIELDS", "SelfCheckFailed", "build_table", "default_batch", "settings_for"]
