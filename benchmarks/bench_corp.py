"""CORP benchmark: quality, params, FLOPs and pruning cost on the zoo models.

    python benchmarks/bench_corp.py --model fmnist-vit --json runs/bench_corp_fmnist.json
    python benchmarks/bench_corp.py --model dinov2-s14 --calib-size 64 --json runs/bench_corp_dinov2.json

For each sparsity (0.3, 0.5, 0.7) and target (mlp, attn, both), with and without compensation:
top-1 on the Fashion-MNIST test split (fmnist-vit, calibration on train images) or saliency /
feature fidelity to the dense model on foolbox's ImageNet photos (dinov2-s14, calibration on
augmented crops of scikit-image photos), params and FLOPs. Per configuration also the pruning
wall time next to the time of one dense forward pass over the same calibration set (measured
right before, same threads), and the peak RSS during pruning. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402

from edgeprune.api import prune  # noqa: E402
from edgeprune.evaluate import evaluate  # noqa: E402
from runners.base import peak_rss_mb, reset_peak_rss  # noqa: E402


@torch.no_grad()
def dense_pass_seconds(model, source, batch_size: int) -> float:
    t0 = time.perf_counter()
    for x, _ in source.batches(batch_size):
        model(x)
    return time.perf_counter() - t0


def fmt_quality(m: dict, kind: str) -> str:
    if kind == "saliency":
        return f"{m['mae']:.4f} | {m['pearson']:.4f} | {m['iou@0.5']:.4f} | {m['feature_cosine']:.4f}"
    return f"{m['top1'] * 100:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fmnist-vit")
    ap.add_argument("--sparsities", default="0.3,0.5,0.7")
    ap.add_argument("--targets", default="mlp,attn,both")
    ap.add_argument("--calib-size", type=int, default=None, help="default: fmnist-vit 512, dinov2-s14 64")
    ap.add_argument("--eval-size", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    spec, dense = common.model(args.model)
    n = args.calib_size or {"fmnist-vit": 512, "dinov2-s14": 64}.get(args.model, 256)
    calib = spec.calibration_source(n, seed=0)
    ev = spec.eval_source(n=args.eval_size)
    rows = []
    dense_q = None
    if spec.output_kind != "saliency":
        dense_q = evaluate(spec, dense, ev)
    print(f"# {args.model}: calibration {calib.description}; evaluation {ev.description}; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    for s in common.floats(args.sparsities):
        for target in common.names(args.targets):
            for comp in (False, True):
                fwd = dense_pass_seconds(dense, calib, args.batch_size)
                reset_peak_rss()
                t0 = time.perf_counter()
                res = prune(dense, calib, target=target, sparsity=s, compensation=comp,
                            batch_size=args.batch_size, spec=spec)
                wall = time.perf_counter() - t0
                peak = peak_rss_mb()
                q = evaluate(spec, res.model, ev, dense=dense)
                row = {"sparsity": s, "target": target, "compensation": comp, "quality": q,
                       "params": res.record["params"], "dense_params": res.record["dense_params"],
                       "flops": res.record["flops"], "dense_flops": res.record["dense_flops"],
                       "prune_s": wall, "dense_pass_s": fwd, "peak_rss_mb": peak,
                       "calibration_s": res.record["timing"]["calibration_s"],
                       "solve_s": res.record["timing"]["solve_s"]}
                rows.append(row)
                print(f"  s={s} {target} comp={comp}: {fmt_quality(q, spec.output_kind)} "
                      f"prune {wall:.1f}s (dense pass {fwd:.1f}s)", flush=True)

    if spec.output_kind == "saliency":
        head = "| sparsity | target | method | MAE | Pearson | IoU@0.5 | feat cos | params (M) | GFLOPs | prune s | dense pass s | ratio | peak RSS MB |"
    else:
        head = (f"| sparsity | target | method | top-1 % (dense {dense_q['top1'] * 100:.2f}) | params (M) | GFLOPs | "
                "prune s | dense pass s | ratio | peak RSS MB |")
    print()
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        method = "CORP" if r["compensation"] else "uncompensated"
        print(f"| {r['sparsity']} | {r['target']} | {method} | {fmt_quality(r['quality'], spec.output_kind)} | "
              f"{r['params'] / 1e6:.3f} | {r['flops'] / 1e9:.3f} | {r['prune_s']:.1f} | {r['dense_pass_s']:.1f} | "
              f"{r['prune_s'] / r['dense_pass_s']:.2f} | {r['peak_rss_mb']:.0f} |")
    print(f"\ndense: {rows[0]['dense_params'] / 1e6:.3f} M params, {rows[0]['dense_flops'] / 1e9:.3f} GFLOPs")
    if args.json:
        common.write_json(args.json, {"model": args.model, "dense": dense_q, "rows": rows,
                                      "calibration": calib.description, "evaluation": ev.description}, "bench_corp")


if __name__ == "__main__":
    main()
