"""Choose the default scale-free ridge alphas on a validation split (never the test split).

    python tools/sweep_ridge.py --alphas 1e-4,1e-3,1e-2,1e-1 --sparsities 0.5,0.7

fmnist-vit: calibration = 512 Fashion-MNIST train images (seed 0), validation = 5000 *other* train
images; target "both". Sweeps the MLP alpha with the Q/K alpha at its default and vice versa,
printing validation top-1 for each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeprune.api import prune  # noqa: E402
from edgeprune.data.fashion_mnist import load_split  # noqa: E402
from edgeprune.data.sources import TensorSource  # noqa: E402
from edgeprune.evaluate import evaluate_classifier  # noqa: E402
from edgeprune.solve import mlp_ridge, qk_logit  # noqa: E402
from edgeprune.zoo.fmnist_vit import create_fmnist_vit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alphas", default="1e-4,1e-3,1e-2,1e-1")
    ap.add_argument("--sparsities", default="0.5,0.7")
    ap.add_argument("--calib-size", type=int, default=512)
    ap.add_argument("--val-size", type=int, default=5000)
    args = ap.parse_args()
    x, y = load_split("train")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    calib = x[perm[:args.calib_size]]  # the same images `edgeprune prune` calibrates on (seed 0)
    val = TensorSource(x[perm[-args.val_size:]], y[perm[-args.val_size:]])
    model = create_fmnist_vit()
    print(f"dense validation top-1 {evaluate_classifier(model, val)['top1'] * 100:.2f}%")
    alphas = [float(a) for a in args.alphas.split(",")]
    print("| sparsity | swept | alpha | val top-1 % |")
    print("|---|---|---|---|")
    for s in [float(v) for v in args.sparsities.split(",")]:
        for which in ("mlp", "qk"):
            for a in alphas:
                kw = {"ridge_alpha": a, "qk_ridge_alpha": qk_logit.DEFAULT_ALPHA} if which == "mlp" else \
                     {"ridge_alpha": mlp_ridge.DEFAULT_ALPHA, "qk_ridge_alpha": a}
                res = prune(model, calib, target="both", sparsity=s, **kw)
                acc = evaluate_classifier(res.model, val)["top1"]
                print(f"| {s} | {which} | {a:g} | {acc * 100:.2f} |", flush=True)


if __name__ == "__main__":
    main()
