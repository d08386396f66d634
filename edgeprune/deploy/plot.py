"""``OUT/report.png`` of ``edgeprune deploy``: latency vs accuracy of the dense and the deployed models.

One point per model the bench measured (``OUT/bench.json``): the dense model (``dense.onnx``) and
the deployed one (the pruned ``model.onnx``, or its quantized ``model-int8.onnx`` /
``model-fp16.onnx``, or the engine). x = the bench's p50 latency in ms per batch at the bench's
first batch size; y = top-1 % on the held-out images where they have labels (the run's record for
the dense and the pruned float model, ``OUT/quantize.json`` for a quantized one), else the
agreement % with the dense model (a quantized model without labels has no agreement with the
dense model measured: no point). matplotlib is optional: without it the plot is skipped (one
line). The PNG is rendered in memory and written (atomically) only when its bytes change, so a
rerun that redoes nothing leaves it alone.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from edgeprune.atomic import atomic_write_bytes

PLOT_FILE = "report.png"


def plot_points(data: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{"label", "ms", "value", "metric"}]`` of the report data (:func:`.deploy_report.report_data`):
    the bench's first batch size, dense (B) and deployed (A); models without a y value are left out."""
    bench, table, q = data.get("bench") or [], data.get("table") or {}, data.get("quantize")
    if not bench or not isinstance(bench[0], dict) or "a" not in bench[0] or not table:
        return []
    first = bench[0]
    labels = "top1" if table["dense"].get("top1") is not None else "agreement"
    deployed = str(first["a"].get("model", "deployed"))
    if q and q.get("output") == deployed:
        value = q.get("top1") if labels == "top1" else None  # agreement with the float model, not the dense
        name = f"pruned {q.get('precision')}"
    else:
        value, name = table["pruned"].get(labels), "pruned"
    dense_value = table["dense"].get(labels) if labels == "top1" else 1.0
    points = [{"label": "dense", "ms": first["b"]["latency_ms"]["p50"], "value": dense_value},
              {"label": name, "ms": first["a"]["latency_ms"]["p50"], "value": value}]
    return [{**p, "metric": labels, "batch": first["batch_size"]} for p in points if p["value"] is not None]


def write_plot(out: Path, data: dict[str, Any]) -> str:
    """Write ``OUT/report.png`` when there are points; returns the line report.md shows."""
    points = plot_points(data)
    if not points:
        (out / PLOT_FILE).unlink(missing_ok=True)  # an earlier deploy's: not of these models
        return "No latency/accuracy plot: the bench did not run (or no model has a measured quality)."
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return "Latency/accuracy plot skipped: matplotlib is not installed (pip install matplotlib)."
    d = data["deploy"]
    metric = "top-1 %" if points[0]["metric"] == "top1" else "agreement with the dense model %"
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for p in points:
        ax.scatter([p["ms"]], [100 * p["value"]], s=50)
        ax.annotate(p["label"], (p["ms"], 100 * p["value"]), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel(f"latency ms per batch of {points[0]['batch']} (bench p50, {d['backend']})")
    ax.set_ylabel(metric)
    ax.set_title(f"{d['model']} on {d['device']}")
    ax.grid(True, alpha=0.3)
    ax.margins(0.2)
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    finally:
        plt.close(fig)
    path = out / PLOT_FILE
    png = buf.getvalue()
    if not path.is_file() or path.read_bytes() != png:
        atomic_write_bytes(path, png)
    return f"![latency vs {metric}]({PLOT_FILE})"


__all__ = ["PLOT_FILE", "plot_points", "write_plot"]
