#!/usr/bin/env python
"""Accuracy at a FLOPs budget: uniform CORP vs budgeted vs budgeted + sequential (issue 14).

For one zoo model with labels (``fmnist-vit``, ``dinov2-s14-fmnist``) and every FLOPs budget
(fraction of the dense model) this prunes with

* ``nocomp``     -- uniform sparsity on MLP + Q/K, no compensation (the floor),
* ``uniform``    -- uniform CORP (``--target both --sparsity s``),
* ``budgeted``   -- ``--flops F``: per-block, per-module dims from the allocator
  (``edgeprune.allocation``),
* ``sequential`` -- ``--flops F --sequential``: budgeted, with statistics of block i taken on the
  output of the already pruned blocks (``edgeprune.sequential``),

for each calibration seed (the calibration set changes with the seed; the evaluation set is the
model's held-out split, disjoint from calibration, the same for every row). The uniform rows use
the largest-FLOPs uniform sparsity whose rounded dims stay within the budget (their achieved FLOPs
are printed: multiples of ``--round-to`` cannot meet every budget exactly). With ``--heal B,...``
the pruned models at those budgets are also healed (STARFISH, ``edgeprune.heal``, default
HealConfig, on the run's own calibration set). The budgeted methods allocate MLP, Q/K and V dims
(``--target all``, what ``edgeprune prune --flops`` does without ``--target``; ``--target both``:
MLP + Q/K only); the uniform and no-compensation rows stay on MLP + Q/K (CORP's setting).

Columns: achieved FLOPs and params (fraction of dense), top-1 (%) mean and spread (min-max over
seeds), top-1 agreement with the dense model (%), prune seconds (mean). The markdown table is
written between markers into ``--doc`` (default docs/accuracy.md), one block per model, with the
command and the machine.

Examples::

    python benchmarks/accuracy_table.py --model fmnist-vit --seeds 0,1,2 --heal 0.5,0.4
    python benchmarks/accuracy_table.py --model dinov2-s14-fmnist --budgets 0.6,0.5,0.4 --seeds 0 \
        --eval-size 1000 --methods uniform,budgeted,sequential
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402

METHODS = ("nocomp", "uniform", "budgeted", "sequential")


def uniform_flops(anatomy, sparsity: float, round_to: int) -> int:
    """FLOPs of the model with every block's MLP and Q/K dims pruned uniformly at ``sparsity``
    (``edgeprune.flops`` formulas on the rounded kept dims; no pruning is run)."""
    from edgeprune.flops import block_flops, model_flops
    from edgeprune.plan import kept_dim

    dense = model_flops(anatomy)
    total = dense["patch_embed"] + dense["head"]
    for b in anatomy.blocks:
        fake = types.SimpleNamespace(qkv=b.qkv, num_heads=b.num_heads, v_dim=b.v_dim,
                                     qk_dim=kept_dim(b.qk_dim, sparsity, round_to),
                                     mlp_hidden=kept_dim(b.mlp_hidden, sparsity, round_to))
        total += block_flops(fake, anatomy.num_tokens)["total"]
    return total


def uniform_sparsity_for(anatomy, budget: float, round_to: int) -> float:
    """The uniform sparsity (grid of 0.005) with the most FLOPs not above ``budget`` x dense."""
    from edgeprune.flops import model_flops

    from edgeprune.errors import UserError

    dense = model_flops(anatomy)["total"]
    best = None
    for i in range(0, 196):
        s = i * 0.005
        try:
            f = uniform_flops(anatomy, s, round_to)
        except UserError:  # rounding leaves no dims: past the last reachable sparsity
            break
        if f <= budget * dense and (best is None or f > best[1]):
            best = (s, f)
    if best is None:
        raise SystemExit(f"no uniform sparsity reaches FLOPs x{budget}")
    return best[0]


def config_for(args, method: str, budget: float, s_uni: float):
    """The CorpConfig of one row: uniform / nocomp at the uniform sparsity ``s_uni`` meeting the
    budget, or budgeted / sequential at the FLOPs budget, with every setting of the command line
    (``--round-to``, ``--gram-tokens``, ``--check-images``, ``--anchors``, ``--bias-correction``,
    ``--head-refit``, ``--last-block``)."""
    from edgeprune.corp import CorpConfig

    common = {"round_to": args.round_to, "gram_tokens": None if args.gram_tokens < 0 else args.gram_tokens,
              "bias_correction_images": None if args.bias_correction < 0 else args.bias_correction,
              "head_refit": {"auto": None, "on": True, "off": False}[args.head_refit],
              "last_block": args.last_block}
    if method in ("nocomp", "uniform"):
        return CorpConfig.from_target("both", s_uni, compensation=method == "uniform", **common)
    budgeted = {"allocation_anchors": args.anchors}
    if args.check_images is not None:
        budgeted["allocation_check_images"] = args.check_images
    if getattr(args, "sensitivity_images", None) is not None:
        budgeted["allocation_sensitivity_images"] = args.sensitivity_images
    return CorpConfig.from_target(args.target, None, budget={"kind": "flops", "value": budget},
                                  sequential=method == "sequential", **common, **budgeted)


def run(args, log) -> list[dict]:
    import torch

    import edgeprune
    from edgeprune.anatomy import find_anatomy
    from edgeprune.heal.trainer import heal

    if args.threads:
        torch.set_num_threads(args.threads)
    spec, dense = common.model(args.model, img_size=args.img_size)
    anatomy = find_anatomy(dense)
    batches = common.eval_batches(spec, args.eval_size, args.eval_batch)
    t0 = time.perf_counter()
    d = common.top1(dense, batches)
    log(f"dense top-1 {d['top1'] * 100:.2f}% on {sum(len(y) for _, y in batches)} images "
        f"({time.perf_counter() - t0:.0f} s)")
    rows = [{"budget": 1.0, "method": "dense", "flops": 1.0, "params": 1.0, "top1": [d["top1"]],
             "agreement": [1.0], "seconds": [0.0], "healed": []}]
    heal_at = {float(b) for b in args.heal.split(",")} if args.heal else set()
    for budget in [float(b) for b in args.budgets.split(",")]:
        s_uni = uniform_sparsity_for(anatomy, budget, args.round_to)
        for method in args.methods.split(","):
            label = method if method in ("nocomp", "uniform") else f"{method} [{args.target}]"
            row = {"budget": budget, "method": label, "top1": [], "agreement": [], "seconds": [], "healed": [],
                   "sparsity": s_uni if method in ("nocomp", "uniform") else None}
            for seed in [int(s) for s in args.seeds.split(",")]:
                cfg = config_for(args, method, budget, s_uni)
                calib = spec.calibration_source(args.calib_size or spec.default_calib_size, seed=seed)
                t0 = time.perf_counter()
                res = edgeprune.prune(dense, calib, cfg, spec=spec)
                row["seconds"].append(time.perf_counter() - t0)
                rec = res.record
                row["flops"] = rec["flops"] / rec["dense_flops"]
                row["params"] = rec["params"] / rec["dense_params"]
                m = common.top1(res.model, batches, d["preds"])
                row["top1"].append(m["top1"])
                row["agreement"].append(m["agreement"])
                msg = (f"FLOPs x{budget:g} {label:10} seed {seed}: achieved FLOPs x{row['flops']:.3f} "
                       f"params x{row['params']:.3f} top-1 {m['top1'] * 100:.2f}% agreement "
                       f"{m['agreement'] * 100:.2f}% prune {row['seconds'][-1]:.1f} s")
                sel = (rec.get("allocation") or {}).get("selection")
                if sel:  # which candidate allocation won, and every candidate's measured error
                    errs = ", ".join(f"{k} {v:.4g}" for k, v in sel["measured_output_error"].items())
                    msg += f"; allocation {sel['chosen']} (measured output error: {errs}; selection {sel['seconds']:.0f} s"
                    if sel.get("sensitivity"):
                        msg += f", of which per-unit sensitivities {sel['sensitivity']['seconds']:.0f} s"
                    msg += ")"
                bc = rec.get("bias_correction") or {}
                if bc.get("images"):  # the output correction: bias or classifier refit (and its ridge alpha)
                    msg += f"; output correction {bc['kind']}" + (f" alpha {bc['alpha']:g}" if bc.get("alpha") else "")
                if budget in heal_at and method != "nocomp":
                    t1 = time.perf_counter()
                    healed = heal(res.model, dense, calib).model
                    h = common.top1(healed.eval(), batches, d["preds"])
                    row["healed"].append(h["top1"])
                    msg += f"; healed top-1 {h['top1'] * 100:.2f}% ({time.perf_counter() - t1:.0f} s)"
                log(msg)
            rows.append(row)
    return rows


def _stat(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * 100
    if len(values) == 1:
        return f"{mean:.2f}"
    return f"{mean:.2f} ({min(values) * 100:.2f}-{max(values) * 100:.2f})"


def render(rows: list[dict], args, argv: list[str], machine: str, minutes: float) -> str:
    n_seeds = len(args.seeds.split(","))
    lines = [
        "Command: `" + " ".join(["python benchmarks/accuracy_table.py", *(shlex.quote(a) for a in argv)]) + "`",
        f"Machine: {machine}. {n_seeds} calibration seed(s) ({args.calib_size or 'default'} images each); "
        f"evaluation on {args.eval_size or 'all'} held-out images, the same for every row. Total {minutes:.0f} min.",
        "",
        "| FLOPs budget | method | achieved FLOPs | params | top-1 % mean (min-max) | agreement % | "
        "healed top-1 % | prune s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        method = r["method"] + (f" (s={r['sparsity']:g})" if r.get("sparsity") is not None else "")
        lines.append(f"| x{r['budget']:g} | {method} | x{r['flops']:.3f} | x{r['params']:.3f} | {_stat(r['top1'])} | "
                     f"{_stat(r['agreement'])} | {_stat(r['healed'])} | {statistics.fmean(r['seconds']):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="fmnist-vit")
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--budgets", default="0.75,0.6,0.5,0.4", help="FLOPs budgets, fractions of dense")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--seeds", default="0,1,2", help="calibration seeds")
    p.add_argument("--calib-size", type=int, default=None, help="calibration images [the model's default]")
    p.add_argument("--eval-size", type=int, default=None, help="held-out images [all]")
    p.add_argument("--gram-tokens", type=int, default=0,
                   help="MLP statistics from this many random tokens per image (CorpConfig.gram_tokens; -1 = "
                        "the library default, auto) [0: all tokens, as every table in docs/accuracy.md]")
    p.add_argument("--sensitivity-images", type=int, default=None,
                   help="check images of the per-unit sensitivity (CorpConfig.allocation_sensitivity_images) "
                        "[all the check images]")
    p.add_argument("--check-images", type=int, default=None,
                   help="calibration images on which budgeted candidates and per-unit sensitivities are "
                        "measured (CorpConfig.allocation_check_images) [32]")
    p.add_argument("--anchors", type=int, default=1, choices=(1, 2),
                   help="measurements per allocation unit (CorpConfig.allocation_anchors) [1]")
    p.add_argument("--bias-correction", type=int, default=-1, metavar="N",
                   help="output bias correction on the first N calibration images "
                        "(CorpConfig.bias_correction_images; 0 = off) [-1: the library default, all "
                        "calibration images for budgeted rows, off for uniform ones]")
    p.add_argument("--head-refit", choices=("auto", "on", "off"), default="auto",
                   help="classifier refit with the output correction (CorpConfig.head_refit) [auto: the "
                        "library default, on whenever the correction runs]")
    p.add_argument("--last-block", choices=("auto", "cls", "full"), default="auto",
                   help="class-token last block (CorpConfig.last_block) [auto: the library default, cls "
                        "for budgeted rows of a token-pooled classifier]")
    p.add_argument("--eval-batch", type=int, default=100)
    p.add_argument("--heal", default="", help="budgets at which pruned models are also healed, e.g. 0.5,0.4")
    p.add_argument("--round-to", type=int, default=8)
    p.add_argument("--target", choices=("both", "all"), default="all",
                   help="modules the budgeted methods allocate: all = MLP + Q/K + V dims (what --flops "
                        "does by default), both = MLP + Q/K")
    p.add_argument("--threads", type=int, default=0, help="torch threads [torch's default]")
    p.add_argument("--doc", type=Path, default=common.REPO / "docs" / "accuracy.md")
    p.add_argument("--no-doc", action="store_true", help="print only")
    args = p.parse_args(argv)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    bad = sorted(set(args.methods.split(",")) - set(METHODS))
    if bad:
        p.error(f"unknown method(s) {', '.join(bad)}")
    t0 = time.perf_counter()
    rows = run(args, lambda s: print(s, flush=True))
    block = render(rows, args, argv_used, common.machine(), (time.perf_counter() - t0) / 60)
    print("\n" + block)
    if not args.no_doc:
        common.write_between(args.doc, f"<!-- accuracy_table:{args.model}:start -->",
                             f"<!-- accuracy_table:{args.model}:end -->", block, heading=f"## {args.model}")
        print(f"\nwritten to {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
