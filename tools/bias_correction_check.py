#!/usr/bin/env python
"""Top-1 of one pruned model with and without output bias correction, for several image counts.

Prunes a labeled zoo model once (``--flops F``, ``bias_correction_images=0``), then for each N in
``--ks`` applies the output bias correction measured on the first N calibration images
(``edgeprune.solve.output_bias``: ``c* = mean(y_dense - y_pruned)``) and reports top-1 on the
held-out images. The pruned and dense models run once over the evaluation images; the corrected
logits are ``y_pruned + c*`` (what folding ``c*`` into the classifier bias gives). Calibration and
evaluation images are disjoint (train / test split).

    python tools/bias_correction_check.py --model dinov2-s14-fmnist --flops 0.5 --seed 1 --eval-size 4000 --ks 32,64,256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    import edgeprune

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dinov2-s14-fmnist")
    p.add_argument("--flops", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calib-size", type=int, default=None)
    p.add_argument("--eval-size", type=int, default=1000)
    p.add_argument("--ks", default="32,64,256", help="calibration images of the correction")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = edgeprune.get_model_spec(args.model)
    dense = spec.create().eval()
    n = args.calib_size or spec.default_calib_size
    calib = spec.calibration_source(n, seed=args.seed)
    t0 = time.perf_counter()
    res = edgeprune.prune(dense, calib, flops=args.flops, spec=spec, bias_correction_images=0)
    pruned = res.model.eval()
    print(f"pruned --flops {args.flops} (seed {args.seed}, {n} calibration images) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    ks = [min(int(k), n) for k in args.ks.split(",")]
    # one pass of each model over the first max(ks) images; c*(k) from prefix sums of the difference
    diffs = []
    with torch.no_grad():
        for x, _ in calib.batches(32):
            if sum(len(d) for d in diffs) >= max(ks):
                break
            diffs.append(dense(x).double() - pruned(x).double())
    cum = torch.cat(diffs).cumsum(0)
    shifts = {k: (cum[k - 1] / k).float() for k in ks}
    ev = spec.eval_source(None, n=args.eval_size)
    hits = {"dense": 0, "pruned": 0, **{k: 0 for k in ks}}
    total = 0
    with torch.no_grad():
        for x, y in ev.batches(50):
            yd, yp = dense(x), pruned(x)
            hits["dense"] += int((yd.argmax(1) == y).sum())
            hits["pruned"] += int((yp.argmax(1) == y).sum())
            for k, c in shifts.items():
                hits[k] += int(((yp + c).argmax(1) == y).sum())
            total += len(y)
    print(f"{args.model}, FLOPs x{args.flops}, seed {args.seed}, {total} test images ({ev.description})")
    print(f"dense top-1 {hits['dense'] / total * 100:.2f}%; pruned {hits['pruned'] / total * 100:.2f}%")
    for k in ks:
        print(f"bias correction on {k} calibration images: top-1 {hits[k] / total * 100:.2f}% "
              f"({(hits[k] - hits['pruned']) / total * 100:+.2f} points), |c*| = {float(shifts[k].norm()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
