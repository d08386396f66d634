#!/usr/bin/env python
"""Which clock a busy machine disturbs least: wall time vs this thread's CPU time around the same runs (issue 52).

A dense model and a pruned one (``--model``, random init: only the shapes matter; the pruned one keeps
``--keep`` of every block's heads' Q/K and V dims and MLP width) run interleaved on ONNX Runtime CPU with one
thread (A B A B ..., ``--pairs`` timed pairs after ``--warmup``), first on the machine as it is, then with
``--busy`` CPU-bound processes (``python -c "while True: pass"``) beside it. Every run is timed with both clocks
at once -- ``time.perf_counter`` (wall) and ``time.thread_time`` (the calling thread's CPU time: with one intra-op
thread ONNX Runtime computes on the caller) -- so the two columns describe the very same runs. Per condition and
clock: the dense model's p50, the median per-pair ratio pruned / dense and its p10-p90 spread; the clock whose
loaded ratio stays nearest the quiet one is the one a measurement on a shared box should use.

Examples::

    python benchmarks/load_clock.py                                   # deit_small, batch 1, busy 0 and 4
    python benchmarks/load_clock.py --model vit_tiny_patch16_224 --pairs 20 --busy 0,2 --json /tmp/c.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from edgeprune.anatomy import find_anatomy  # noqa: E402
from edgeprune.latency import load  # noqa: E402
from edgeprune.surgery import apply_structure  # noqa: E402
from exporters.onnx import export_onnx  # noqa: E402
from runners.compare import ratio_stats  # noqa: E402


def pruned_copy(model: torch.nn.Module, keep: float) -> torch.nn.Module:
    """A copy of ``model`` with every block at ``keep`` of its Q/K and V head dims and MLP width (multiples of 8,
    all heads; seeded random weights in the resized modules)."""
    import copy

    an = find_anatomy(model)
    m = copy.deepcopy(model)
    torch.manual_seed(0)
    r8 = lambda x: max(8, 8 * round(x / 8))  # noqa: E731
    apply_structure(m, [{"num_heads": b.num_heads, "head_dim": b.head_dim, "qk_dim": r8(b.head_dim * keep),
                         "v_dim": r8(b.head_dim * keep), "mlp_hidden": r8(b.mlp_hidden * keep)} for b in an.blocks])
    return m.eval()


def session(path: Path):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads, o.inter_op_num_threads = 1, 1
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])


def timed(sess, x: np.ndarray) -> tuple[float, float]:
    """(wall ms, thread CPU ms) of one run."""
    w0, c0 = time.perf_counter(), time.thread_time()
    sess.run(None, {"input": x})
    return (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3


def condition(dense, pruned, x: np.ndarray, pairs: int, warmup: int, busy: int) -> dict:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        if busy:
            time.sleep(3.0)  # a benchmark, not a test: let the load average see the spinners
        before = load.snapshot()
        for _ in range(warmup):
            timed(dense, x), timed(pruned, x)
        runs = [(timed(dense, x), timed(pruned, x)) for _ in range(pairs)]
        after = load.snapshot()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out: dict = {"busy": busy, "load_before": before, "load_after": after}
    for i, clock in enumerate(("wall", "cpu")):
        a = [r[0][i] for r in runs]
        b = [r[1][i] for r in runs]
        ratio = ratio_stats(b, a)  # pruned / dense per pair
        out[clock] = {"dense_p50_ms": statistics.median(a), "pruned_p50_ms": statistics.median(b),
                      "ratio_median": ratio["median"], "ratio_p10": ratio["p10"], "ratio_p90": ratio["p90"],
                      "dense_spread": load.spread_of(a)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deit_small_patch16_224")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--busy", type=common.ints, default=[0, 4], help="comma-separated spinner counts [0,4]")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    spec, model = common.model(a.model, random_init=True)
    model.eval()
    pruned = pruned_copy(model, a.keep)
    shape = tuple(spec.input_size)
    x = np.random.default_rng(0).standard_normal((a.batch, *shape), dtype=np.float32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [export_onnx(m, Path(tmp) / f"{n}.onnx", shape, dynamic_batch=False, batch_size=a.batch)
                 for n, m in (("dense", model), ("pruned", pruned))]
        dense, pr = session(paths[0]), session(paths[1])
        for busy in a.busy:
            common.log(f"busy {busy}: {a.pairs} pairs")
            rows.append(condition(dense, pr, x, a.pairs, a.warmup, busy))
    print(f"{a.model} batch {a.batch}, pruned to {a.keep} of every dim, ONNX Runtime CPU 1 thread, {a.pairs} "
          f"interleaved pairs; {common.machine()}")
    print("| busy | load 1m | clock | dense p50 ms | pruned/dense median | p10-p90 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for clock in ("wall", "cpu"):
            c = r[clock]
            print(f"| {r['busy']} | {r['load_after']['load_1m']} | {clock} | {c['dense_p50_ms']:.2f} | "
                  f"{c['ratio_median']:.3f} | {c['ratio_p10']:.3f}-{c['ratio_p90']:.3f} |")
    if a.json:
        common.write_json(a.json, {"model": a.model, "batch": a.batch, "keep": a.keep, "pairs": a.pairs,
                                   "rows": rows}, "benchmarks/load_clock.py")
    return 0


if __name__ == "__main__":
    common.run_main(main)
