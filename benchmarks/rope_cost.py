#!/usr/bin/env python
"""What the general RoPE compensation costs against the pair form (issue 54, METHODS.md §6): one prune of a random-init
timm rotary ViT (default ``vit_small_patch16_dinov3`` at 224 px) per form, ``--target attn`` at ``--sparsity``, on
``--calib-size`` seeded noise images, timed around ``edgeprune.prune``; prints the seconds and the kept Q/K dim.

A random-init model's logits barely move under attention pruning, so only the time means something here (the
accuracy of the two forms is measured on the trained ``fmnist-dinov3``: ``benchmarks/rope_table.py``).

Example::

    python benchmarks/rope_cost.py --calib-size 32 --sparsity 0.5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module doc); bad values end with argparse's one-line error (exit 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit_small_patch16_dinov3", help="timm rotary ViT [vit_small_patch16_dinov3]")
    ap.add_argument("--img-size", type=int, default=224, help="input side [224]")
    ap.add_argument("--calib-size", type=int, default=32, help="calibration images (seeded noise) [32]")
    ap.add_argument("--sparsity", type=float, default=0.5, help="--target attn sparsity [0.5]")
    ap.add_argument("--forms", default="pair,general", help="compensation forms, in order [pair,general]")
    args = ap.parse_args(argv)
    if args.calib_size < 1 or not 0 < args.sparsity < 1:
        ap.error("--calib-size must be >= 1 and --sparsity in (0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    import edgeprune

    args = parse_args(argv)
    spec, model = common.model(args.model, random_init=True, img_size=args.img_size)
    calib = common.noise(spec, args.calib_size, seed=1)
    common.log(common.machine())
    for form in common.names(args.forms):
        t0 = time.perf_counter()
        res = edgeprune.prune(model, calib, target="attn", sparsity=args.sparsity, rope_compensation=form,
                              progress=False)
        seconds = time.perf_counter() - t0
        print(f"{form}: {seconds:.1f} s, kept qk_dim {res.model.blocks[0].attn.qk_dim} of "
              f"{model.blocks[0].attn.qk_dim}", flush=True)
    return 0


if __name__ == "__main__":
    common.run_main(main)
