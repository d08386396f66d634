"""Interleaved timing against a reference, for machines whose load drifts (``--interleave``).

On a machine shared with other work the time of one module drifts with the load by more than the
differences a table must resolve (a 2-core box shared by several jobs: 2x within minutes). As in
the project's pair benchmark (``edgeprune bench A --vs B``), ratios measured side by side are
steady where absolute times are not: each entry runs interleaved with a reference -- the dense
sub-block of its kind (the whole model: against both dense sub-blocks) -- round by round, and
records the median per-round ratio entry / reference (statistic ``min``: fastest entry run /
fastest reference run -- on a box where other jobs preempt a run about every other time, the
median is polluted and the minimum is not). The table's times are
then ``ratio x reference``, the reference being the median of all its per-entry p50s over the
build, so every entry is on one load level. Resume keeps the ratios (``meta["relative"]``).

Issue 40: interleaving is the default, and the spread check of :mod:`edgeprune.latency.measure` applies
to the per-group ratios (an entry whose groups disagree is timed again on the same runners).
Besides the grid, an entry may be the model without its blocks (``outside``: against both
references), the dense block whole and a chain of them (``block``, ``chain``: against both) or a whole
model of pruned shape
(``model``).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch.nn as nn

from edgeprune.latency.measure import (Sample, TimingSettings, Timer, attn_subblock, for_whole, groups, mlp_subblock,
                                       spread, time_once, timed_runs)
from edgeprune.latency.schema import WHOLE_KINDS
from edgeprune.latency.table import LatencyTable
from runners.base import summarize_latencies


def _noise(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


class References:
    """The dense attention and MLP sub-blocks, opened once on ``timer`` for a whole build.

    Args:
        timer: the timing backend.
        anatomy: the model's anatomy (block 0 is the template).
        key: the table's key (dims, tokens).
        s: timing settings; batch: images per batch.
    """

    def __init__(self, timer: Timer, anatomy: Any, key: dict, s: TimingSettings, batch: int) -> None:
        self.timer, self.s = timer, s
        self._tmp = tempfile.TemporaryDirectory(prefix="edgeprune-latency-ref-")
        D, T, tmpl = key["embed_dim"], key["tokens"], anatomy.blocks[0]
        x = _noise((batch, T, D))
        self.runners: dict[str, tuple[Any, np.ndarray]] = {}
        for kind, module in (("attn", attn_subblock(tmpl, D, key["num_heads"], key["head_dim"], key["head_dim"])),
                             ("mlp", mlp_subblock(tmpl, D, key["mlp_hidden"]))):
            work = Path(self._tmp.name) / kind
            work.mkdir()
            r, xr = timer.open(module, x, s, work)
            r.prepare(xr)
            self.runners[kind] = (r, xr)

    def close(self) -> None:
        """Close the reference runners and remove their files."""
        for r, _ in self.runners.values():
            r.close()
        self._tmp.cleanup()

    def _refs(self, kind: str) -> list[tuple[Any, np.ndarray]]:
        return [self.runners[kind]] if kind in ("mlp", "attn") else list(self.runners.values())

    def time_entry(self, kind: str, module: nn.Module, shape: tuple[int, ...]) -> tuple[float, float]:
        """``(ratio, reference ms)`` of :meth:`measure`."""
        got = self.measure(kind, module, shape)
        assert got.reference_ms is not None
        return got.value, got.reference_ms

    def measure(self, kind: str, module: nn.Module, shape: tuple[int, ...]) -> Sample:
        """Time ``module`` (entry ``kind``: ``mlp``, ``attn``, or ``model`` / ``outside`` / ``block``
        against both references) interleaved with its reference(s), with the spread check.

        Returns:
            a :class:`~edgeprune.latency.measure.Sample` whose value is the ratio and
            ``reference_ms`` the reference's time: with statistic ``p50`` the median per-round
            ratio and the reference's median time; with ``min``, fastest entry run / fastest
            reference run and the latter (references summed per round).
        """
        s, refs = (self.s if kind in ("mlp", "attn") else for_whole(self.s)), self._refs(kind)
        with tempfile.TemporaryDirectory(prefix="edgeprune-latency-") as tmp:
            r, x = self.timer.open(module, _noise(shape), s, Path(tmp))
            try:
                r.prepare(x)
                for _ in range(s.warmup):
                    time_once(r, x, s)
                    for q, xq in refs:
                        time_once(q, xq, s)
                best: Sample | None = None
                for attempt in range(1, s.retries + 2):
                    ent_ms, ref_ms = self._rounds(r, x, refs, s)
                    ratio, ref = _ratio(ent_ms, ref_ms, s.statistic)
                    sp = spread([_ratio(e, q, s.statistic)[0] for e, q in
                                 zip(groups(ent_ms, s.repeats), groups(ref_ms, s.repeats))])
                    if best is None or sp < best.spread:
                        best = Sample(ratio, sp, attempt, ref)
                    best.attempts = attempt
                    if sp <= s.spread:
                        break
            finally:
                r.close()
        assert best is not None
        return best

    def _rounds(self, r: Any, x: np.ndarray, refs: list[tuple[Any, np.ndarray]],
                s: TimingSettings) -> tuple[list[float], list[float]]:
        """Timed rounds (entry, then its references): up to ``iterations``, fewer once
        ``max_seconds`` is spent (at least ``min_iterations``). Returns both time lists (ms)."""
        ent_ms: list[float] = []
        ref_ms: list[float] = []

        def one_round() -> float:
            ent_ms.append(time_once(r, x, s))
            ref_ms.append(sum(time_once(q, xq, s) for q, xq in refs))
            return ent_ms[-1] + ref_ms[-1]

        timed_runs(one_round, s)
        return ent_ms, ref_ms


def _ratio(ent_ms: list[float], ref_ms: list[float], statistic: str) -> tuple[float, float]:
    """(entry / reference, reference ms) of paired rounds: ``min``: fastest over fastest; ``p50``: the median
    per-round ratio and the reference's median."""
    if statistic == "min":
        return min(ent_ms) / min(ref_ms), min(ref_ms)
    ratios = [e / ref for e, ref in zip(ent_ms, ref_ms)]
    return summarize_latencies(ratios)["p50"], statistics.median(ref_ms)


