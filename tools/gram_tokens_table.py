"""Top-1 with MLP statistics from K random tokens per image (``--gram-tokens``) vs all tokens.

    python tools/gram_tokens_table.py --model fmnist-vit --tokens 0,16,32 --runs both@0.5,mlp@0.7 --seeds 0,1,2

For each K (0 = all tokens, ``auto`` = the default rule, ``mlp_stats.auto_gram_tokens``) and each
``target@sparsity``: CORP over the model's calibration set (``--calib-size`` images, seeds given)
and top-1 / agreement with the dense model / relative squared logit error vs the dense model
(``sum ||z - z_dense||^2 / sum ||z_dense||^2``, far less noisy than top-1) on the first
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fmnist-vit")
    ap.add_argument("--tokens", default="0,16,32", help="comma list of K (0 = all tokens, auto = the default)")
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
    with torch.no_grad():
        dense_logits = [dense(x) for x, _ in batches]
    dense_preds = [z.argmax(-1) for z in dense_logits]
    d = sum(int((p == y).sum()) for p, (_, y) in zip(dense_preds, batches)) / sum(len(y) for _, y in batches)
    n_eval = sum(len(y) for _, y in batches)
    n_calib = args.calib_size or spec.default_calib_size
    print(f"{args.model}: dense top-1 {d * 100:.2f}% on {n_eval} held-out images; {n_calib} calibration images")
    print("| MLP tokens / image | run | top-1 per seed | mean top-1 | mean agreement | logit error per seed | "
          "mean logit error | mean prune s |")
    print("|---|---|---|---|---|---|---|---|")
    for k in (None if v == "auto" else int(v) for v in args.tokens.split(",")):
        for run in args.runs.split(","):
            target, sp = run.split("@")
            tops, agrees, secs, errs = [], [], [], []
            for seed in (int(s) for s in args.seeds.split(",")):
                calib = spec.calibration_source(n_calib, seed=seed)
                t0 = time.perf_counter()
                res = edgeprune.prune(spec.create(pretrained=True), calib, spec=spec, target=target,
                                      sparsity=float(sp), gram_tokens=k, progress=False)
                secs.append(time.perf_counter() - t0)
                used = res.record["settings"].get("gram_tokens_used", k)
                with torch.no_grad():  # one pass: logits -> top-1, agreement and logit error
                    logits = [res.model.eval()(x) for x, _ in batches]
                n_img = sum(len(y) for _, y in batches)
                m = {"top1": sum(int((z.argmax(-1) == y).sum()) for z, (_, y) in zip(logits, batches)) / n_img,
                     "agreement": sum(int((z.argmax(-1) == p).sum()) for z, p in zip(logits, dense_preds)) / n_img}
                num = sum(float((z - zd).double().pow(2).sum()) for z, zd in zip(logits, dense_logits))
                errs.append(num / sum(float(zd.double().pow(2).sum()) for zd in dense_logits))
                top, agree = m["top1"], m["agreement"]
                tops.append(top)
                agrees.append(agree)
            m = len(tops)
            label = "all" if k == 0 else (f"auto ({used or 'all'})" if k is None else k)
            print(f"| {label} | {run} | {' / '.join(f'{t * 100:.2f}' for t in tops)} | "
                  f"{sum(tops) / m * 100:.2f} | {sum(agrees) / m * 100:.2f} | {' / '.join(f'{e:.4g}' for e in errs)} | "
                  f"{sum(errs) / m:.4g} | {sum(secs) / m:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
