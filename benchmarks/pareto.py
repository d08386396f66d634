#!/usr/bin/env python
"""Top-1 against measured latency: FLOPs-allocated vs latency-allocated prunes (issue 30, item 8).

For one zoo model and a latency table of it, at each budget B (default four) and calibration seed
this prunes twice from the same dense model and calibration set:

* ``flops``   -- ``--flops B``: kept dims allocated by FLOPs (MLP, Q/K, V; ``--target all``),
* ``latency`` -- ``--latency B --latency-table T``: allocated by the table's times (whole heads,
  head dims and MLP widths, on the table's rules),

then measures each pruned model against the dense one *interleaved* on the table's backend,
batch and threads (``edgeprune.budget.latency_check.measure_pair``; ONNX Runtime CPU for a CPU table)
and, when a GPU is present, also with torch CUDA (fp16, CUDA graphs, batch ``--cuda-batch``),
and evaluates top-1 on the model's held-out split (disjoint from calibration).

Writes ``OUT.md`` (a markdown table: budget, allocation, seed, measured latency ratio to dense
per backend, predicted ratio, FLOPs ratio, top-1, agreement with dense) and ``OUT.png`` (top-1 vs
measured ORT latency ratio; matplotlib is optional), with the command and the machine.

Example::

    python benchmarks/pareto.py --model dinov2-s14-fmnist --img-size 112 --table runs/tables/dinov2-112-cpu.json \\
        --budgets 0.8,0.7,0.6,0.5 --seeds 0,1 --eval-size 1000 --out docs/latency_pareto
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402

import torch  # noqa: E402

import edgeprune  # noqa: E402
from edgeprune.budget import Budget, dense_dims, total_cost  # noqa: E402
from edgeprune.budget.latency import load_table  # noqa: E402
from edgeprune.anatomy import find_anatomy  # noqa: E402
from edgeprune.evaluate import evaluate  # noqa: E402
from edgeprune.budget.latency_check import cpu_name, measure_pair  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--img-size", type=int, default=None)
    ap.add_argument("--table", required=True, help="latency table of the model (edgeprune latency-table)")
    ap.add_argument("--budgets", default="0.8,0.7,0.6,0.5")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--calib-size", type=int, default=None)
    ap.add_argument("--eval-size", type=int, default=1000)
    ap.add_argument("--merge", default=None, metavar="J1,J2,...",
                    help="no pruning: one table and PNG from the JSON rows of earlier runs (their --out .json)")
    ap.add_argument("--allocations", default="flops,latency",
                    help="which allocations to prune (e.g. latency alone at the FLOPs rows' measured ratio)")
    ap.add_argument("--iterations", type=int, default=20, help="interleaved pairs per latency measurement")
    ap.add_argument("--cuda-batch", type=int, default=256)
    ap.add_argument("--no-eval", action="store_true", help="latency only (e.g. random-init models)")
    ap.add_argument("--out", default="docs/latency_pareto")
    return ap.parse_args(argv)


def measure(dense, pruned, key: dict, input_shape, iterations: int, cuda_batch: int) -> dict:
    """Measured pruned/dense ratios: the table's backend, and torch CUDA fp16 when a GPU is here."""
    out = {"table": measure_pair(dense, pruned, key, input_shape, iterations)}
    if torch.cuda.is_available():
        gpu = {**key, "backend": "torch", "device_name": torch.cuda.get_device_name(0), "precision": "fp16",
               "batch": cuda_batch, "threads": None}
        out["cuda"] = measure_pair(dense, pruned, gpu, input_shape, iterations)
    return out


