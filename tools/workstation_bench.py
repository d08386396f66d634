"""Dense vs pruned latency on one machine: prune -> ONNX -> TensorRT engine -> benchmark.

    python tools/workstation_bench.py --model fmnist-vit --sparsities 0.25,0.5 --device rtx3090 \\
        --out runs/workstation-bench

For the dense model and each sparsity: prune with ``edgeprune.api.prune`` (CORP, ``--target``),
export with ``exporters.onnx.export_onnx``, then

* with TensorRT 10 and a GPU: build an engine for the device profile (``--device``), check it
  against ONNX Runtime, report whether attention was fused, and time it (CUDA events);
* otherwise (or with ``--no-trt``): time the ONNX file with ONNX Runtime on the CPU.

Writes ``results.md`` (one table), ``results.json`` (rows + every BenchResult + environment) and
``latency.png`` (p50 latency and speed-up vs sparsity, one line per batch size) into ``--out``.
Batch sizes, warm-up and iterations default to the device profile's ``[bench]`` settings (the
``cpu`` profile's when TensorRT is not used).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeprune.atomic import atomic_write_text  # noqa: E402
from edgeprune.errors import UserError  # noqa: E402


def _parse_floats(text: str) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--sparsities: expected comma-separated numbers, got {text!r}") from None
    bad = [v for v in vals if not 0.0 < v < 1.0]
    if bad:
        raise UserError(f"--sparsities must lie in (0, 1), got {bad[0]}")
    return sorted(set(vals))


def _parse_ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--batch-sizes: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise UserError(f"--batch-sizes must be positive integers, got {text!r}")
    return vals


def calibration_tensor(model_name: str, input_size: tuple[int, ...], n: int, seed: int) -> tuple[Any, str]:
    """Calibration images for pruning: the model's own data where edgeprune ships a loader,
    else seeded noise (latency does not depend on it; accuracy is not measured here)."""
    import torch

    if model_name == "fmnist-vit":
        try:
            from edgeprune.data.fashion_mnist import load_split

            x, _ = load_split("train")
            idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
            return x[idx], f"Fashion-MNIST train, {n} images"
        except UserError as err:
            print(f"note: {err}; calibrating on noise", file=sys.stderr)
    elif model_name == "dinov2-s14":
        try:
            from edgeprune.data.photos import calibration_photos

            return calibration_photos(n, seed=seed), f"shipped calibration photos, {n} crops"
        except Exception as err:  # optional data package missing
            print(f"note: calibration photos unavailable ({err}); calibrating on noise", file=sys.stderr)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *input_size, generator=g), f"seeded noise, {n} images"


def tensorrt_status(no_trt: bool) -> tuple[bool, str]:
    """(use TensorRT?, why not)."""
    if no_trt:
        return False, "--no-trt"
    from exporters.tensorrt import require_gpu, tensorrt_version

    try:
        tensorrt_version()
        require_gpu()
        import runners.tensorrt.runner  # noqa: F401
    except UserError as err:
        return False, str(err)
    return True, ""


def _count_params(model: Any) -> int:
    return int(sum(p.numel() for p in model.parameters()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from devices import load_profile
    from edgeprune.api import prune
    from edgeprune.loading import load_run_or_model
    from exporters.onnx import export_onnx

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sparsities = _parse_floats(args.sparsities)
    use_trt, why_not = tensorrt_status(args.no_trt)
    profile = load_profile(args.device if use_trt else "cpu")
    if use_trt and not profile.uses_tensorrt:
        raise UserError(f"--device {args.device} is not a TensorRT profile")
    if not use_trt:
        print(f"TensorRT not used ({why_not}): benchmarking ONNX Runtime on the CPU", file=sys.stderr)
    batch_sizes = _parse_ints(args.batch_sizes) or list(profile.bench.batch_sizes)
    iterations = args.iterations or profile.bench.iterations
    warmup = args.warmup if args.warmup is not None else profile.bench.warmup

    model, _rec, spec = load_run_or_model(None, args.model, Path(args.checkpoint) if args.checkpoint else None,
                                    args.random_init)
    input_size = tuple(int(d) for d in spec.input_size)
    calib, calib_desc = calibration_tensor(args.model, input_size, args.calib_size, args.seed)
    check_x = np.random.default_rng(args.seed).standard_normal((4, *input_size)).astype(np.float32)

    variants: list[tuple[float, Any, dict[str, Any] | None]] = [(0.0, model, None)]
    for s in sparsities:
        t0 = time.perf_counter()
        res = prune(model, calib, target=args.target, sparsity=s)
        print(f"pruned {args.model} at sparsity {s:g} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        variants.append((s, res.model, res.record))

    rows: list[dict[str, Any]] = []
    all_results: list[dict[str, Any]] = []
    dense_p50: dict[int, float] = {}
    for s, m, record in variants:
        tag = f"{args.model.replace('/', '_')}-{'dense' if s == 0 else f'{args.target}-{s:g}'}"
        onnx_path = out / f"{tag}.onnx"
        metadata: dict[str, Any] = {}
        try:
            from exporters.onnx import build_metadata

            metadata = build_metadata(record=record, spec=spec, model=m, model_name=args.model)
        except Exception as err:  # metadata is a nicety here
            print(f"note: no ONNX metadata for {tag} ({err})", file=sys.stderr)
        export_onnx(m, onnx_path, input_size, metadata)
        extra: dict[str, Any] = {"onnx_mb": round(onnx_path.stat().st_size / 2**20, 2)}
        if use_trt:
            from exporters.tensorrt import build_engine
            from runners.tensorrt import attention_fusion_report, bench_engine, check_against_onnxruntime

            engine = build_engine(onnx_path, profile, out / f"{tag}.{profile.name}.engine",
                                  force_device=args.force_device)
            agreement = check_against_onnxruntime(engine, onnx_path, check_x)
            fusion = attention_fusion_report(engine)
            extra.update(engine_mb=round(engine.stat().st_size / 2**20, 2), attention=fusion.verdict,
                         max_abs_diff_vs_ort=agreement.max_abs_diff, agrees_with_ort=agreement.agrees)
            results = bench_engine(engine, profile, batch_sizes, iterations, warmup,
                                   cuda_graphs=None if args.cuda_graphs is None else args.cuda_graphs)
        else:
            from runners.registry import make_runner

            runner = make_runner(str(onnx_path), "onnxruntime", provider="cpu", threads=args.threads)
            runner.label = tag
            try:
                results = runner.benchmark(batch_sizes, iterations, warmup)
            finally:
                runner.close()
        params = _count_params(m)
        for r in results:
            p50 = r.latency_ms["p50"]
            if s == 0:
                dense_p50[r.batch_size] = p50
            base = dense_p50.get(r.batch_size)
            rows.append({
                "model": args.model, "sparsity": s, "target": "-" if s == 0 else args.target,
                "params": params, "backend": r.backend, "device": r.device, "batch": r.batch_size,
                "p50_ms": p50, "p90_ms": r.latency_ms["p90"], "mean_ms": r.latency_ms["mean"],
                "img_per_s": r.throughput, "speedup_p50": (base / p50) if base and p50 > 0 else None,
                "peak_mb": r.peak_memory_mb, **extra,
            })
            all_results.append({"variant": tag, "sparsity": s, **r.to_dict()})
    doc = {
        "command": "tools/workstation_bench.py", "argv": sys.argv[1:],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(),
        "backend": "tensorrt" if use_trt else "onnxruntime", "tensorrt_skipped_because": why_not or None,
        "device_profile": profile.to_dict(), "calibration": calib_desc,
        "batch_sizes": batch_sizes, "iterations": iterations, "warmup": warmup,
        "rows": rows, "results": all_results,
    }
    atomic_write_text(out / "results.json", json.dumps(doc, indent=2, default=str) + "\n")
    atomic_write_text(out / "results.md", markdown(rows, doc) + "\n")
    try:
        plot(rows, out / "latency.png", title=f"{args.model} on {rows[0]['device'] if rows else '?'} ({doc['backend']})")
    except ImportError:
        print("note: matplotlib not installed; no plot", file=sys.stderr)
    return doc


def markdown(rows: list[dict[str, Any]], doc: dict[str, Any]) -> str:
    """The results table (one row per variant and batch size)."""
    has_trt = any("engine_mb" in r for r in rows)
    head = ["model", "sparsity", "params", "backend", "batch", "p50 ms", "p90 ms", "img/s", "speed-up (p50)", "peak MiB"]
    if has_trt:
        head += ["engine MiB", "attention", "max |Δ| vs ORT"]
    lines = [f"# {rows[0]['model'] if rows else ''} dense vs pruned ({doc['backend']}, {rows[0]['device'] if rows else ''})",
             "", f"Calibration: {doc['calibration']}. {doc['warmup']} warm-up + {doc['iterations']} timed "
             "inferences per batch size.", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" if h in ("model", "sparsity", "backend", "attention") else "---:" for h in head) + "|"]
    for r in rows:
        cells = [r["model"], "dense" if r["sparsity"] == 0 else f"{r['target']} {r['sparsity']:g}",
                 f"{r['params']:,}", r["backend"], str(r["batch"]), f"{r['p50_ms']:.3f}", f"{r['p90_ms']:.3f}",
                 f"{r['img_per_s']:.0f}", "-" if r["speedup_p50"] is None else f"{r['speedup_p50']:.2f}x",
                 "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"]
        if has_trt:
            cells += [f"{r.get('engine_mb', 0):.1f}", str(r.get("attention", "-")),
                      f"{r.get('max_abs_diff_vs_ort', float('nan')):.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """p50 latency and speed-up vs sparsity, one line per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for bs in sorted({r["batch"] for r in rows}):
        pts = sorted((r["sparsity"], r["p50_ms"], r["speedup_p50"] or 1.0) for r in rows if r["batch"] == bs)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {bs}")
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"batch {bs}")
    ax1.set_xlabel("sparsity")
    ax1.set_ylabel("p50 latency (ms)")
    ax2.set_xlabel("sparsity")
    ax2.set_ylabel("speed-up vs dense (p50)")
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fmnist-vit", help="fmnist-vit, dinov2-s14 or a timm ViT name")
    ap.add_argument("--checkpoint", default=None, help="weights for a timm model")
    ap.add_argument("--random-init", action="store_true", help="timm model without weights (latency only)")
    ap.add_argument("--sparsities", default="0.25,0.5", help="comma-separated, in (0, 1) [0.25,0.5]")
    ap.add_argument("--target", choices=["mlp", "attn", "both"], default="both")
    ap.add_argument("--calib-size", type=int, default=128, help="calibration images [128]")
    ap.add_argument("--device", default="rtx3090", help="TensorRT device profile (name or .toml) [rtx3090]")
    ap.add_argument("--force-device", action="store_true", help="build on a GPU of another compute capability")
    ap.add_argument("--no-trt", action="store_true", help="ONNX Runtime on the CPU even if TensorRT is there")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated [the profile's]")
    ap.add_argument("--iterations", type=int, default=None, help="[the profile's]")
    ap.add_argument("--warmup", type=int, default=None, help="[the profile's]")
    ap.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=None)
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/workstation-bench", help="output folder [runs/workstation-bench]")
    args = ap.parse_args(argv)
    try:
        doc = run(args)
    except UserError as err:  # RuntimeFault (missing backend, full disk) is a subclass: exit 1
        print(f"error: {err}", file=sys.stderr)
        return int(getattr(err, "exit_code", 2))
    print((Path(args.out) / "results.md").read_text())
    print(f"wrote {args.out}/results.md, results.json, latency.png ({len(doc['rows'])} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
