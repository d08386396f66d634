"""Per-batch cost of the calibration statistics next to the dense forward of one block.

    python tools/bench_gram.py --threads 1

For one batch of ``--batch`` images of a timm model (seeded random init; deit_small: 197 tokens,
width 384, MLP hidden 1536): the forward pass of one transformer block, the float32 MLP Gram
(``edgeprune.calibration.mlp_stats.symmetric_gram``) at several block-row sizes with its GFLOP/s,
the whole ``MLPStatistics.add_batch`` (centring, column sums, Gram into float64) and
``QKStatistics.add_batch`` (per-image Q/K Grams), each the median of ``--repeats`` timed runs
after one warm-up, and each as a share of the block's forward. docs/prune_cost.md "The floor,
measured" uses it to bound what an exact prune can cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgeprune  # noqa: E402,F401  (the torchvision::nms shim before timm)
from edgeprune.anatomy import find_anatomy  # noqa: E402
from edgeprune.calibration.collect import split_qk  # noqa: E402
from edgeprune.calibration.mlp_stats import MLPStatistics, symmetric_gram  # noqa: E402
from edgeprune.calibration.qk_stats import QKStatistics  # noqa: E402
from edgeprune.zoo.registry import get_model_spec  # noqa: E402


def seconds(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deit_small_patch16_224")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", default="384,256,192,128", help="Gram block-row sizes")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = get_model_spec(args.model, None, True).create(pretrained=True).eval()
    an = find_anatomy(model)
    blk = an.blocks[len(an.blocks) // 2]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, an.num_tokens, blk.fc1.in_features, generator=g)
    module = model.blocks[blk.index]
    hidden = []
    h = blk.fc2.register_forward_pre_hook(lambda _m, a: hidden.append(a[0]))
    qkv = []
    h2 = blk.qkv.register_forward_hook(lambda _m, _a, out: qkv.append(out))
    module(x)
    h.remove()
    h2.remove()
    hid, out = hidden[0], qkv[0]
    t, d = hid.shape[0] * hid.shape[1], hid.shape[-1]
    flat = hid.reshape(t, d)
    ref = seconds(lambda: module(x), args.repeats)
    print(f"{args.model}: one batch of {args.batch} images = {t} tokens, MLP hidden {d}, {args.threads} thread(s)")
    print("| part | seconds per batch and block | share of the block's forward | GFLOP/s |")
    print("|---|---|---|---|")
    print(f"| forward of one block | {ref:.4f} | 1.00 | - |")
    for b in (int(v) for v in args.blocks.split(",")):
        acc = torch.zeros(d, d, dtype=torch.float64)
        s = seconds(lambda: symmetric_gram(flat, block=b, out=acc), args.repeats)
        k = -(-d // b)
        flops = 2.0 * t * sum(min(b, d - i) * (d - i) for i in range(0, d, b))
        print(f"| MLP Gram, float32, {b}-row blocks ({k} GEMMs) | {s:.4f} | {s / ref:.2f} | {flops / s / 1e9:.0f} |")
    st = MLPStatistics(d, count_positive=False)
    s = seconds(lambda: st.add_batch(hid), args.repeats)
    print(f"| MLPStatistics.add_batch (centring, sums, Gram) | {s:.4f} | {s / ref:.2f} | - |")
    qs = QKStatistics(blk.num_heads, blk.qk_dim)
    s = seconds(lambda: qs.add_batch(*split_qk(out, blk.num_heads, blk.qk_dim)), args.repeats)
    print(f"| QKStatistics.add_batch (per-image Q/K Grams) | {s:.4f} | {s / ref:.2f} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
