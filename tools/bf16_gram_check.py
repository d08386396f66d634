"""Is the MLP covariance formed with bfloat16 products still positive semi-definite? (prototype)

    python tools/bf16_gram_check.py

One calibration pass of ``dinov2-s14-fmnist`` over 256 calibration images (seed 0) with every
block's fc2 input accumulated twice, float32 products (the default) and bfloat16 products
(``gram_dtype="bfloat16"``); prints per block the smallest eigenvalue of each covariance over its
mean diagonal (the MLP ridge adds ``1e-3 x`` the mean diagonal of the kept block, so a value
below about -1e-3 makes the ridge system indefinite) and the largest over the mean diagonal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgeprune  # noqa: E402
from edgeprune.anatomy import find_anatomy  # noqa: E402
from edgeprune.calibration.mlp_stats import MLPStatistics  # noqa: E402


def main() -> int:
    torch.set_num_threads(2)
    spec = edgeprune.get_model_spec("dinov2-s14-fmnist")
    model = spec.create(pretrained=True).eval()
    an = find_anatomy(model)
    stats = {b.index: {k: MLPStatistics(b.mlp_hidden, dt, count_positive=False)
                       for k, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
             for b in an.blocks}

    def hook(st):
        def f(_mod, args):
            for s in st.values():
                s.add_batch(args[0])
        return f

    for b in an.blocks:
        b.fc2.register_forward_pre_hook(hook(stats[b.index]))
    with torch.no_grad():
        for x in spec.calibration_source(256, seed=0).batches(32):
            model(x[0] if isinstance(x, (tuple, list)) else x)
    print("| block | float32: min eig / mean diag | bfloat16: min eig / mean diag | max diag / mean diag |")
    print("|---|---|---|---|")
    for i, st in stats.items():
        row = []
        for k in ("float32", "bfloat16"):
            c = st[k].cov
            row.append(f"{float(torch.linalg.eigvalsh(c)[0] / c.diagonal().mean()):.2e}")
        c = st["float32"].cov
        print(f"| {i} | {' | '.join(row)} | {float(c.diagonal().max() / c.diagonal().mean()):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
