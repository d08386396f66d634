"""Check the allocation proxy against the measured final-output error (docs/allocation.md).

    python -m edgeprune.allocation.measure --calib 256 --eval 256 --budget 0.5 --samples 16

On fmnist-vit: one calibration pass; allocations at the same FLOPs budget are made by running the
allocator on randomly perturbed curves (each unit's errors times a log-normal factor), plus the
greedy and the uniform allocation. Each is pruned with CORP (same statistics) and scored by the
mean squared logit error against the dense model on held-out images. Prints the Spearman rank
correlation of the proxy (sum of normalised unit errors) with the measured error, also for other
weights of the Q/K curves (w x the errors.QK_WEIGHT the allocator uses; w = 1 is the allocator's proxy).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch

from edgeprune.allocation import greedy
from edgeprune.allocation.cost import cost_model
from edgeprune.anatomy import find_anatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp.config import CorpConfig
from edgeprune.corp.qk_solvers import qk_solver_from_grams
from edgeprune.corp.steps import apply_corp, plan_corp
from edgeprune.data.fashion_mnist import load_split
from edgeprune.zoo.fmnist_vit import create_fmnist_vit


def spearman(a, b) -> float:
    """Spearman rank correlation (no ties expected)."""
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", type=int, default=256)
    ap.add_argument("--eval", type=int, default=256)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--sigma", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=1, help="seed of the curve perturbations")
    args = ap.parse_args()
    torch.manual_seed(0)
    xtr, _ = load_split("train")
    xte, yte = load_split("test")
    g = torch.Generator().manual_seed(0)
    calib = xtr[torch.randperm(len(xtr), generator=g)[:args.calib]]
    xe, ye = xte[:args.eval], yte[:args.eval]
    model = create_fmnist_vit()
    an = find_anatomy(model)
    cfg = CorpConfig.from_target("both", None, budget={"kind": "flops", "value": args.budget})
    stats = collect_statistics(an, [calib[i:i + 64] for i in range(0, len(calib), 64)], progress=False)
    curves = greedy.build_curves(an, stats, cfg)
    base = greedy.base_dims(an, cfg)
    cost = cost_model("flops", an)
    target = args.budget * cost.fixed_cost() + args.budget * sum(cost.block_cost(b, d) for b, d in zip(an.blocks, base))
    with torch.no_grad():
        dense_out = model(xe)
    allocs = {}
    dims, rep = greedy.allocate(an, stats, cfg)
    allocs["chosen:" + rep["chosen"]] = dims
    uni = greedy._uniform_positions(an, curves, cfg, base, cost, target)
    if uni:
        st = greedy._State(an, curves, base, cost, uni[0])
        allocs[f"uniform s={uni[1]:g}"] = [{k: d[k] for k in ("mlp", "qk")} for d in st.dims]
    gen = torch.Generator().manual_seed(args.seed)
    for i in range(args.samples):
        noisy = [dataclasses.replace(c, raw=[r * float(torch.exp(args.sigma * torch.randn(1, generator=gen)))
                                             for r in c.raw]) for c in curves]
        st = greedy._State(an, noisy, base, cost, [len(c.ks) - 1 for c in noisy])
        greedy._descend(st, target)
        greedy._fill(st, target)
        allocs[f"random{i}"] = [{k: d[k] for k in ("mlp", "qk")} for d in st.dims]
    rows = []
    for name, dims in allocs.items():
        pos = [c.ks.index(dims[c.block][c.keys[0]]) for c in curves]
        parts = {"mlp": 0.0, "qk": 0.0}
        for c, p in zip(curves, pos):
            parts[c.keys[0]] += c.errors[p]
        m = copy.deepcopy(model)
        a2 = find_anatomy(m)
        c2 = dataclasses.replace(cfg, budget=None, dims=dims)
        plans = plan_corp(a2, stats, c2)
        apply_corp(a2, plans, c2, stats.mlp, qk_solver_from_grams(stats.qk, plans, c2), stats.vo)
        st = greedy._State(an, curves, base, cost, pos)
        with torch.no_grad():
            out = m(xe)
        mse = float((out - dense_out).pow(2).mean())
        top1 = float((out.argmax(1) == ye).float().mean())
        rows.append((name, parts["mlp"], parts["qk"], mse, top1, st.total / (target / args.budget)))
        print(f"{name:18s} flops x{rows[-1][5]:.3f} proxy mlp {parts['mlp']:.4f} qk {parts['qk']:.4f} "
              f"sum {parts['mlp'] + parts['qk']:.4f}  logit MSE {mse:.5f}  top-1 {top1:.4f}", flush=True)
    mses = [r[3] for r in rows]
    for w in (0.0, 0.5, 1.0, 2.0):
        print(f"Spearman(proxy mlp + {w:g} x qk, logit MSE) = {spearman([r[1] + w * r[2] for r in rows], mses):.3f}")
    print(f"Spearman(proxy, 1 - top-1) = {spearman([r[1] + r[2] for r in rows], [1 - r[4] for r in rows]):.3f}")


if __name__ == "__main__":
    main()
