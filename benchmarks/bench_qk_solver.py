"""Q/K compensation solvers side by side: float64 Cholesky of the d'^2 x d'^2 system vs matrix-free CG.

    python benchmarks/bench_qk_solver.py --model dinov2-s14 --threads 1
    python benchmarks/bench_qk_solver.py --model fmnist-vit --threads 1

Part 1 (per head): one calibration pass stores the per-image Q/K Grams; for each attention
sparsity every head's exact system (corp-v1 eq. 29) is solved both ways, alternating, and the
table gives the total solve seconds of each, CG iterations (min / median / max) and the largest
relative difference ``||M_cg - M_direct||_F / ||M_direct||_F``.

Part 2 (end to end): ``edgeprune.api.prune`` with target ``both`` and ``qk_solver`` "direct" then
"auto" (the default: ``edgeprune.corp.cg_is_cheaper`` picks per head), next to one dense forward pass over the same
calibration set (the pruning-cost yardstick of the CORP issue), and the largest output difference
between the two pruned models on the calibration images.

Part 3 (calibration pass): the statistics pass alone with each kind of statistic (MLP first
order only, MLP with covariance, per-image Q/K Grams, both) next to a plain forward pass over the
same images, alternating, twice; the table gives the median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402
from benchmarks.bench_corp import dense_pass_seconds  # noqa: E402
from edgeprune.anatomy import find_anatomy  # noqa: E402
from edgeprune.api import prune  # noqa: E402
from edgeprune.calibration.collect import collect_statistics  # noqa: E402
from edgeprune.corp import CorpConfig, plan_corp  # noqa: E402
from edgeprune.plan import pruned_indices  # noqa: E402
from edgeprune.solve import qk_logit, qk_logit_cg  # noqa: E402


def _calibration(spec, n: int, seed: int):
    if spec.name in common.ZOO:
        return common.calibration(spec, n, seed)
    from edgeprune.data.sources import TensorSource

    return TensorSource(common.noise(spec, n, seed), None, f"{n} Gaussian-noise images (random-init model)")


def per_head(model, calib, sparsities, batch_size: int, alpha: float) -> list[dict]:
    an = find_anatomy(model)
    stats = collect_statistics(an, (x for x, _ in calib.batches(batch_size)), mlp=False, qk=True, progress=False)
    rows = []
    for sp in sparsities:
        plans = plan_corp(an, stats, CorpConfig(attn_sparsity=sp))
        t_direct = t_cg = 0.0
        iters, diffs = [], []
        kept = None
        for b, plan in zip(an.blocks, plans):
            if plan.qk_keep is None:
                continue
            gq, gk = stats.qk[b.index].grams()
            for h in range(b.num_heads):
                keep = plan.qk_keep[h]
                kept = len(keep)
                prune_idx = pruned_indices(keep, b.qk_dim)
                t0 = time.perf_counter()
                k_sys, rhs = qk_logit.kronecker_system(gq[:, h], gk[:, h], keep, prune_idx)
                m_direct, _ = qk_logit.solve_logit_compensation(k_sys, rhs, alpha)
                t1 = time.perf_counter()
                res = qk_logit_cg.solve_logit_compensation_cg(
                    *qk_logit.kept_blocks(gq[:, h], gk[:, h], keep, prune_idx), alpha)
                t2 = time.perf_counter()
                del k_sys
                t_direct += t1 - t0
                t_cg += t2 - t1
                iters.append(res.iterations)
                diffs.append(float((res.m - m_direct).norm() / m_direct.norm().clamp_min(1e-300)))
        if not iters:
            continue
        rows.append({"sparsity": sp, "kept_qk_dim": kept, "heads": len(iters),
                     "direct_s": t_direct, "cg_s": t_cg,
                     "cg_iters_min": min(iters), "cg_iters_median": statistics.median(iters),
                     "cg_iters_max": max(iters), "max_rel_diff": max(diffs)})
        print(f"  per-head sparsity {sp}: direct {t_direct:.2f}s cg {t_cg:.2f}s", file=sys.stderr, flush=True)
    return rows


def end_to_end(spec, model, calib, sparsities, batch_size: int) -> list[dict]:
    rows = []
    probe = next(x for x, _ in calib.batches(batch_size))
    for sp in sparsities:
        fwd = dense_pass_seconds(model, calib, batch_size)
        out, row = {}, {"sparsity": sp, "dense_pass_s": fwd}
        for solver in ("direct", "auto"):
            res = prune(model, calib, target="both", sparsity=sp, qk_solver=solver,
                        batch_size=batch_size, spec=spec)
            row[f"{solver}_prune_s"] = res.record["timing"]["total_s"]
            row[f"{solver}_solve_s"] = res.record["timing"]["solve_s"]
            with torch.no_grad():
                out[solver] = res.model(probe)
        row["max_abs_output_diff"] = float((out["direct"] - out["auto"]).abs().max())
        rows.append(row)
        print(f"  end-to-end sparsity {sp}: direct {row['direct_prune_s']:.1f}s auto {row['auto_prune_s']:.1f}s "
              f"(dense pass {fwd:.1f}s)", file=sys.stderr, flush=True)
    return rows


def pass_cost(model, calib, batch_size: int, repeats: int = 2) -> list[dict]:
    an = find_anatomy(model)
    xs = [x for x, _ in calib.batches(batch_size)]
    kinds = {"MLP first order": dict(mlp=True, qk=False, mlp_second_order=False),
             "MLP with covariance": dict(mlp=True, qk=False),
             "Q/K Grams": dict(mlp=False, qk=True),
             "both (CORP, target both)": dict(mlp=True, qk=True)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    dense: list[float] = []
    for _ in range(repeats):
        for name, kw in kinds.items():
            dense.append(dense_pass_seconds(model, calib, batch_size))
            t0 = time.perf_counter()
            collect_statistics(an, iter(xs), progress=False, **kw)
            times[name].append(time.perf_counter() - t0)
    d = statistics.median(dense)
    return [{"statistics": k, "seconds": statistics.median(v), "dense_pass_s": d,
             "ratio": statistics.median(v) / d} for k, v in times.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dinov2-s14", help="fmnist-vit, dinov2-s14 or a timm ViT name (random init)")
    ap.add_argument("--sparsities", default="0.3,0.5,0.7", help="attention (and, end to end, MLP) sparsities")
    ap.add_argument("--calib-size", type=int, default=None, help="default: fmnist-vit 512, others 64")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--alpha", type=float, default=qk_logit.DEFAULT_ALPHA, help="Q/K ridge alpha")
    ap.add_argument("--parts", default="heads,e2e,pass", help="comma-separated: heads, e2e, pass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sparsities = common.floats(args.sparsities)
    spec, model = common.model(args.model, random_init=args.model not in common.ZOO)
    n = args.calib_size or (512 if args.model == "fmnist-vit" else 64)
    calib = _calibration(spec, n, args.seed)
    print(f"{args.model}: {calib.description}, torch threads {torch.get_num_threads()}", file=sys.stderr)

    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    heads = per_head(model, calib, sparsities, args.batch_size, args.alpha) if "heads" in parts else []
    print(f"\n{args.model}, {n} calibration images, ridge alpha {args.alpha:g}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)\n")
    if heads:
        print("| attn sparsity | kept qk_dim | heads | Cholesky s | CG s | speed-up | CG iterations min / median / max | max rel. diff of M |")
        print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in heads:
        print(f"| {r['sparsity']:.2f} | {r['kept_qk_dim']} | {r['heads']} | {r['direct_s']:.2f} | {r['cg_s']:.2f} | "
              f"{r['direct_s'] / r['cg_s']:.1f}x | {r['cg_iters_min']} / {r['cg_iters_median']:g} / {r['cg_iters_max']} | "
              f"{r['max_rel_diff']:.1e} |")
    e2e = end_to_end(spec, model, calib, sparsities, args.batch_size) if "e2e" in parts else []
    if e2e:
        print("\n| sparsity (both) | dense pass s | prune s, direct | prune s, auto | ratio to dense pass, direct | ratio, auto | max abs output diff |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in e2e:
            print(f"| {r['sparsity']:.2f} | {r['dense_pass_s']:.1f} | {r['direct_prune_s']:.1f} | {r['auto_prune_s']:.1f} | "
                  f"{r['direct_prune_s'] / r['dense_pass_s']:.2f} | {r['auto_prune_s'] / r['dense_pass_s']:.2f} | "
                  f"{r['max_abs_output_diff']:.1e} |")
    cost = pass_cost(model, calib, args.batch_size) if "pass" in parts else []
    if cost:
        print("\n| statistics collected | pass s | dense pass s | ratio |")
        print("|---|---:|---:|---:|")
        for r in cost:
            print(f"| {r['statistics']} | {r['seconds']:.1f} | {r['dense_pass_s']:.1f} | {r['ratio']:.2f} |")
    if args.json:
        common.write_json(args.json, {"model": args.model, "calib_size": n, "threads": torch.get_num_threads(),
                                      "per_head": heads, "end_to_end": e2e, "calibration_pass": cost},
                          "bench_qk_solver", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
