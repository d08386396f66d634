#!/usr/bin/env python
"""Top-1 of embed slicing (issue 33) against width pruning alone, on a labelled zoo model.

Configurations (``--configs``, comma-separated):

* ``embed25``      -- ``--sparsity 0 --embed-sparsity 0.25`` (the slice alone),
* ``embed25refit`` -- the same with ``--embed-refit``,
* ``widths50``     -- ``--flops 0.5`` (widths alone, the defaults),
* ``embed25w50``   -- ``--embed-sparsity 0.25 --flops 0.5`` (slice first, then widths on the sliced model;
  the budget is a fraction of the unsliced dense model),
* ``embed25w50refit`` -- the same with ``--embed-refit``,
* ``last25``       -- ``--sparsity 0.25 --embed-sparsity 0.25 --embed-order last``, ``first25`` the same
  with the default order (the order check at fixed sparsities).

Every run's row (JSON, one line) goes to ``--out`` (appended) and stdout: config, seed, top-1,
agreement with the dense model, FLOPs and params fractions, D', prune seconds.

Example::

    OMP_NUM_THREADS=1 python tools/embed_table.py --model dinov2-s14-fmnist --seeds 0,1 \
        --configs embed25,embed25w50,widths50 --eval-size 1000 --out /tmp/embed_rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import edgeprune  # noqa: E402
from edgeprune.evaluate import evaluate  # noqa: E402
from edgeprune.zoo.registry import get_model_spec  # noqa: E402

CONFIGS = {
    "embed25": dict(sparsity=0.0, embed_sparsity=0.25),
    "embed25refit": dict(sparsity=0.0, embed_sparsity=0.25, embed_refit=True),
    "widths50": dict(flops=0.5),
    "embed25w50": dict(flops=0.5, embed_sparsity=0.25),
    "embed25w50refit": dict(flops=0.5, embed_sparsity=0.25, embed_refit=True),
    "first25": dict(sparsity=0.25, embed_sparsity=0.25),
    "last25": dict(sparsity=0.25, embed_sparsity=0.25, embed_order="last"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dinov2-s14-fmnist")
    ap.add_argument("--img-size", type=int, default=None)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--configs", default="embed25,embed25w50,widths50")
    ap.add_argument("--eval-size", type=int, default=1000)
    ap.add_argument("--calib-size", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="/tmp/embed_rows.jsonl")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense model's evaluation row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = get_model_spec(args.model, img_size=args.img_size) if args.img_size else get_model_spec(args.model)
    dense = spec.create(pretrained=True).eval()
    ev = spec.eval_source(None, n=args.eval_size)
    if not args.no_dense:
        with torch.no_grad():
            dense_m = evaluate(spec, dense, ev)
        emit(args.out, {"config": "dense", "top1": dense_m.get("top1"), "images": args.eval_size})
    for seed in [int(s) for s in args.seeds.split(",")]:
        calib = spec.calibration_source(args.calib_size or spec.default_calib_size, seed=seed)
        for name in args.configs.split(","):
            t0 = time.perf_counter()
            res = edgeprune.prune(dense, calib, spec=spec, **CONFIGS[name])
            seconds = time.perf_counter() - t0
            with torch.no_grad():
                m = evaluate(spec, res.model, ev, dense=dense)
            rec = res.record
            emit(args.out, {"config": name, "seed": seed, "top1": m.get("top1"), "agreement": m.get("agreement"),
                            "flops": rec["flops"] / rec["dense_flops"], "params": rec["params"] / rec["dense_params"],
                            "embed_dim": (rec.get("embed") or {}).get("embed_dim"),
                            "refit": (rec.get("embed") or {}).get("refit"), "seconds": seconds,
                            "img_size": spec.input_size[-1], "calib": len(calib)})


def emit(path: str, row: dict) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
