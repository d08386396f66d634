"""Pruning cost: whole ``edgeprune.prune`` (CORP) next to one dense forward pass over the same images.

    python benchmarks/bench_prune_cost.py --models deit_small --sizes 256 --threads 1,2
    python benchmarks/bench_prune_cost.py --models deit_small,deit_base --sizes 64,256,1024 --devices cpu,cuda

For each model (timm, seeded random init, as ``--random-init``), calibration size (seeded random
images, 224 x 224), thread count and device: a dense forward pass over the calibration images
and ``edgeprune.prune`` (target ``both`` at ``--sparsity``, CORP compensation, ``qk_solver`` as
given) are run interleaved in one process (``--repeats`` times: dense, prune, dense, prune, ...),
so that load from other processes hits both alike. Printed per row: the median dense-pass
seconds, the median prune seconds and its phases -- statistics (the calibration pass), ranking
(``plan_corp``), solve (MLP / proj ridge fits and Q/K systems), surgery (folding and shrinking
the modules), other (copying the model, structure summaries, the record) -- the median of the
per-repeat ratios prune / dense, whether the row meets its bound (issue 29: CPU, deit_small
both@0.5, default settings, 1 and 2 threads: <= 2.0x at 256-767 images, <= 1.5x from 768;
CUDA: <= 3x; a summary line per bound follows the table), the same ratio of process CPU
time (less sensitive to other processes on a shared machine; at 1 thread it is the wall ratio of
an idle machine), and the peak memory of the
prune (host RSS; on a GPU also ``torch.cuda.max_memory_allocated``). The Q/K solver each head
used is summarised ("direct" / "cg" counts).

The ``edgeprune prune`` CLI adds model creation, calibration-image loading and evaluation, which
are not pruning cost; ``spec=`` is passed so that ``prune`` does not rebuild the model to
recognise it.
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

import edgeprune.pruning.corp as corp  # noqa: E402  (the CORP stage's names of the CORP steps)
from edgeprune.api import prune  # noqa: E402
from edgeprune.solve import mlp_ridge  # noqa: E402
from runners.base import peak_rss_mb, reset_peak_rss  # noqa: E402

MODELS = {"deit_small": "deit_small_patch16_224", "deit_base": "deit_base_patch16_224",
          "deit_tiny": "deit_tiny_patch16_224"}

#: The CPU bounds (issue 29): (model, smallest calibration size it applies from, max ratio) for
#: deit_small both@0.5, default settings (gram_tokens auto), 1 and 2 threads. <= 2.0x one dense
#: pass at 256 images (the exact float32 MLP statistics alone cost 0.6-0.7 of a dense pass,
#: docs/prune_cost.md) and <= 1.5x from 768 images. The GPU bound: <= 3x for deit_small and
#: deit_base at 256 and 1024 images.
CPU_BOUNDS = (("deit_small", 256, 767, 2.0), ("deit_small", 768, None, 1.5))
GPU_BOUNDS = (("deit_small", 256, None, 3.0), ("deit_base", 256, None, 3.0))


def bound_for(r: dict) -> float | None:
    """The issue-29 bound on the ratio for this row, or None (no bound: other model, size below
    the bounds, a non-default ``--gram-tokens``, another sparsity or Q/K solver)."""
    if r["gram_tokens"] is not None or r.get("sparsity", 0.5) != 0.5 or r.get("qk_solver", "auto") != "auto":
        return None
    table = CPU_BOUNDS if r["device"] == "cpu" else GPU_BOUNDS
    if r["device"] == "cpu" and r["threads"] not in (1, 2):
        return None
    for model, lo, hi, limit in table:
        if r["model"] == model and r["images"] >= lo and (hi is None or r["images"] <= hi):
            return limit
    return None


def verdict(r: dict) -> str:
    """``met (<= 2.0x)`` / ``NOT met (<= 1.5x)`` on the median wall ratio, ``-`` without a bound."""
    limit = bound_for(r)
    if limit is None:
        return "-"
    return f"{'met' if r['ratio'] <= limit else 'NOT met'} (<= {limit:g}x)"


class PhaseTimer:
    """Wraps CORP's phase functions (as ``edgeprune.pruning.corp`` names them) with wall-clock timers for one prune."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.t = {"ranking": 0.0, "solve": 0.0, "apply": 0.0}
        self.solvers: dict[str, int] = {}
        self._orig: list[tuple[object, str, object]] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _wrap(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._sync()
                self.t[key] += time.perf_counter() - t0

        self._orig.append((owner, name, fn))
        setattr(owner, name, timed)

    def __enter__(self) -> "PhaseTimer":
        self._wrap(corp, "plan_corp", "ranking")
        self._wrap(corp, "apply_corp", "apply")
        self._wrap(mlp_ridge, "ridge_affine_map", "solve")
        make = corp.qk_solver_from_grams

        def solver_from_grams(*a, **kw):
            solve = make(*a, **kw)

            def timed(i, h):
                t0 = time.perf_counter()
                m, lam, info = solve(i, h)
                self.t["solve"] += time.perf_counter() - t0
                kind = info["solver"].split(":")[0]
                self.solvers[kind] = self.solvers.get(kind, 0) + 1
                return m, lam, info
            return timed

        self._orig.append((corp, "qk_solver_from_grams", make))
        corp.qk_solver_from_grams = solver_from_grams
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._orig):
            setattr(owner, name, fn)


