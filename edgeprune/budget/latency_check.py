"""Predicted vs measured latency of a latency-budgeted prune (issue 30, item 6).

After ``edgeprune prune --latency``, where the table's backend runs here and the table was
measured on this machine's CPU / GPU, the pruned model is benched against the dense one
*interleaved* (A B A B ..., ``runners.compare.bench_pair``: both see the same load) on the table's
backend, batch size, precision and threads:

* ``onnxruntime``: both models exported to ONNX in a temporary directory
  (``exporters.onnx.export_onnx``, fixed batch) and run with ``runners.onnxruntime_runner.OrtRunner``
  (CPU provider);
* ``torch``: ``runners.torch_runner.TorchRunner`` on the CPU, or on CUDA with CUDA graphs when
  the table was measured on this machine's GPU.

The record gets the predicted and measured latencies (p50, ms per batch), their ratios to the
dense model and whether the measured latency meets the budget; a miss by more than
:data:`MISS_TOLERANCE` is a one-line warning. Elsewhere (another device, a backend that is not
installed, TensorRT) the record says why it was not measured.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from edgeprune.budget.latency import load_table
from edgeprune.errors import UserError
from edgeprune.latency import load
from edgeprune.latency.measure import cpu_name  # the one CPU-name helper (the table's device_name)
from exporters.onnx import export_onnx
from runners.clock import CPU, ThreadClock, clock_for
from runners.compare import bench_pair, median_interval, ratio_decided, ratio_settled
from runners.onnxruntime_runner import OrtRunner
from runners.registry import backend_available
from runners.torch_runner import TorchRunner

#: the measured latency may exceed the budget by this fraction before a warning
MISS_TOLERANCE = 0.10
#: backends this module can bench (TensorRT engines are built on the device itself)
VERIFIABLE = ("onnxruntime", "torch")


def torch_device_for(key: dict) -> str | None:
    """``"cuda"`` / ``"cpu"`` where a torch table's device is this machine's, else None."""
    name = str(key.get("device_name", ""))
    if torch.cuda.is_available() and name == torch.cuda.get_device_name(0):
        return "cuda"
    return "cpu" if name == cpu_name() else None


def why_not_measured(key: dict) -> str | None:
    """None when the table's measurements can be repeated here, else the reason (one phrase)."""
    backend = key.get("backend")
    if backend not in VERIFIABLE:
        return f"the table's backend {backend!r} is benched on its device (edgeprune bench there)"
    missing = backend_available(backend)
    if missing:
        return f"the table's backend {backend} is not available here ({missing})"
    if backend == "torch":
        if torch_device_for(key) is None:
            return f"the table was measured on {key.get('device_name')!r}, not on this machine"
    elif str(key.get("device_name", "")) != cpu_name():
        return f"the table was measured on {key.get('device_name')!r}, this CPU is {cpu_name()!r}"
    return None


def _runners(dense: nn.Module, pruned: nn.Module, key: dict, input_shape, workdir: Path,
             dense_onnx: Path | None = None) -> tuple[Any, Any]:
    """(dense runner, pruned runner) on the table's backend (module doc); ``dense_onnx``: the dense model's
    export of an earlier call (the same model, key and shape), reused."""
    batch, threads = int(key["batch"]), key.get("threads")
    if key["backend"] == "onnxruntime":
        paths = [dense_onnx if n == "dense" and dense_onnx is not None else
                 export_onnx(m, workdir / f"{n}.onnx", input_shape, dynamic_batch=False, batch_size=batch)
                 for n, m in (("dense", dense), ("pruned", pruned))]
        return tuple(OrtRunner(p, providers=("cpu",), threads=threads, label=p.stem) for p in paths)
    device = torch_device_for(key) or "cpu"
    precision = str(key.get("precision", "fp32")) if device == "cuda" else "fp32"
    return tuple(TorchRunner(m, device=device, threads=threads, label=n, input_shape=tuple(input_shape),
                             precision=precision, cuda_graphs=device == "cuda")
                 for n, m in (("dense", dense), ("pruned", pruned)))


