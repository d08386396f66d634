"""Dense vs CORP-pruned latency on one backend, next to the FLOPs ratio (dense A and pruned B interleaved).

For each model (a zoo name or a timm name; timm models are random-init unless ``--pretrained``:
structured pruning fixes the kept dims from the sparsity and ``round_to`` alone, so latency does not
depend on the weights) and each pruned variant (``--sparsities`` x ``--round-to`` x ``--layouts``,
CORP ``--target``, calibrated on ``--calib-size`` images), the dense model (A) and the variant (B) run
interleaved in one process (``runners.compare.bench_pair``: A B A B ...) at each batch size, on

* ``--backend onnxruntime`` (default): opset-17 ONNX exports on the CPU (each pruned export checked
  against PyTorch on 2 noise images); ``--int8`` adds the pruned export quantized to int8
  (``exporters.quantization.quantize_onnx``: static QDQ, per-channel symmetric weights, MinMax;
  ``--asymmetric-activations``: uint8 activations, ONNX Runtime's fast U8S8 path);
* ``--backend tensorrt``: an engine per export for the device profile ``--device`` (default rtx3090),
  checked against ONNX Runtime, with the attention-fusion verdict;
* ``--backend torch``: the PyTorch runner on ``--device`` (cuda or cpu) at each of ``--precisions``
  (fp32 / tf32 / fp16 / bf16) and ``--graphs`` (eager, or CUDA graphs), with the SDPA kernel each
  model ran (``runners.attention_kernels``).

The table gives per row the p50 latencies, the per-pair latency ratio dense/pruned (median and
p10-p90; > 1 = the pruned model is faster), the throughput ratio pruned/dense, the FLOPs and params
ratios pruned/dense, the file size against the dense file's, and the kernel / fusion / check notes.
``--round-to-sweep`` compares round_to 8, 16, 32, 1 at ``--sweep-sparsity``.

Examples::

    python benchmarks/bench_latency.py --models deit_small_patch16_224 --sparsities 0.3,0.5,0.7 --threads 1
    python benchmarks/bench_latency.py --models deit_small_patch16_224 --sparsities 0.5 --batch-sizes 8 --int8
    python benchmarks/bench_latency.py --backend torch --device cuda --models deit_small,deit_base \\
        --sparsities 0.5,0.7 --batch-sizes 1,64,256 --precisions fp16,bf16,tf32 --graphs eager,graphs
    python benchmarks/bench_latency.py --backend tensorrt --device rtx3090 --models fmnist-vit --sparsities 0.25,0.5

(Replaces tools/bench_onnx_speedup.py, tools/quant_latency.py, tools/workstation_bench.py and
tools/bench_gpu.py of commit aaaa9c3; docs/experiments.md.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402
from edgeprune.errors import UserError  # noqa: E402

#: short names of the timm DeiTs
ALIASES = {"deit_tiny": "deit_tiny_patch16_224", "deit_small": "deit_small_patch16_224",
           "deit_base": "deit_base_patch16_224"}
BACKENDS = ("onnxruntime", "tensorrt", "torch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="deit_small_patch16_224", help="comma list of zoo / timm names")
    ap.add_argument("--backend", choices=BACKENDS, default="onnxruntime")
    ap.add_argument("--device", default=None,
                    help="tensorrt: device profile [rtx3090]; torch: cuda or cpu [cuda]")
    ap.add_argument("--sparsities", default="0.3,0.5,0.7")
    ap.add_argument("--target", default="both", choices=["mlp", "attn", "both"])
    ap.add_argument("--round-to", default="8", help="comma list of round_to values [8]")
    ap.add_argument("--round-to-sweep", action="store_true", help="round_to 8,16,32,1 at --sweep-sparsity")
    ap.add_argument("--sweep-sparsity", type=float, default=0.5)
    ap.add_argument("--layouts", default="default", help="comma list of default / fused [default]")
    ap.add_argument("--int8", action="store_true", help="onnxruntime: also the pruned model quantized to int8")
    ap.add_argument("--asymmetric-activations", action="store_true", help="--int8 with uint8 activations")
    ap.add_argument("--precisions", default="fp32", help="torch: comma list of fp32, tf32, fp16, bf16")
    ap.add_argument("--graphs", default=None, help="torch / tensorrt: comma list of eager, graphs "
                    "[torch: eager; tensorrt: the profile's]")
    ap.add_argument("--batch-sizes", default=None, help="[1,8; tensorrt: the profile's]")
    ap.add_argument("--iterations", type=int, default=None, help="timed pairs per batch size [50; tensorrt: profile]")
    ap.add_argument("--warmup", type=int, default=None, help="untimed pairs per batch size [10; tensorrt: profile]")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads [ORT's default]")
    ap.add_argument("--calib-size", type=int, default=8, help="calibration images (noise unless --pretrained)")
    ap.add_argument("--pretrained", action="store_true", help="real weights, and the zoo model's calibration data")
    ap.add_argument("--force-device", action="store_true", help="tensorrt: build for another compute capability")
    ap.add_argument("--no-verify", action="store_true", help="skip the ONNX vs PyTorch check")
    ap.add_argument("--work-dir", type=Path, default=None, help="keep the exported files here [a temporary folder]")
    ap.add_argument("--json", type=Path, default=None, help="write all rows as JSON")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.models = [ALIASES.get(m, m) for m in common.names(args.models)]
    args.device = args.device or {"tensorrt": "rtx3090", "torch": "cuda"}.get(args.backend, "cpu")
    if args.round_to_sweep:
        args.sparsities, args.round_to = [args.sweep_sparsity], [8, 16, 32, 1]
    else:
        args.sparsities, args.round_to = common.floats(args.sparsities), common.ints(args.round_to)
    args.layouts, args.precisions = common.names(args.layouts), common.names(args.precisions)
    args.graphs = common.names(args.graphs) if args.graphs else ["eager" if args.backend == "torch" else None]
    if args.int8 and args.backend != "onnxruntime":
        ap.error("--int8 needs --backend onnxruntime")
    if args.backend != "torch" and args.precisions != ["fp32"]:
        ap.error("--precisions is a torch setting (ONNX files are fp32; int8: --int8)")
    return args


def bench_settings(args: argparse.Namespace) -> tuple[list[int], int, int]:
    """(batch sizes, iterations, warm-up): the command line's, else the TensorRT profile's or 1,8 / 50 / 10."""
    bench = None
    if args.backend == "tensorrt":
        from devices import load_profile

        bench = load_profile(args.device).bench
    sizes = common.ints(args.batch_sizes) if args.batch_sizes else list(bench.batch_sizes if bench else (1, 8))
    iterations = args.iterations or (bench.iterations if bench else 50)
    warmup = args.warmup if args.warmup is not None else (bench.warmup if bench else 10)
    if iterations < 1 or warmup < 0 or not sizes or min(sizes) < 1:
        raise UserError("need --iterations >= 1, --warmup >= 0 and positive batch sizes")
    return sizes, iterations, warmup


def check_backend(args: argparse.Namespace) -> None:
    """UserError before any pruning when the backend cannot run here."""
    if args.backend == "torch" and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("CUDA is not available (--device cpu --precisions fp32 --graphs eager for a smoke run)")
    if args.backend == "tensorrt":
        from exporters.tensorrt import require_gpu, tensorrt_version

        tensorrt_version()
        require_gpu()


def _as_tensor(calib: Any) -> torch.Tensor:
    """The calibration images as one (N, C, H, W) tensor (a zoo source is read in batches)."""
    if isinstance(calib, torch.Tensor):
        return calib
    return torch.cat([x for x, _ in calib.batches(64)])


def pruned_variants(spec: Any, dense: torch.nn.Module, calib: Any, args: argparse.Namespace) -> list[tuple]:
    """[(label, pruned model, run record, prune seconds)] for every sparsity x round_to x layout."""
    from edgeprune.api import prune

    device = args.device if args.backend == "torch" else "cpu"
    out = []
    for s in args.sparsities:
        for round_to in args.round_to:
            for layout in args.layouts:
                label = f"{args.target}@{s:g}" + (f" r{round_to}" if len(args.round_to) > 1 else "") + \
                    (" fused" if layout == "fused" else "")
                common.log(f"   prune {label}")
                t0 = time.perf_counter()
                res = prune(dense, calib, target=args.target, sparsity=s, round_to=round_to, layout=layout,
                            spec=spec, progress=False, device=device)
                out.append((label, res.model.to("cpu").eval(), res.record, time.perf_counter() - t0))
    return out


def open_runners(m: torch.nn.Module, tag: str, spec: Any, record: dict | None, calib: Any, setting: tuple,
                 work: Path, args: argparse.Namespace) -> Iterator[tuple[str, Any, dict]]:
    """Yield (suffix, runner, notes) for one model on the backend (onnxruntime with ``--int8``: two)."""
    from runners.registry import make_runner

    if args.backend == "torch":
        from runners.attention_kernels import attention_kernels, describe
        from runners.torch_runner import TorchRunner

        precision, mode = setting
        r = TorchRunner(m, device=args.device, precision=precision, cuda_graphs=mode == "graphs", label=tag,
                        input_shape=spec.input_size)
        x1 = torch.randn(1, *spec.input_size).to(args.device, r.dtype)
        yield "", r, {"kernel": describe(attention_kernels(r.model, x1))}
        m.to("cpu", torch.float32)
        return
    from exporters.onnx import build_metadata, export_onnx

    path = export_onnx(m, work / f"{tag}.onnx", spec.input_size, build_metadata(record=record, spec=spec, model=m))
    notes: dict[str, Any] = {"file_mb": path.stat().st_size / 2**20}
    if record is not None and not args.no_verify:
        from exporters.verify import verify_onnx

        x = torch.randn(2, *spec.input_size, generator=torch.Generator().manual_seed(1))
        notes["max_abs_diff"] = verify_onnx(path, m, x)["max_abs_diff"]
    if args.backend == "tensorrt":
        yield "", *_trt_runner(path, tag, spec, setting, work, args, notes)
        return
    yield "", make_runner(str(path), "onnxruntime", threads=args.threads), notes
    if args.int8 and record is not None:
        from exporters.quantization import QuantizeConfig, quantize_onnx

        x = _as_tensor(calib)
        q = work / f"{tag}.int8.onnx"
        quantize_onnx(path, q, QuantizeConfig(precision="int8", activation_symmetric=not args.asymmetric_activations),
                      calibration=x.numpy(), eval_source=(x[:8], None))
        yield " int8", make_runner(str(q), "onnxruntime", threads=args.threads), {"file_mb": q.stat().st_size / 2**20}


def _trt_runner(path: Path, tag: str, spec: Any, setting: tuple, work: Path, args: argparse.Namespace,
                notes: dict) -> tuple[Any, dict]:
    import numpy as np

    from exporters.tensorrt import build_engine
    from runners.registry import make_runner
    from runners.tensorrt import attention_fusion_report, check_against_onnxruntime

    engine = build_engine(path, args.device, work / f"{tag}.{Path(args.device).stem}.engine",
                          force_device=args.force_device)
    check_x = np.random.default_rng(args.seed).standard_normal((4, *spec.input_size)).astype(np.float32)
    agreement = check_against_onnxruntime(engine, path, check_x)
    notes.update(file_mb=engine.stat().st_size / 2**20, attention=attention_fusion_report(engine).verdict,
                 max_abs_diff_vs_ort=agreement.max_abs_diff)
    graphs = None if setting[1] is None else setting[1] == "graphs"
    return make_runner(str(engine), "tensorrt", profile=args.device, cuda_graphs=graphs), notes


def _row(name: str, label: str, setting: tuple, record: dict, prune_s: float, p: Any, dense_notes: dict,
         notes: dict, backend: str) -> dict:
    flops, params = common.ratios(record)
    size = notes.get("file_mb")
    return {"model": name, "variant": label, "backend": backend, "precision": setting[0], "mode": setting[1],
            "batch_size": p.batch_size, "flops_ratio": flops, "params_ratio": params,
            "dense_p50_ms": p.a.latency_ms["p50"], "pruned_p50_ms": p.b.latency_ms["p50"],
            "speedup_median": p.latency_ratio["median"], "speedup_p10": p.latency_ratio["p10"],
            "speedup_p90": p.latency_ratio["p90"], "throughput_ratio": p.throughput_ratio,
            "dense_img_s": p.a.throughput, "pruned_img_s": p.b.throughput,
            "size_ratio": size / dense_notes["file_mb"] if size and dense_notes.get("file_mb") else None,
            "dense_notes": dense_notes, "notes": notes, "prune_s": prune_s, "blocks": record["blocks"],
            "settings": p.b.settings, "versions": p.b.versions}


def run(args: argparse.Namespace) -> list[dict]:
    from runners.compare import bench_pair

    sizes, iterations, warmup = bench_settings(args)
    settings = [(p, g) for p in args.precisions for g in args.graphs]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="edgeprune-latency-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    try:
        for name in args.models:
            common.log(f"== {name}")
            spec, dense = common.model(name, random_init=not args.pretrained)
            calib = common.calibration(spec, args.calib_size, args.seed, real=args.pretrained)
            variants = pruned_variants(spec, dense, calib, args)
            stem = name.replace("/", "_")
            for setting in settings:
                _, ra, dense_notes = next(open_runners(dense, f"{stem}-dense", spec, None, calib, setting, work, args))
                ra.label = f"{name} dense"
                for label, m, record, prune_s in variants:
                    tag = f"{stem}-{label.replace('@', '-').replace(' ', '-')}"
                    for suffix, rb, notes in open_runners(m, tag, spec, record, calib, setting, work, args):
                        rb.label = f"{name} {label}{suffix}"
                        for p in bench_pair(ra, rb, sizes, iterations, warmup, seed=args.seed):
                            row_setting = ("int8", setting[1]) if suffix == " int8" else setting
                            rows.append(_row(name, label + suffix, row_setting, record, prune_s, p, dense_notes,
                                             notes, args.backend))
                            print(markdown(rows[-1:], header=False), flush=True)
                        rb.close()
                ra.close()
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return rows


HEADER = ("| model | variant | backend | precision | mode | batch | FLOPs pruned/dense | params pruned/dense | "
          "dense p50 ms | pruned p50 ms | latency dense/pruned median [p10–p90] | throughput pruned/dense | "
          "size pruned/dense | dense notes | pruned notes |\n"
          "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")


def _notes(n: dict) -> str:
    parts = [str(n[k]) for k in ("attention", "kernel") if k in n]
    parts += [f"max abs diff {n[k]:.1e}" for k in ("max_abs_diff", "max_abs_diff_vs_ort") if n.get(k) is not None]
    return ", ".join(parts) or "-"


def markdown(rows: list[dict], header: bool = True) -> str:
    """The table: one row per (model, variant, precision, mode, batch size)."""
    out = [HEADER] if header else []
    for r in rows:
        size = "-" if r["size_ratio"] is None else f"{r['size_ratio']:.2f}"
        out.append(f"| {r['model']} | {r['variant']} | {r['backend']} | {r['precision']} | {r['mode'] or '-'} | "
                   f"{r['batch_size']} | {r['flops_ratio']:.3f} | {r['params_ratio']:.3f} | {r['dense_p50_ms']:.2f} | "
                   f"{r['pruned_p50_ms']:.2f} | {r['speedup_median']:.3f} [{r['speedup_p10']:.3f}–"
                   f"{r['speedup_p90']:.3f}] | {r['throughput_ratio']:.3f} | {size} | {_notes(r['dense_notes'])} | "
                   f"{_notes(r['notes'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_backend(args)
        sizes, iterations, warmup = bench_settings(args)
        print(f"{common.machine()}; backend {args.backend} on {args.device}, {iterations} interleaved pairs "
              f"after {warmup} warm-up pairs, {'pretrained' if args.pretrained else 'random-init'} weights\n")
        print(HEADER, flush=True)
        rows = run(args)
    except UserError as err:  # RuntimeFault (missing backend, full disk) is a subclass: exit 1
        print(f"error: {err}", file=sys.stderr)
        return int(getattr(err, "exit_code", 2))
    if args.json is not None:
        print(f"\nwrote {common.write_json(args.json, {'rows': rows}, 'bench_latency', argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
