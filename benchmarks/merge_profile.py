#!/usr/bin/env python
"""Where a merged model's time goes (issue 56, item 4): ONNX Runtime's per-op profile of the dense model, the widths
alone, the token merge alone and both, at batch 1 and 8 (ORT CPU, the profiler's node events summed per op type).

For one zoo model (default the embedded ``fmnist-vit``) this prunes from the dense model and its calibration set:

* ``widths`` -- ``target="both", sparsity=S`` (``--sparsity``);
* ``tokens`` -- ``target="mlp", sparsity=0, tokens_merge=R`` (``--tokens-merge``: ToMe, R tokens merged per block);
* ``both``   -- widths at S and R tokens merged;

exports each with the project's exporter (dynamic batch), and for each batch size opens one ONNX Runtime session per
model with ``enable_profiling`` (``--threads`` intra-op threads), runs it ``--warmup`` times, then ``--runs`` times
alternating the models (so a load drift hits them alike), and reads the profile: per op type the node time
(``kernel_time`` events, microseconds) per run, and the run's wall time (median, ms). Op types the dense graph does
not have are the merge's own (TopK, GatherElements, ScatterElements, ...); MatMul, Add, Mul and the like mix the
merge's similarity with the blocks' own work, so the table also gives the dense graph's figure beside them.

Example::

    python benchmarks/merge_profile.py --tokens-merge 4 --sparsity 0.5 --batch-sizes 1,8 --runs 200 \\
        --out docs/results/merge_profile.json --doc docs/tokens.md
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402

ROWS = ("dense", "widths", "tokens", "both")
START, END = "<!-- merge-profile:start -->", "<!-- merge-profile:end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module doc); bad values end with argparse's one-line error (exit 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fmnist-vit", help="zoo model [fmnist-vit]")
    ap.add_argument("--tokens-merge", type=int, default=4, help="tokens merged per block (R) [4]")
    ap.add_argument("--sparsity", type=float, default=0.5, help="widths sparsity (--target both) [0.5]")
    ap.add_argument("--batch-sizes", default="1,8", help="batch sizes [1,8]")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads [1]")
    ap.add_argument("--warmup", type=int, default=10, help="untimed runs per model [10]")
    ap.add_argument("--runs", type=int, default=100, help="profiled runs per model [100]")
    ap.add_argument("--calib-size", type=int, default=256, help="calibration images [256]")
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    ap.add_argument("--doc", type=Path, default=None, help="markdown file to write the table into (markers)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.threads < 1 or args.tokens_merge < 1 or not 0 < args.sparsity < 1:
        ap.error("--runs, --threads and --tokens-merge must be >= 1, --warmup >= 0, --sparsity in (0, 1)")
    return args


def models(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(spec, {row: model}) pruned from the dense model on its calibration set."""
    import edgeprune

    spec, dense = common.model(args.model)
    calib = common.calibration(spec, args.calib_size, seed=0)
    kw = {"spec": spec, "progress": False}
    out = {"dense": dense,
           "widths": edgeprune.prune(dense, calib, target="both", sparsity=args.sparsity, **kw).model,
           "tokens": edgeprune.prune(dense, calib, target="mlp", sparsity=0.0, tokens_merge=args.tokens_merge,
                                     **kw).model,
           "both": edgeprune.prune(dense, calib, target="both", sparsity=args.sparsity,
                                   tokens_merge=args.tokens_merge, **kw).model}
    return spec, {k: m.eval() for k, m in out.items()}


def profile(paths: dict[str, Path], x: np.ndarray, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Per row: ``{"wall_ms": median run, "ops_us": {op type: node microseconds per run}}`` (module doc)."""
    import onnxruntime as ort

    sessions = {}
    for row, path in paths.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
        so.enable_profiling, so.profile_file_prefix = True, str(work / f"{row}-b{x.shape[0]}")
        sessions[row] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    name = {row: s.get_inputs()[0].name for row, s in sessions.items()}
    for row, s in sessions.items():
        for _ in range(args.warmup):
            s.run(None, {name[row]: x})
    wall: dict[str, list[float]] = {row: [] for row in sessions}
    for _ in range(args.runs):
        for row, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, {name[row]: x})
            wall[row].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for row, s in sessions.items():
        events = json.loads(Path(s.end_profiling()).read_text())
        ops: dict[str, float] = collections.Counter()
        runs = 0
        for e in events:
            if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time"):
                ops[e["args"]["op_name"]] += float(e["dur"])
            elif e.get("cat") == "Session" and e.get("name") == "model_run":
                runs += 1
        runs = max(runs, 1)  # the warm-up runs are profiled too: every figure is per run over all of them
        out[row] = {"wall_ms": statistics.median(wall[row]), "profiled_runs": runs,
                    "ops_us": {op: us / runs for op, us in sorted(ops.items(), key=lambda kv: -kv[1])}}
    return out


def render(result: dict[str, Any]) -> str:
    """The markdown table: per batch size, the wall time per model and the op types' microseconds per run."""
    lines = []
    for b, rows in result["batches"].items():
        ops = sorted({op for r in rows.values() for op in r["ops_us"]}, key=lambda op: -max(
            r["ops_us"].get(op, 0.0) for r in rows.values()))
        lines += [f"| batch {b} | " + " | ".join(ROWS) + " |", "|---|" + "---:|" * len(ROWS),
                  "| run, median ms | " + " | ".join(f"{rows[r]['wall_ms']:.3f}" for r in ROWS) + " |"]
        for op in ops:
            cells = [f"{rows[r]['ops_us'][op]:.1f}" if op in rows[r]["ops_us"] else "-" for r in ROWS]
            mark = " (not in the dense graph)" if op not in rows["dense"]["ops_us"] else ""
            lines.append(f"| {op}{mark}, us | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    import torch

    from exporters.onnx import export_onnx

    args = parse_args(argv)
    spec, nets = models(args)
    result: dict[str, Any] = {"model": args.model, "tokens_merge": args.tokens_merge, "sparsity": args.sparsity,
                              "threads": args.threads, "runs": args.runs, "batches": {}}
    with tempfile.TemporaryDirectory(prefix="merge-profile-") as tmp:
        work = Path(tmp)
        paths = {row: export_onnx(m, work / f"{row}.onnx", spec.input_size) for row, m in nets.items()}
        for b in common.ints(args.batch_sizes):
            common.log(f"batch {b}: profiling {', '.join(ROWS)} ...")
            x = torch.randn(b, *spec.input_size, generator=torch.Generator().manual_seed(0)).numpy()
            result["batches"][str(b)] = profile(paths, x, args, work)
    table = render(result)
    print(table)
    if args.out is not None:
        common.write_json(args.out, result, "merge_profile")
    if args.doc is not None:
        common.write_between(args.doc, START, END, table)
    return 0


if __name__ == "__main__":
    common.run_main(main)
