#!/usr/bin/env python
"""Benchmark NuWa class-specific derivation on fmnist-vit (markdown table + JSON).

For three random sub-tasks (fixed seeds) each of 2, 3 and 5 Fashion-MNIST classes and FLOPs kept
0.8 / 0.6 / 0.4, report target-class top-1 on the *test* split (target-class images only, argmax over
the target classes) of

* the base model,
* the SKP anchor (before OFP; its own FLOPs),
* NuWa (SKP + OFP-MHA + OFP-MLP under the budget),
* CORP (``edgeprune.api.prune``, target both, one sparsity chosen so that its FLOPs are the largest
  that fit the same budget; V is not pruned by CORP), calibrated on the same class-specific images,

plus derivation times. SKP, the calibration statistics and the SVD factors are computed once per
sub-task (``prepare``) and shared by its three budgets (as in nuwa §4.2); the table lists the shared
time and the per-budget time separately.

    python benchmarks/bench_nuwa.py --skp-steps 300 --out-json bench_nuwa.json --out-md bench_nuwa.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402


def corp_sparsity_for(base, frac: float, round_to: int = 8) -> tuple[float | None, int]:
    """Smallest CORP sparsity (step 0.005) whose FLOPs fit ``frac`` of the base model."""
    from edgeprune.anatomy import find_anatomy
    from edgeprune.nuwa.budget import PlanCost
    from edgeprune.plan import kept_dim

    an = find_anatomy(base)
    cost = PlanCost(an, "flops")
    dense = cost.total([b.qk_dim for b in an.blocks], [b.v_dim for b in an.blocks], [b.mlp_hidden for b in an.blocks])
    target = frac * dense
    for i in range(0, 196):
        s = i * 0.005
        try:
            qk = [kept_dim(b.qk_dim, s, round_to) for b in an.blocks]
            mlp = [kept_dim(b.mlp_hidden, s, round_to) for b in an.blocks]
        except Exception:  # noqa: BLE001 - rounding left no dims
            break
        f = cost.total(qk, [b.v_dim for b in an.blocks], mlp)
        if f <= target:
            return s, f
    return None, 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,3,5", help="sub-task sizes (number of classes)")
    ap.add_argument("--tasks-per-size", type=int, default=3)
    ap.add_argument("--flops", default="0.8,0.6,0.4", help="FLOPs fractions to keep")
    ap.add_argument("--seed", type=int, default=0, help="sub-task sampling seed")
    ap.add_argument("--skp-steps", type=int, default=300)
    ap.add_argument("--skp-eval-every", type=int, default=50)
    ap.add_argument("--skp-batch-size", type=int, default=1)
    ap.add_argument("--val-size", type=int, default=300)
    ap.add_argument("--calib-size", type=int, default=128)
    ap.add_argument("--rho-grid", default=None, help="comma-separated rho candidates (default: built-in grid)")
    ap.add_argument("--eval-size", type=int, default=None, help="at most this many test images per sub-task")
    ap.add_argument("--no-corp", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--data", default=None, help="Fashion-MNIST directory")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--out-md", default=None)
    ap.add_argument("--quiet", action="store_true", help="no progress bars (per-row lines still go to stderr)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from safetensors import safe_open

    from edgeprune.api import prune
    from edgeprune.data.fashion_mnist import CLASSES, load_split
    from edgeprune.nuwa.derive import DeriveConfig, derive_from, evaluate_targets, prepare
    from edgeprune.nuwa.skp import SKPConfig
    from edgeprune.zoo.fmnist_vit import WEIGHTS, create_fmnist_vit

    with safe_open(str(WEIGHTS), "pt") as fh:
        meta = fh.metadata() or {}
    if "test_top1" not in meta:
        print(f"warning: {WEIGHTS} has no test_top1 metadata -- untrained placeholder?", file=sys.stderr)
    elif meta.get("partial") == "true":
        print(f"warning: {WEIGHTS} is a partial checkpoint (epochs {meta.get('epochs')})", file=sys.stderr)
    sizes, fracs = common.ints(args.sizes), common.floats(args.flops)
    base = create_fmnist_vit(pretrained=True)
    xtr, ytr = load_split("train", args.data)
    xte, yte = load_split("test", args.data)
    cfg = DeriveConfig(skp=SKPConfig(steps=args.skp_steps, eval_every=args.skp_eval_every,
                                     batch_size=args.skp_batch_size, seed=args.seed),
                       val_size=args.val_size, calib_size=args.calib_size, seed=args.seed)
    if args.rho_grid:
        cfg.rho_grid = tuple(float(r) for r in args.rho_grid.split(","))
    rows = []
    t_all = time.perf_counter()
    for k in sizes:
        for j in range(args.tasks_per_size):
            g = torch.Generator().manual_seed(1000 * args.seed + 10 * k + j)
            classes = sorted(torch.randperm(10, generator=g)[:k].tolist())
            sel = torch.isin(yte, torch.as_tensor(classes))
            ex, ey = xte[sel][:args.eval_size], yte[sel][:args.eval_size]
            t0 = time.perf_counter()
            prep = prepare(base, classes, xtr, ytr, config=cfg, class_names=list(CLASSES), progress=not args.quiet)
            prep_s = time.perf_counter() - t0
            acc_base = evaluate_targets(base, ex, ey, classes)[0]
            acc_anchor = evaluate_targets(prep.anchor_model, ex, ey, classes)[0]
            # CORP gets the same class-specific calibration images as NuWa's OFP-MLP
            gcal = torch.Generator().manual_seed(cfg.seed + 1)
            calib = prep.train[0][torch.randperm(len(prep.train[0]), generator=gcal)[:cfg.calib_size]]
            for f in fracs:
                t1 = time.perf_counter()
                res = derive_from(prep, flops=f)
                nuwa_s = time.perf_counter() - t1
                acc_nuwa = evaluate_targets(res.model, ex, ey, classes)[0]
                d = res.record["derivation"]
                row = {"classes": classes, "names": [CLASSES[c] for c in classes], "k": k, "task": j,
                       "flops_budget": f, "base": acc_base, "anchor": acc_anchor, "nuwa": acc_nuwa,
                       "anchor_flops": d["anchor"]["flops"] / res.record["dense_flops"],
                       "anchor_kept": d["anchor"]["kept"], "skp_step": d["anchor"]["step"],
                       "nuwa_flops": res.record["flops"] / res.record["dense_flops"], "rho": d["rho"],
                       "qk": d["ofp_mha"]["qk"], "vo": d["ofp_mha"]["vo"], "mlp": d["ofp_mlp"]["mlp"],
                       "prepare_s": prep_s, "skp_s": prep.info["timing"]["skp_s"],
                       "derive_s": nuwa_s, "num_test": len(ex)}
                if not args.no_corp:
                    s, _ = corp_sparsity_for(base, f)
                    if s is None:
                        row.update(corp=None, corp_sparsity=None)
                    else:
                        t2 = time.perf_counter()
                        pr = prune(base, calib, target="both", sparsity=s)
                        row["corp_s"] = time.perf_counter() - t2
                        row.update(corp=evaluate_targets(pr.model, ex, ey, classes)[0], corp_sparsity=s,
                                   corp_flops=pr.record["flops"] / pr.record["dense_flops"])
                rows.append(row)
                print(f"k={k} task={j} {classes} flops {f}: base {acc_base:.4f} anchor {acc_anchor:.4f} "
                      f"nuwa {acc_nuwa:.4f} corp {row.get('corp')} (rho {d['rho']}, "
                      f"{nuwa_s:.1f}+{prep_s:.1f} s)", file=sys.stderr, flush=True)
    total_s = time.perf_counter() - t_all

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.2f}"

    lines = ["| k | classes | FLOPs kept | base | SKP anchor (FLOPs) | NuWa (FLOPs, rho) | CORP (FLOPs, s) | NuWa time: shared + budget (s) |",
             "|--:|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        corp = "-" if args.no_corp else (
            "n/a" if r.get("corp") is None else f"{pct(r['corp'])} ({r['corp_flops']:.3f}, {r['corp_sparsity']:.3f})")
        lines.append(f"| {r['k']} | {','.join(str(c) for c in r['classes'])} | {r['flops_budget']:.1f} | {pct(r['base'])} | "
                     f"{pct(r['anchor'])} ({r['anchor_flops']:.3f}) | {pct(r['nuwa'])} ({r['nuwa_flops']:.3f}, {r['rho']:g}) | "
                     f"{corp} | {r['prepare_s']:.1f} + {r['derive_s']:.1f} |")
    lines += ["", "Mean over the sub-tasks of each size:", "",
              "| k | FLOPs kept | base | SKP anchor | NuWa | CORP |", "|--:|--:|--:|--:|--:|--:|"]
    for k in sizes:
        for f in fracs:
            rs = [r for r in rows if r["k"] == k and r["flops_budget"] == f]
            mean = lambda key: None if any(r.get(key) is None for r in rs) else sum(r[key] for r in rs) / len(rs)  # noqa: E731
            lines.append(f"| {k} | {f:.1f} | {pct(mean('base'))} | {pct(mean('anchor'))} | {pct(mean('nuwa'))} | "
                         f"{'-' if args.no_corp else pct(mean('corp'))} |")
    md = "\n".join(lines)
    cmd = "python benchmarks/bench_nuwa.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": cmd, "weights_metadata": meta, "settings": vars(args), "total_s": total_s,
              "torch_threads": torch.get_num_threads(), "rows": rows}
    print(md)
    print(f"\ntotal {total_s:.0f} s; command: {cmd}")
    if args.out_json:
        common.write_json(args.out_json, result, "bench_nuwa", argv)
    if args.out_md:
        common.atomic_write_text(args.out_md, f"{md}\n\ncommand: `{cmd}`; total {total_s:.0f} s\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
