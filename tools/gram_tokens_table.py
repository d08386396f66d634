"""Top-1 with MLP statistics from K random tokens per image (``--gram-tokens``) vs all tokens.

    python tools/gram_tokens_table.py --model fmnist-vit --tokens 0,16,32 --runs both@0.5,mlp@0.7 --seeds 0,1,2

For each K (0 = all tokens) and each ``target@sparsity``: CORP over the model's calibration set
(``--calib-size`` images, seeds given) and top-1 / agreement with the dense model on the first
``--eval-size`` held-out images (all by default), one row per (K, run) with the per-seed values
and their mean. Calibration (train split) and evaluation (test split) are disjoint. Prints a
markdown table (docs/prune_cost.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import edgeprune  # noqa: E402
from accuracy_table import evaluate_cached  # noqa: E402  (tools/ is on sys.path when run as a script)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fmnist-vit")
    ap.add_argument("--tokens", default="0,16,32", help="comma list of K (0 = all tokens)")
    ap.add_argument("--runs", default="both@0.5,mlp@0.7", help="comma list of target@sparsity")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--calib-size", type=int, default=None, help="[the model's default]")
    ap.add_argument("--eval-size", type=int, default=None, help="held-out images [all]")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = edgeprune.get_model_spec(args.model)
    batches = list(spec.eval_source(None, n=args.eval_size).batches(250))
    dense = spec.create(pretrained=True).eval()
    dense_eval = evaluate_cached(dense, batches)
    d, dense_preds = dense_eval["top1"], dense_eval["preds"]
    n_eval = sum(len(y) for _, y in batches)
    n_calib = args.calib_size or spec.default_calib_size
    print(f"{args.model}: dense top-1 {d * 100:.2f}% on {n_eval} held-out images; {n_calib} calibration images")
    print("| MLP tokens / image | run | top-1 per seed | mean top-1 | mean agreement | mean prune s |")
    print("|---|---|---|---|---|---|")
    for k in (int(v) for v in args.tokens.split(",")):
        for run in args.runs.split(","):
            target, sp = run.split("@")
            tops, agrees, secs = [], [], []
            for seed in (int(s) for s in args.seeds.split(",")):
                calib = spec.calibration_source(n_calib, seed=seed)
                t0 = time.perf_counter()
                res = edgeprune.prune(spec.create(pretrained=True), calib, spec=spec, target=target,
                                      sparsity=float(sp), gram_tokens=k, progress=False)
                secs.append(time.perf_counter() - t0)
                m = evaluate_cached(res.model.eval(), batches, dense_preds)
                top, agree = m["top1"], m["agreement"]
                tops.append(top)
                agrees.append(agree)
            m = len(tops)
            print(f"| {k or 'all'} | {run} | {' / '.join(f'{t * 100:.2f}' for t in tops)} | "
                  f"{sum(tops) / m * 100:.2f} | {sum(agrees) / m * 100:.2f} | {sum(secs) / m:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
