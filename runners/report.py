"""Benchmark reports: JSON, markdown tables, and a latency-vs-batch-size plot (matplotlib, Agg).

All writers are atomic (temporary file in the destination directory, then ``os.replace``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from edgeprune.atomic import atomic_path, atomic_write_text
from runners.base import BenchResult
from runners.compare import PairResult


def _as_dict(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (list, tuple)):
        return [_as_dict(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _as_dict(v) for k, v in obj.items()}
    return obj


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def to_json(results: Any, path: str | os.PathLike | None = None, *, extra: dict | None = None) -> str:
    """Serialize BenchResults / PairResults (or lists/dicts of them) as JSON.

    Args:
        results: what to write.
        path: if given, written there atomically.
        extra: top-level fields to add (command line, host, ...); with ``extra`` the document is
            ``{**extra, "results": ...}``.

    Returns:
        The JSON text.
    """
    doc = _as_dict(results)
    if extra is not None:
        doc = {**extra, "results": doc}
    text = json.dumps(doc, indent=2, default=_json_default, allow_nan=True) + "\n"
    if path is not None:
        atomic_write_text(path, text)
    return text


def _fmt(v: float | None, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}"


def markdown_table(results: Iterable[BenchResult]) -> str:
    """One row per (model, batch size): p50/p90/p99, mean +- std (ms), images/s, peak MiB."""
    rows = [
        "| model | backend | device | batch | p50 ms | p90 ms | p99 ms | mean ± std ms | img/s | peak MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lat = r.latency_ms
        rows.append(
            f"| {r.model} | {r.backend} | {r.device} | {r.batch_size} | {_fmt(lat['p50'])} | "
            f"{_fmt(lat['p90'])} | {_fmt(lat['p99'])} | {_fmt(lat['mean'])} ± {_fmt(lat['std'])} | "
            f"{_fmt(r.throughput, 1)} | {_fmt(r.peak_memory_mb, 0)} |"
        )
    return "\n".join(rows)


def pair_markdown_table(pairs: Iterable[PairResult]) -> str:
    """One row per batch size: both p50s and throughputs, the per-pair latency ratio A/B
    (median, p10-p90) and the throughput ratio B/A."""
    pairs = list(pairs)
    rows = []
    if pairs:
        rows.append(f"A = {pairs[0].a.model}, B = {pairs[0].b.model} "
                    f"({pairs[0].a.backend} / {pairs[0].b.backend}, interleaved)\n")
    rows += [
        "| batch | A p50 ms | B p50 ms | A p90 ms | B p90 ms | A img/s | B img/s | "
        "latency A/B median [p10–p90] | throughput B/A |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in pairs:
        lr = p.latency_ratio
        rows.append(
            f"| {p.batch_size} | {_fmt(p.a.latency_ms['p50'])} | {_fmt(p.b.latency_ms['p50'])} | "
            f"{_fmt(p.a.latency_ms['p90'])} | {_fmt(p.b.latency_ms['p90'])} | "
            f"{_fmt(p.a.throughput, 1)} | {_fmt(p.b.throughput, 1)} | "
            f"{_fmt(lr['median'], 3)} [{_fmt(lr['p10'], 3)}–{_fmt(lr['p90'], 3)}] | "
            f"{_fmt(p.throughput_ratio, 3)} |"
        )
    return "\n".join(rows)


def _batch_axis(ax, batch_sizes: Sequence[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(list(batch_sizes))
    ax.set_xticklabels([str(b) for b in batch_sizes])
    ax.xaxis.set_minor_locator(NullLocator())


def plot_latency(results: Sequence[BenchResult] | Sequence[PairResult],
                 path: str | os.PathLike, title: str | None = None) -> Path:
    """Latency (p50, shaded to p90) vs batch size per model; for pairs also the A/B ratio.

    Uses matplotlib's Agg backend (no display needed); written atomically.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    items = list(results)
    pairs = [r for r in items if isinstance(r, PairResult)]
    singles: list[BenchResult] = [r for r in items if isinstance(r, BenchResult)]
    for p in pairs:
        singles += [p.a, p.b]
    series: dict[str, list[BenchResult]] = {}
    for r in singles:
        series.setdefault(f"{r.model} ({r.backend})", []).append(r)

    ncols = 2 if pairs else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.2), squeeze=False)
    ax = axes[0][0]
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: r.batch_size)
        bs = [r.batch_size for r in rs]
        p50 = [r.latency_ms["p50"] for r in rs]
        p90 = [r.latency_ms["p90"] for r in rs]
        line, = ax.plot(bs, p50, marker="o", label=name)
        ax.fill_between(bs, p50, p90, color=line.get_color(), alpha=0.2)
    all_bs = sorted({r.batch_size for r in singles})
    ax.set_xlabel("batch size")
    ax.set_ylabel("latency ms (p50, band to p90)")
    _batch_axis(ax, all_bs)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if pairs:
        ax2 = axes[0][1]
        ps = sorted(pairs, key=lambda p: p.batch_size)
        bs = [p.batch_size for p in ps]
        med = [p.latency_ratio["median"] for p in ps]
        lo = [p.latency_ratio["median"] - p.latency_ratio["p10"] for p in ps]
        hi = [p.latency_ratio["p90"] - p.latency_ratio["median"] for p in ps]
        ax2.errorbar(bs, med, yerr=[lo, hi], marker="o", capsize=4)
        ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
        _batch_axis(ax2, bs)
        ax2.set_xlabel("batch size")
        ax2.set_ylabel("latency A/B per pair (median, p10–p90)")
        ax2.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    try:
        with atomic_path(out, suffix=out.suffix or ".png") as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
    return out