def measure_pair(dense: nn.Module, pruned: nn.Module, key: dict, input_shape, iterations: int = 20,
                 warmup: int = 3, dense_onnx: Path | None = None, settle: float | None = None,
                 band: tuple[float, float] | None = None) -> dict[str, Any]:
    """p50 ms per batch of the dense and the pruned model, interleaved, on the table's backend.

    Args:
        dense, pruned: the two models (CPU, eval mode; not modified).
        key: the table's key (backend, batch, threads, precision, device_name).
        input_shape: (C, H, W) of one image.
        iterations: timed pairs (the most, with ``settle``).
        dense_onnx: an ONNX export of ``dense`` at the key's batch (the measure-and-correct loop exports the
            dense model once: issue 40), else exported here.
        settle: stop timing once the 95% interval of the median per-pair ratio is narrower than this
            fraction of it (``runners.compare.ratio_settled``, at least 6 pairs; issue 40: a quiet machine
            needs far fewer than 20 pairs); None times all ``iterations``.
        band: (low, high) pruned / dense ratios of "within the budget's tolerance": timing also stops once the
            verdict is known (``runners.compare.ratio_decided``); None: no such stop.

    Returns:
        ``{"dense_ms", "pruned_ms", "ratio", "pairs", "ratio_interval", "stopped", "load"}``: ratio = pruned /
        dense, the median over the interleaved pairs; ``ratio_interval`` its distribution-free 95% interval
        (``runners.compare.median_interval``); ``pairs`` the pairs timed; ``stopped`` why timing ended
        ("settled", "verdict known" or "pair limit"); ``clock``: ``cpu`` (the calling thread's CPU time, for one
        CPU thread: the clock load disturbs least, ``runners.clock``) or ``wall``; ``load``: the machine's load
        figures before and after (:func:`edgeprune.latency.load.snapshot`), the dense model's own spread and, when
        they mean a loaded machine, why (``loaded``, else None; issue 52).
    """
    rules = {}
    if settle is not None:
        rules["settled"] = ratio_settled(settle)
    if band is not None:
        rules["verdict known"] = ratio_decided(band)
    why: list[str] = []

    def stop(lat_a: Sequence[float], lat_b: Sequence[float]) -> bool:
        why[:] = [name for name, rule in rules.items() if rule(lat_a, lat_b)]
        return bool(why)

    device = "cpu" if key["backend"] == "onnxruntime" else (torch_device_for(key) or "cpu")
    clock = clock_for(device, key.get("threads"))
    before = load.snapshot(clock)
    with tempfile.TemporaryDirectory(prefix="edgeprune-latency-check-") as tmp:
        ra, rb = _runners(dense, pruned, key, input_shape, Path(tmp), dense_onnx)
        try:
            ta, tb = (ThreadClock(ra), ThreadClock(rb)) if clock == CPU else (ra, rb)
            (res,) = bench_pair(ta, tb, [int(key["batch"])], iterations=iterations, warmup=warmup,
                                stop=stop if rules else None)
        finally:
            ra.close()
            rb.close()
    # the ratio: median over the interleaved pairs of pruned / dense (robust to load drifting)
    per_pair = [b / max(a, 1e-12) for a, b in zip(res.latencies_a, res.latencies_b)]
    lo, hi = median_interval(per_pair)
    after, dense_spread = load.snapshot(clock), load.spread_of(res.latencies_a)
    return {"dense_ms": float(res.a.latency_ms["p50"]), "pruned_ms": float(res.b.latency_ms["p50"]),
            "ratio": 1.0 / float(res.latency_ratio["median"]), "pairs": len(per_pair), "ratio_interval": [lo, hi],
            "stopped": why[0] if why else "pair limit", "clock": clock,
            "load": {"before": before, "after": after, "dense_spread": dense_spread,
                     "loaded": load.loaded(load.busiest([before, after]), dense_spread)}}


def latency_check(alloc_latency: dict, measured: dict | None, reason: str | None = None) -> dict[str, Any]:
    """The record's ``latency_check``: predicted (from the allocation report's ``latency`` entry),
    measured (``measured``: :func:`measure_pair`'s dict, or None with ``reason``) and the verdict.

    Fractions are compared as ratios to the dense model (both measured in the same interleaved
    run), absolute budgets in ms."""
    dense_pred, predicted, target = alloc_latency["dense"], alloc_latency["predicted"], alloc_latency["target"]
    out: dict[str, Any] = {"predicted_ms": predicted, "predicted_ratio": predicted / dense_pred,
                           "budget_ms": target, "budget_ratio": target / dense_pred,
                           "dense_predicted_ms": dense_pred, "measured": None, "not_measured": reason,
                           "table_unverified": alloc_latency.get("unverified")}  # issue 40: its self-check missed
    if measured is not None:
        absolute = bool(alloc_latency.get("absolute"))
        got, want = (measured["pruned_ms"], target) if absolute else (measured["ratio"], target / dense_pred)
        out.update(measured=measured, measured_over_predicted=measured["pruned_ms"] / predicted,
                   compared="ms" if absolute else "ratio to dense", miss=got / want - 1.0,
                   meets_budget=got <= want * (1 + MISS_TOLERANCE),
                   loaded=(measured.get("load") or {}).get("loaded"))
    return out


def _interval(measured: dict) -> str:
    """``", 95% x0.498-0.507 over 8 pairs"`` where the measurement has them (records before issue 40's
    settling rule have not)."""
    iv, n = measured.get("ratio_interval"), measured.get("pairs")
    return "" if not iv or n is None else f", 95% x{iv[0]:.3f}-{iv[1]:.3f} over {n} pairs"