def record(t: LatencyTable, kind: str, dims: tuple[int, ...], ratio: float, ref_ms: float) -> None:
    """Store one entry's ratio (and its reference time) in ``t.meta["relative"]``."""
    rel = t.meta.setdefault("relative", {"mlp": {}, "attn": {}, "model": None,
                                         "reference_ms": {"mlp": [], "attn": []}})
    if kind in WHOLE_KINDS:
        rel[kind] = ratio
    else:
        rel[kind][",".join(map(str, dims))] = ratio
        rel["reference_ms"][kind].append(ref_ms)


def apply(t: LatencyTable) -> None:
    """Set the table's times from the recorded ratios: ``ratio x median reference`` (the model, the model
    without blocks and the dense block, ``meta["parts"]``: ``ratio x (attention + MLP reference)``); unmeasured
    entries stay NaN."""
    rel = t.meta.get("relative")
    if not rel:
        return
    ref = {k: statistics.median(v) if v else None for k, v in rel["reference_ms"].items()}
    for w, ratio in rel["mlp"].items():
        t.mlp["ms"][t.mlp["widths"].index(int(w))] = ratio * ref["mlp"]
    for hqv, ratio in rel["attn"].items():
        h, q, v = (int(p) for p in hqv.split(","))
        t.attn["ms"][t.attn["heads"].index(h)][t.attn["qk"].index(q)][t.attn["v"].index(v)] = ratio * ref["attn"]
    if None not in ref.values():
        both = ref["attn"] + ref["mlp"]
        if rel.get("model") is not None:
            t.dense_model_ms = rel["model"] * both
        for kind in WHOLE_KINDS[1:]:
            if rel.get(kind) is not None:
                t.meta.setdefault("parts", {})[f"{kind}_ms"] = rel[kind] * both
    t.meta["reference_ms"] = ref


__all__ = ["References", "apply", "record"]