@torch.no_grad()
def dense_pass(model, images: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """Seconds of one forward pass over ``images`` in batches (images moved batch by batch)."""
    model.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(images), batch_size):
        model(images[i:i + batch_size].to(device, non_blocking=True))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    model.to("cpu")
    return seconds, cpu


def one_prune(model, spec, images, args, device: torch.device) -> dict:
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PhaseTimer(device) as pt:
        t0, c0 = time.perf_counter(), time.process_time()
        res = prune(model, images, target="both", sparsity=args.sparsity, qk_solver=args.qk_solver,
                    spec=spec, batch_size=args.batch_size, device=str(device), gram_tokens=args.gram_tokens_now)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats_s = res.record["timing"]["calibration_s"]
    row = {"gram_tokens_used": res.record["settings"].get("gram_tokens_used", 0), "prune_s": total, "prune_cpu_s": cpu, "statistics_s": stats_s, "ranking_s": pt.t["ranking"], "solve_s": pt.t["solve"],
           "surgery_s": pt.t["apply"] - pt.t["solve"],
           "other_s": total - stats_s - pt.t["ranking"] - pt.t["apply"],
           "peak_rss_mb": peak_rss_mb(), "qk_solvers": dict(pt.solvers)}
    if device.type == "cuda":
        row["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    return row


def run_case(model_key: str, n: int, threads: int, device: torch.device, args) -> dict:
    torch.set_num_threads(threads)
    spec, model = common.model(MODELS[model_key], random_init=True)
    images = common.noise(spec, n, 0)
    dense, dense_cpu, prunes = [], [], []
    for _ in range(args.repeats):
        wall, cpu = dense_pass(model, images, args.batch_size, device)
        dense.append(wall)
        dense_cpu.append(cpu)
        prunes.append(one_prune(model, spec, images, args, device))
    med = {k: statistics.median(p[k] for p in prunes)
           for k in prunes[0] if k.endswith("_s") or k.endswith("_mb")}
    ratios = [p["prune_s"] / d for p, d in zip(prunes, dense)]
    cpu_ratios = [p["prune_cpu_s"] / d for p, d in zip(prunes, dense_cpu)]
    return {"model": model_key, "images": n, "threads": threads, "device": str(device),
            "sparsity": args.sparsity, "qk_solver": args.qk_solver,
            "gram_tokens": args.gram_tokens_now, "gram_tokens_used": prunes[-1]["gram_tokens_used"],
            "dense_s": statistics.median(dense), **med, "ratio": statistics.median(ratios),
            "cpu_ratio": statistics.median(cpu_ratios), "dense_cpu_s": statistics.median(dense_cpu),
            "ratios": ratios, "dense_runs": dense, "prune_runs": [p["prune_s"] for p in prunes],
            "qk_solvers": prunes[-1]["qk_solvers"]}


def fmt(r: dict) -> str:
    gpu = f"{r['peak_gpu_mb']:.0f}" if "peak_gpu_mb" in r else "-"
    solvers = " ".join(f"{k}:{v}" for k, v in sorted(r["qk_solvers"].items()))
    used = r.get("gram_tokens_used") or "all"
    tokens = f"auto ({used})" if r["gram_tokens"] is None else (r["gram_tokens"] or "all")
    return (f"| {r['model']} | {r['images']} | {tokens} | {r['device']} | {r['threads']} | "
            f"{r['dense_s']:.1f} | "
            f"{r['prune_s']:.1f} | {r['statistics_s']:.1f} | {r['ranking_s']:.2f} | {r['solve_s']:.2f} | "
            f"{r['surgery_s']:.2f} | {r['other_s']:.2f} | **{r['ratio']:.2f}** | {r['cpu_ratio']:.2f} | {r['peak_rss_mb']:.0f} | {gpu} | "
            f"{solvers} | {verdict(r)} |")


HEADER = ("| model | images | MLP tokens / image | device | threads | dense s | prune s | statistics s | ranking s | "
          "solve s | surgery s | other s | ratio | CPU-time ratio | peak RSS MiB | peak GPU MiB | Q/K solvers | "
          "bound |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def summary(rows: list[dict]) -> list[str]:
    """One line per bound of the issue: met / not met over every measured row it applies to."""
    out = []
    for device, table in (("cpu", CPU_BOUNDS), ("cuda", GPU_BOUNDS)):
        for model, lo, hi, limit in table:
            span = f"{lo}-{hi}" if hi is not None else f">= {lo}"
            hits = [r for r in rows if r["device"].split(":")[0] == device and bound_for(r) == limit
                    and r["model"] == model and r["images"] >= lo and (hi is None or r["images"] <= hi)]
            state = ("not measured" if not hits else
                     "met" if all(r["ratio"] <= limit for r in hits) else "NOT met")
            worst = f", worst {max(r['ratio'] for r in hits):.2f}x" if hits else ""
            out.append(f"bound {device} {model} {span} images <= {limit:g}x: {state} ({len(hits)} rows{worst})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="deit_small", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--sizes", default="256", help="calibration sizes, e.g. 64,256,1024")
    ap.add_argument("--threads", default="1,2", help="torch intra-op thread counts (CPU rows)")
    ap.add_argument("--devices", default="cpu", help="cpu, cuda (cuda rows are skipped without CUDA)")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--qk-solver", default="auto", choices=["auto", "direct", "cg"])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--gram-tokens", default="auto",
                    help="comma list of MLP tokens per image for the statistics (CorpConfig.gram_tokens; 0 = all, "
                         "auto = the default rule) [auto]")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(HEADER, flush=True)
    for dev_name in args.devices.split(","):
        device = torch.device(dev_name)
        if device.type == "cuda" and not torch.cuda.is_available():
            print(f"(skipping {dev_name}: CUDA is not available)", file=sys.stderr)
            continue
        thread_list = [int(t) for t in args.threads.split(",")] if device.type == "cpu" else [torch.get_num_threads()]
        for model_key in args.models.split(","):
            for n in (int(s) for s in args.sizes.split(",")):
                for t in thread_list:
                    for k in (None if v == "auto" else int(v) for v in args.gram_tokens.split(",")):
                        args.gram_tokens_now = k
                        r = run_case(model_key, n, t, device, args)
                        rows.append(r)
                        print(fmt(r), flush=True)
    for line in summary(rows):
        print(line, flush=True)
    if args.json:
        common.write_json(args.json, {"torch": torch.__version__, "rows": rows, "bounds": summary(rows)},
                          "bench_prune_cost", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