def loaded_lines(chk: dict) -> list[str]:
    """One ``warning:`` line when the verdict (the kept round's measurement) or another round's was taken on a
    loaded machine (:func:`edgeprune.latency.load.loaded`), with the load figures; none otherwise."""
    why = chk.get("loaded")
    others = [r["round"] for r in chk.get("rounds", []) if (r.get("measured_ms", {}).get("load") or {}).get("loaded")
              and r["round"] != chk.get("chosen_round", 0)]
    if why:
        return [f"warning: the verdict was taken on a loaded machine ({why}): the measured ratio carries the load's "
                f"noise; measure again on a quiet machine (edgeprune bench) to confirm it"]
    if others:
        return [f"note: round(s) {', '.join(map(str, others))} were measured on a loaded machine; the kept round's "
                f"measurement was not"]
    return []


def latency_report(chk: dict | None) -> list[str]:
    """The lines ``edgeprune prune`` prints about a ``--latency`` prune's ``latency_check`` (none without one):
    predicted vs budget, measured (or why not), each correction round, and a warning when the chosen round still
    misses the budget by more than its tolerance."""
    if not chk:
        return []
    lines = [f"latency: predicted {chk['predicted_ms']:.3f} ms (x{chk['predicted_ratio']:.3f} of dense) for a "
             f"budget of {chk['budget_ms']:.3f} ms (x{chk['budget_ratio']:.3f})"]
    if chk.get("table_unverified"):
        lines.append(f"warning: the prediction is unverified: the latency table's self-check missed "
                     f"({chk['table_unverified']}) and it was kept with --force")
    measured = chk.get("measured")
    if measured is None:
        return lines + [f"latency: predicted only, not measured here: {chk.get('not_measured')}"]
    for r in chk.get("rounds", []):
        lines.append(f"latency round {r['round']}: asked the table for {r['budget_value']:.4g}, predicted "
                     f"{r['predicted']:.4g}, measured {r['measured']:.4g} ({100 * r['miss']:+.1f}% vs the budget)")
    lines.append(f"latency: measured {measured['pruned_ms']:.3f} ms vs dense {measured['dense_ms']:.3f} ms "
                 f"(x{measured['ratio']:.3f}{_interval(measured)}, interleaved; "
                 f"round {chk.get('chosen_round', 0)} kept)")
    lines += loaded_lines(chk)
    tol = chk.get("tolerance", MISS_TOLERANCE)
    if abs(chk["miss"]) > tol:
        lines.append(f"warning: the measured latency misses the budget by {100 * chk['miss']:+.1f}% "
                     f"({chk['compared']}; tolerance {100 * tol:.0f}%; {chk.get('stopped', 'not corrected')})")
    return lines


def record_latency_check(rec: dict, dense: nn.Module, pruned: nn.Module, input_shape,
                         iterations: int = 20, warmup: int = 3, measure: bool = True) -> list[str]:
    """Bench (where possible and ``measure``), put ``rec["latency_check"]`` and return the lines to
    print (a ``warning: ...`` line when the measured latency misses the budget by > 10%).

    Raises:
        UserError: the record has no latency allocation.
    """
    lat = (rec.get("allocation") or {}).get("latency")
    if lat is None:
        raise UserError("no latency allocation in this run record (prune with --latency)")
    lat = {**lat, "absolute": rec["allocation"]["budget"].get("unit") is not None}
    key = load_table(lat["table"]).key
    reason = why_not_measured(key) if measure else "not asked (--no-verify-latency)"
    measured = None
    if reason is None:
        with torch.no_grad():
            measured = measure_pair(dense.eval(), pruned.eval(), key, input_shape, iterations, warmup)
    chk = latency_check(lat, measured, reason)
    chk.update(backend=key.get("backend"), batch=key.get("batch"), threads=key.get("threads"),
               iterations=iterations, interleaved=True)
    rec["latency_check"] = chk
    lines = [f"latency: predicted {chk['predicted_ms']:.3f} ms (x{chk['predicted_ratio']:.3f} of dense) for a "
             f"budget of {chk['budget_ms']:.3f} ms (x{chk['budget_ratio']:.3f})"]
    if measured is None:
        lines.append(f"latency: not measured here: {reason}")
        return lines
    lines.append(f"latency: measured {measured['pruned_ms']:.3f} ms vs dense {measured['dense_ms']:.3f} ms "
                 f"(x{measured['ratio']:.3f}, interleaved on {key['backend']}, batch {key['batch']})")
    lines += loaded_lines(chk)
    if not chk["meets_budget"]:
        lines.append(f"warning: the measured latency misses the budget by {100 * chk['miss']:.0f}% "
                     f"({chk['compared']}; > {100 * MISS_TOLERANCE:.0f}%)")
    return lines