def run(args) -> list[dict]:
    spec, dense = common.model(args.model, random_init=args.random_init, img_size=args.img_size)
    key = load_table(args.table).key
    ev = None if args.no_eval else spec.eval_source(None, n=args.eval_size)
    dense_m = None if ev is None else evaluate(spec, dense, ev)
    rows = []
    for seed in common.ints(args.seeds):
        n = args.calib_size or spec.default_calib_size
        calib = spec.calibration_source(n, seed=seed)
        for b in common.floats(args.budgets):
            for kind in args.allocations.split(","):
                kw = {"flops": b} if kind == "flops" else {"latency": b, "latency_table": args.table}
                t0 = time.perf_counter()
                res = edgeprune.prune(dense, calib, target="all", sparsity=None, spec=spec, **kw)
                prune_s = time.perf_counter() - t0
                rec = res.record
                lat = measure(dense, res.model, key, spec.input_size, args.iterations, args.cuda_batch)
                m = None if ev is None else evaluate(spec, res.model, ev, dense=dense)
                predicted = _predicted_ratio(dense, res.model, args.table)
                rows.append({"budget": b, "allocation": kind, "seed": seed, "prune_s": prune_s,
                             "flops_ratio": rec["flops"] / rec["dense_flops"], "predicted_ratio": predicted,
                             "measured": lat, "top1": None if m is None else m.get("top1"),
                             "agreement": None if m is None else m.get("agreement"),
                             "dense_top1": None if dense_m is None else dense_m.get("top1")})
                alloc = (rec.get("allocation") or {}).get("latency") or {}
                if alloc:  # the allocator's own prediction: the two pricings must agree
                    rows[-1]["allocator_predicted_ratio"] = alloc["predicted"] / alloc["dense"]
                rows[-1]["dims"] = [dense_dims(b) for b in find_anatomy(res.model).blocks]
                print(_row_md(rows[-1]), flush=True)
                Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return rows


def _predicted_ratio(dense, model, table_path: str) -> float:
    """The table's predicted latency of ``model`` over the dense model's, priced exactly as the
    allocator prices it (``edgeprune.budget.latency``: a class-token last block computes
    only its query tokens)."""
    pruned_an, dense_an = find_anatomy(model), find_anatomy(dense)
    qt = {b.index: b.query_tokens for b in pruned_an.blocks if b.query_tokens is not None}
    cm = Budget("latency", 0.5, table=table_path).cost_model(dense_an, query_tokens=qt or None)
    ms = total_cost(cm, pruned_an, [dense_dims(b) for b in pruned_an.blocks])
    return ms / cm.table.dense_ms()


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def _row_md(r: dict) -> str:
    cuda = r["measured"].get("cuda")
    return (f"| {r['budget']:g} | {r['allocation']} | {r['seed']} | {r['measured']['table']['ratio']:.3f} | "
            f"{'-' if cuda is None else format(cuda['ratio'], '.3f')} | {r['predicted_ratio']:.3f} | "
            f"{r['flops_ratio']:.3f} | {_pct(r['top1'])} | {_pct(r['agreement'])} | {r['prune_s']:.0f} |")


def write(rows: list[dict], args, key: dict) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = ("| budget | allocation | seed | measured latency x dense (table backend) | measured x dense "
            "(torch CUDA fp16) | predicted x dense | FLOPs x dense | top-1 % | agreement % | prune s |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    text = (f"Command: `{cmd}`\n\nMachine: {cpu_name()} ({os.cpu_count()} cores, {platform.system()}); "
            f"table backend {key.get('backend')} {key.get('backend_version')}, batch {key.get('batch')}, "
            f"threads {key.get('threads')}; CUDA: "
            f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'not measured (no GPU)'}"
            f"; dense top-1 {_pct(rows[0]['dense_top1']) if rows else '-'}%.\n\n" + head + "\n"
            + "\n".join(_row_md(r) for r in rows) + "\n")
    out.with_suffix(".md").write_text(text)
    try:
        import matplotlib  # noqa: PLC0415  (optional dependency)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(5, 4))
    for kind, marker in (("flops", "o"), ("latency", "s")):
        pts = [(r["measured"]["table"]["ratio"], 100 * (r["top1"] or 0)) for r in rows if r["allocation"] == kind]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=f"{kind}-allocated")
    ax.set_xlabel(f"measured latency / dense ({key.get('backend')}, batch {key.get('batch')})")
    ax.set_ylabel("top-1 (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.merge:  # the rows of earlier runs (each its own command), rendered together
        rows = [r for f in args.merge.split(",") for r in json.loads(Path(f).read_text())]
        rows.sort(key=lambda r: (-r["budget"], r["allocation"], r["seed"]))
    else:
        rows = run(args)
    write(rows, args, load_table(args.table).key)
    print(f"wrote {Path(args.out).with_suffix('.md')}")


if __name__ == "__main__":
    main()
