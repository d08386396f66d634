#!/usr/bin/env python
"""One rotation for the whole depth, or one per block? What each keeps of the readers' input (issue 33).

``edgeprune.embed`` slices the residual stream with a single rotation ``V`` (D, D'-1), the top
eigenvectors of the readers' summed normalised moment ``M = sum_r E_r[u u^T]``
(``edgeprune.embed.covariance``). SliceGPT (Ashkboos et al. 2024, §3.4) can instead rotate every
block's input with its own ``V_l`` and carry a D' x D' shortcut matrix ``V_l^T V_{l+1}`` on each
residual connection -- which makes the model a non-timm graph. Before building that, this tool
measures what it could buy: for every reader ``r`` (norm1 / norm2 of each block and the final norm)
the share of its second moment that the global ``V`` keeps, ``tr(V^T M_r V) / tr(C M_r C)``,
against the most *any* rotation can keep for that reader alone (the sum of its own top D'-1
eigenvalues over the same trace) -- an upper bound for per-block rotations, which must also share
one basis between a block's two readers. Prints a Markdown table per reader and the mean.

Example::

    OMP_NUM_THREADS=1 python tools/embed_rotation_check.py --model dinov2-s14-fmnist --img-size 112 \\
        --embed-sparsity 0.25 --calib-size 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from edgeprune.anatomy import find_anatomy  # noqa: E402
from edgeprune.embed.covariance import stream_moment  # noqa: E402
from edgeprune.embed.fold import stream_parts  # noqa: E402
from edgeprune.embed.rotate import ones_complement, principal_basis  # noqa: E402
from edgeprune.embed.slice import embed_kept_dim  # noqa: E402
from edgeprune.zoo.registry import get_model_spec  # noqa: E402


def kept_shares(moments: list[torch.Tensor], k: int) -> list[tuple[float, float]]:
    """For each reader moment (D, D): (share kept by the global top-``k`` basis of their sum,
    share kept by the reader's own top-``k`` basis), both over the zero-mean subspace's trace."""
    v, _ = principal_basis(torch.stack(moments).sum(0), k)
    u = ones_complement(moments[0].shape[0])
    out = []
    for m in moments:
        total = float(torch.trace(u.T @ m @ u))
        _, evals = principal_basis(m, k)
        out.append((float(torch.trace(v.T @ m @ v)) / total, float(evals[:k].sum()) / total))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dinov2-s14-fmnist")
    ap.add_argument("--img-size", type=int, default=None)
    ap.add_argument("--embed-sparsity", type=float, default=0.25)
    ap.add_argument("--calib-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    spec = get_model_spec(args.model, img_size=args.img_size) if args.img_size else get_model_spec(args.model)
    model = spec.create(pretrained=True).eval()
    anatomy = find_anatomy(model)
    calib = spec.calibration_source(args.calib_size, seed=args.seed)
    d_kept = embed_kept_dim(anatomy.embed_dim, args.embed_sparsity)
    batches = (x for x, _ in calib.batches(args.batch_size))
    moments, info = stream_moment(anatomy, stream_parts(anatomy), batches, per_reader=True)
    rows = kept_shares(moments, d_kept - 1)
    names = [f"block {i} {n}" for i in range(len(anatomy.blocks)) for n in ("norm1", "norm2")] + ["final norm"]
    print(f"**{args.model} {spec.input_size[-1]} px, D {anatomy.embed_dim} -> D' {d_kept}, "
          f"{info['images']} calibration images (seed {args.seed})**\n")
    print("| reader | kept by one rotation (%) | kept by its own rotation, upper bound (%) |")
    print("|---|---:|---:|")
    for name, (g, own) in zip(names, rows):
        print(f"| {name} | {100 * g:.2f} | {100 * own:.2f} |")
    g_mean = sum(r[0] for r in rows) / len(rows)
    o_mean = sum(r[1] for r in rows) / len(rows)
    print(f"| mean | {100 * g_mean:.2f} | {100 * o_mean:.2f} |")
    print(f"| lost (mean) | {100 * (1 - g_mean):.2f} | {100 * (1 - o_mean):.2f} |")


if __name__ == "__main__":
    main()
