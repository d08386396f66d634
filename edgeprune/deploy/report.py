"""``OUT/report.json`` and ``OUT/report.md`` of ``edgeprune deploy`` (issue 42).

Every number is read from the stage outputs (nothing re-measured): params, FLOPs and the held-out
quality of the dense and the pruned model from the run's record (``OUT/run/run.json``), the
latency predicted by the table and measured by the prune (its ``latency_check``, a ``--latency``
budget), the ONNX check (``OUT/verify.json``), the quantized model's top-1 / agreement with the
float model and its size (``OUT/quantize.json``), the bench of the deployed vs the dense model
(``OUT/bench.json``, ``bench.md``). A deploy that stopped before ``build`` (no TensorRT here) lists
the stages left to do on the device with the ``edgeprune build`` / ``bench`` line of each
(``on_device``; the same lines deploy printed). Both files are written atomically, and only when
they change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgeprune.artifact import read_record
from edgeprune.deploy.heal import heal_markdown, heal_summary
from edgeprune.deploy.plot import write_plot
from edgeprune.deploy.state import STAGES, DeployState, write_if_changed


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except ValueError:
        return None


#: the quality figures a run's evaluation may hold: a classifier's, then a network's with dense outputs (issue 55:
#: relative squared error and PSNR against the dense network's outputs, IoU@0.5 of a saliency map)
QUALITY = ("top1", "agreement", "rel_error", "psnr_db", "iou@0.5")
_HEADS = {"top1": "top-1 %", "agreement": "agreement %", "rel_error": "rel. error vs dense",
          "psnr_db": "PSNR dB", "iou@0.5": "IoU@0.5"}


def _table(out: Path) -> dict[str, dict[str, Any]]:
    """``{"dense": row, "pruned": row}``: params, flops, the quality figures (:data:`QUALITY`), predicted /
    measured ms; the
    pruned row is the healed run's where there is one (its record keeps the prune's numbers), with
    ``"unhealed"`` (the quality before healing) beside it."""
    run = out / "healed" if (out / "healed" / "run.json").is_file() else out / "run"
    if not (run / "run.json").is_file():
        return {}
    rec = read_record(run)
    ev = rec.get("evaluation") or {}
    dense = {"params": rec["dense_params"], "flops": rec["dense_flops"]}
    pruned = {"params": rec["params"], "flops": rec["flops"]}
    for row, m in ((dense, ev.get("dense") or {}), (pruned, ev.get("pruned") or {})):
        row.update({k: m[k] for k in QUALITY if m.get(k) is not None})
    chk = rec.get("latency_check")
    if chk:
        dense["predicted_ms"] = chk["predicted_ms"] / chk["predicted_ratio"] if chk.get("predicted_ratio") else None
        pruned["predicted_ms"] = chk["predicted_ms"]
        measured = chk.get("measured") or {}
        dense["measured_ms"], pruned["measured_ms"] = measured.get("dense_ms"), measured.get("pruned_ms")
    table = {"dense": dense, "pruned": pruned}
    before = ev.get("before_healing")
    if before:
        table["unhealed"] = {"params": rec["params"], "flops": rec["flops"],
                             **{k: before[k] for k in QUALITY if before.get(k) is not None}}
    return table


def _quantized(out: Path) -> dict[str, Any] | None:
    q = _json(out / "quantize.json")
    if q is None:
        return None
    keys = ("output", "n", "top1", "top1_float", "drop_points", "agreement", "agreement_metric", "size_bytes",
            "float_size_bytes")
    return {"precision": (q.get("config") or {}).get("precision"), **{k: q.get(k) for k in keys},
            "output": Path(str(q.get("output"))).name}


def _memory(bench: dict[str, Any] | None) -> dict[str, Any] | None:
    """``{"deployed": m, "dense": m}``: each model's weights and own peak memory, from the bench's
    per-model probes (each model in its own process; :mod:`runners.memory`)."""
    mem = (bench or {}).get("memory")
    if not mem:
        return None
    targets = bench.get("targets") or {}  # type: ignore[union-attr]
    return {role: {"model": Path(str((targets.get(k) or {}).get("target", "?"))).name, **mem[k]}
            for role, k in (("deployed", "a"), ("dense", "b")) if k in mem}


def report_data(out: Path, state: DeployState, o: dict[str, Any]) -> dict[str, Any]:
    """The content of ``report.json`` (see the module)."""
    keys = ("status", "what", "why", "redone", "command", "seconds")
    stages = [{"stage": n, **{k: e.get(k) for k in keys if e.get(k) is not None},
               "outputs": sorted(e.get("outputs") or {})}
              for n, e in sorted(state.stages.items(), key=lambda item: STAGES.index(item[0]))]
    verify = _json(out / "verify.json")
    bench = _json(out / "bench.json")
    return {
        "deploy": {"model": o["model_name"], "budget": {o["budget"]: o[o["budget"]]}, "device": o["profile"].name,
                   "backend": o["profile"].backend, "precision": o["precision"]},
        "stages": stages,
        "table": _table(out),
        "verify": None if verify is None else {k: verify.get(k) for k in ("passed", "n", "max_abs_diff", "atol")},
        "heal": heal_summary(out),
        "quantize": _quantized(out),
        "bench": None if bench is None else bench.get("results"),
        "memory": _memory(bench),
        "left": [s["stage"] for s in stages if s.get("status") == "pending"],
        "on_device": [s["command"] for s in stages if s.get("status") == "pending" and s.get("command")],
    }


def _fmt(v: Any, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def report_markdown(data: dict[str, Any], out: Path) -> str:
    """``report.md``: what was deployed, one line per stage, the dense vs pruned table, the rest."""
    d = data["deploy"]
    budget = ", ".join(f"{k} {v}" for k, v in d["budget"].items())
    lines = [f"# edgeprune deploy: {d['model']} on {d['device']} ({d['backend']}, {d['precision']})", "",
             f"Budget: {budget}.", "", "| stage | status | seconds | what |",
             "|---|---|---|---|"]
    for s in data["stages"]:
        what = (s.get("what") or s.get("why") or "") + (f" (redone: {s['redone']})" if s.get("redone") else "")
        lines.append(f"| {s['stage']} | {s.get('status')} | {_fmt(s.get('seconds'), digits=1)} | "
                     f"{what.replace('|', '/')} |")
    t = data["table"]
    if t:
        shown = [k for k in QUALITY if any(k in r for r in t.values())] or ["top1", "agreement"]
        lines += ["", "| model | params | GFLOPs | " + " | ".join(_HEADS[k] for k in shown) + " | predicted ms | "
                  "measured ms |", "|---|---|---|" + "---|" * len(shown) + "---|---|"]
        for name in [n for n in ("dense", "unhealed", "pruned") if n in t]:
            r = t[name]
            quality = " | ".join(_fmt(r.get(k), 100, 2) if k in ("top1", "agreement") else _fmt(r.get(k), digits=4)
                                 for k in shown)
            lines.append(f"| {name} | {r['params']:,} | {_fmt(r['flops'], 1e-9)} | {quality} | "
                         f"{_fmt(r.get('predicted_ms'))} | {_fmt(r.get('measured_ms'))} |")
    v, q = data["verify"], data["quantize"]
    if data.get("heal"):
        lines += ["", heal_markdown(data["heal"])]
    if v:
        lines += ["", f"ONNX vs PyTorch on {v['n']} images: max abs diff {v['max_abs_diff']:.2e} "
                      f"({'passed' if v['passed'] else 'FAILED'})."]
    if q:
        top1 = (f"top-1 {_fmt(q['top1'], 100, 2)}% (float {_fmt(q['top1_float'], 100, 2)}%), "
                if q.get("top1") is not None else "")
        lines += ["", f"Quantized ({q['precision']}, `{q['output']}`): {top1}{q.get('agreement_metric')}"
                      f" with the float model {_fmt(q.get('agreement'), 100, 2)}% on {q.get('n')} held-out images; "
                      f"{_fmt(q.get('size_bytes'), 2**-20, 2)} MiB."]
    if data.get("memory"):
        for role, m in data["memory"].items():
            if "error" in m:
                lines += ["", f"Memory of the {role} model: {m['error']}."]
                continue
            added = m["peak_rss_mib"] - m["baseline_rss_mib"]
            lines += ["", f"Memory of the {role} model (`{m['model']}`, in its own process): weights "
                          f"{_fmt(m.get('weights_mib'), digits=2)} MiB, peak RSS {_fmt(m['peak_rss_mib'], digits=1)} "
                          f"MiB ({_fmt(added, digits=1)} MiB over the interpreter)."]
    if data.get("plot"):
        lines += ["", data["plot"]]
    if (out / "bench.md").is_file():
        lines += ["", "## Bench (deployed vs dense)", "", (out / "bench.md").read_text(encoding="utf-8").strip()]
    if data["left"]:
        lines += ["", f"Left to do on the device: {', '.join(data['left'])}"
                  + (". Run there:" if data.get("on_device") else ".")]
        if data.get("on_device"):
            lines += ["", "```", *data["on_device"], "```"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, state: DeployState, o: dict[str, Any]) -> Path:
    """Write ``report.json`` and ``report.md`` (atomically, when changed); returns ``report.md``'s path."""
    data = report_data(out, state, o)
    data["plot"] = write_plot(out, data)
    write_if_changed(out / "report.json", json.dumps(data, indent=2, default=str) + "\n")
    write_if_changed(out / "report.md", report_markdown(data, out))
    return out / "report.md"


__all__ = ["report_data", "report_markdown", "write_report"]
