#!/usr/bin/env python
"""Benchmark STARFISH healing against CORP's closed-form compensation.

For each model and joint (MLP + Q/K) sparsity: the uncompensated baseline, CORP, and each of them
healed with STARFISH (``edgeprune.heal.heal``), with healing wall time and calibration size.

* ``fmnist-vit``: top-1 on the Fashion-MNIST test split (calibration: train images).
* ``dinov2-s14``: saliency fidelity to the dense model on foolbox's 20 ImageNet photos (Pearson r,
  MAE, IoU@0.5, feature cosine; calibration: augmented scikit-image photos).

Learning rates: the paper's 6e-4 for fmnist-vit (2048 images x 5 epochs / 32 = 320 steps, the
paper's regime); 1e-4 for dinov2-s14, whose CPU-sized run is only 24 steps (see ``--dinov2-lr``).

The dense block-output targets are cached once per model (``DiskTargetCache``) and reused by all
its heals. Prints markdown tables and writes JSON. Sized for a small CPU box by default::

    python benchmarks/bench_heal.py --json bench_heal.json
    python benchmarks/bench_heal.py --models fmnist-vit --sparsities 0.5 --fmnist-calib 512 --fmnist-epochs 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402


def _metric(spec, model, dense, ev) -> dict:
    from edgeprune.evaluate import evaluate

    with torch.no_grad():
        return evaluate(spec, model, ev, dense=dense)


def _cell(m: dict, kind: str) -> str:
    if kind == "saliency":
        return f"r {m['pearson']:.3f}, MAE {m['mae']:.4f}"
    return f"{m['top1'] * 100:.2f}%"


def bench_model(name: str, args, cache_root: Path) -> dict:
    from edgeprune.api import prune
    from edgeprune.heal import heal

    cfg = {
        "fmnist-vit": dict(prune_calib=args.fmnist_prune_calib, calib=args.fmnist_calib, epochs=args.fmnist_epochs,
                           batch=args.fmnist_batch, lr=args.fmnist_lr, eval_size=args.fmnist_eval_size),
        "dinov2-s14": dict(prune_calib=args.dinov2_prune_calib, calib=args.dinov2_calib, epochs=args.dinov2_epochs,
                           batch=args.dinov2_batch, lr=args.dinov2_lr, eval_size=None),
    }[name]
    spec, dense = common.model(name)
    prune_calib = spec.calibration_source(cfg["prune_calib"], seed=args.seed, data=args.data)
    heal_calib = spec.calibration_source(cfg["calib"], seed=args.seed, data=args.data)
    ev = spec.eval_source(args.data, n=cfg["eval_size"])
    print(f"== {name}: prune calibration {prune_calib.description}; heal calibration {heal_calib.description}; "
          f"evaluation {ev.description}", flush=True)
    dense_metric = _metric(spec, dense, None, ev) if spec.output_kind == "logits" else None
    if dense_metric:
        print(f"dense: {_cell(dense_metric, spec.output_kind)}", flush=True)
    rows = []
    cache = cache_root / name
    for sp in args.sparsities:
        for method, comp in (("uncompensated", False), ("corp", True)):
            t0 = time.perf_counter()
            pr = prune(dense, prune_calib, target="both", sparsity=sp, compensation=comp,
                       batch_size=args.prune_batch, spec=spec)
            prune_s = time.perf_counter() - t0
            before = _metric(spec, pr.model, dense, ev)
            res = heal(pr.model, dense, heal_calib, epochs=cfg["epochs"], batch_size=cfg["batch"], lr=cfg["lr"],
                       seed=args.seed, target_cache=cache, memory_budget_mb=args.memory_budget_mb,
                       progress=args.progress, warmup_steps=args.warmup_steps, keep_best=not args.keep_last)
            after = _metric(spec, res.model, dense, ev)
            row = {"model": name, "sparsity": sp, "method": method, "params": pr.record["params"],
                   "dense_params": pr.record["dense_params"], "flops": pr.record["flops"],
                   "dense_flops": pr.record["dense_flops"], "prune_s": prune_s,
                   "prune_calibration": len(prune_calib), "before": before, "after": after,
                   "heal_s": res.info["wall_time_s"], "heal_calibration": len(heal_calib),
                   "epochs": cfg["epochs"], "batch_size": cfg["batch"], "lr": cfg["lr"],
                   "align_before": res.info["initial_loss"], "align_after": res.info["final_loss"],
                   "targets": res.info["targets"], "history": res.history,
                   "warmup_steps": res.info["warmup_steps"], "keep_best": res.info["keep_best"],
                   "best_epoch": res.info["best_epoch"]}
            rows.append(row)
            print(f"sparsity {sp:g} {method:13s}: {_cell(before, spec.output_kind)} -> healed "
                  f"{_cell(after, spec.output_kind)}; alignment {row['align_before']:.4f} -> {row['align_after']:.4f}; "
                  f"prune {prune_s:.1f} s, heal {row['heal_s']:.1f} s (best epoch {row['best_epoch']})", flush=True)
    return {"model": name, "output_kind": spec.output_kind, "dense": dense_metric, "config": cfg,
            "evaluation": ev.description, "heal_calibration_source": heal_calib.description, "rows": rows}


def markdown(result: dict) -> str:
    kind = result["output_kind"]
    cfg = result["config"]
    what = ("top-1 on the Fashion-MNIST test split" if kind == "logits"
            else "saliency fidelity to the dense model (Pearson r, MAE) on 20 ImageNet photos")
    lines = [f"### {result['model']}: {what}", ""]
    if result["dense"]:
        lines.append(f"dense: {_cell(result['dense'], kind)}. ")
    lines.append(f"Healing: {cfg['calib']} calibration images x {cfg['epochs']} epochs, batch {cfg['batch']}, "
                 f"lr {cfg['lr']:g} (cosine to 1e-6), AdamW; CORP calibration {cfg['prune_calib']} images.")
    lines.append("")
    lines.append("| sparsity | params | uncompensated | CORP | uncomp. + heal | CORP + heal | heal time (unc. / CORP) | heal calib |")
    lines.append("|---:|---:|---|---|---|---|---:|---:|")
    by_sp: dict[float, dict[str, dict]] = {}
    for r in result["rows"]:
        by_sp.setdefault(r["sparsity"], {})[r["method"]] = r
    for sp, d in by_sp.items():
        u, c = d["uncompensated"], d["corp"]
        lines.append(f"| {sp:g} | x{u['params'] / u['dense_params']:.2f} | {_cell(u['before'], kind)} | "
                     f"{_cell(c['before'], kind)} | {_cell(u['after'], kind)} | {_cell(c['after'], kind)} | "
                     f"{u['heal_s']:.0f} s / {c['heal_s']:.0f} s | {u['heal_calibration']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=common.names, default=["fmnist-vit", "dinov2-s14"])
    p.add_argument("--sparsities", type=common.floats, default=[0.5, 0.7, 0.8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="Fashion-MNIST directory (default: the installed dataset).")
    p.add_argument("--fmnist-prune-calib", type=int, default=512, help="CORP calibration images (fmnist-vit).")
    p.add_argument("--fmnist-calib", type=int, default=2048, help="Healing calibration images (fmnist-vit).")
    p.add_argument("--fmnist-epochs", type=int, default=5)
    p.add_argument("--fmnist-batch", type=int, default=32)
    p.add_argument("--fmnist-lr", type=float, default=6e-4)
    p.add_argument("--fmnist-eval-size", type=int, default=None, help="Test images (default: all 10,000).")
    p.add_argument("--dinov2-prune-calib", type=int, default=64)
    p.add_argument("--dinov2-calib", type=int, default=64)
    p.add_argument("--dinov2-epochs", type=int, default=3)
    p.add_argument("--dinov2-batch", type=int, default=8)
    p.add_argument("--dinov2-lr", type=float, default=1e-4,
                   help="Below the paper's 6e-4: 64 photos x 3 epochs at batch 8 is only 24 AdamW steps, and "
                        "at 6e-4 the first (sign-like) Adam steps overshoot without enough steps to settle.")
    p.add_argument("--prune-batch", type=int, default=32)
    p.add_argument("--memory-budget-mb", type=float, default=1024)
    p.add_argument("--cache-dir", default=None, help="Dense-target cache root (default: a temporary directory).")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="heal warm-up steps (default: edgeprune's, 10%% of the steps, at least 5; 0 = the paper)")
    p.add_argument("--keep-last", action="store_true", help="return the last epoch, not the best (the paper)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1 is fastest on a small box shared with other jobs).")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_heal_") as tmp:
        cache_root = Path(args.cache_dir) if args.cache_dir else Path(tmp)
        results = [bench_model(m, args, cache_root) for m in args.models]
    total = time.perf_counter() - t0
    md = "\n\n".join(markdown(r) for r in results)
    print("\n" + md)
    print(f"\ntotal {total / 60:.1f} min, torch {torch.__version__}, {args.threads} thread(s)")
    if args.json_out:
        from safetensors import safe_open

        from edgeprune.zoo.fmnist_vit import WEIGHTS

        meta = safe_open(str(WEIGHTS), "pt").metadata() if WEIGHTS.exists() else None
        common.write_json(args.json_out, {
            "command": " ".join(["python", "benchmarks/bench_heal.py", *(argv if argv is not None else sys.argv[1:])]),
            "results": results, "markdown": md, "total_s": total, "torch": torch.__version__,
            "threads": args.threads, "fmnist_weights": meta}, "bench_heal", argv)
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
