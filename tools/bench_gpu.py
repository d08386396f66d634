"""Dense vs pruned with the PyTorch runner on a GPU: latency, throughput, speed-up vs FLOPs ratio,
and which attention kernel ran.

    python tools/bench_gpu.py                      # DeiT-S and DeiT-B on cuda, the issue-13 table
    python tools/bench_gpu.py --models deit_small --sparsities 0.5 --batch-sizes 1,64,256 \\
        --precisions fp16,bf16,tf32 --graphs eager,graphs
    python tools/bench_gpu.py --device cpu --precisions fp32 --graphs eager --batch-sizes 1,8   # smoke run

For each model (timm, seeded random init as ``--random-init``; random weights do not change the
kernels or the timing), each sparsity (CORP ``--target`` at that sparsity, calibrated on
``--calib-size`` seeded random images; ``--layout fused`` as an extra row with ``--fused``), each
precision (fp32 / tf32 / fp16 / bf16: the model cast to that dtype, TF32 matmuls for tf32), each
mode (eager, or CUDA graphs replayed per batch size) and each batch size: the dense and the pruned
model are timed *interleaved* in one process (``runners.compare.bench_pair``: A B A B ...), so
the speed-up is the median of per-pair latency ratios. Printed per row: p50 latency of both (ms),
throughput of both (images/s), the speed-up, the FLOPs ratio dense/pruned and the speed-up as a
fraction of it, and the SDPA kernel each model ran (``runners.attention_kernels``:
``flash_attention`` needs qk_dim == v_dim, so the default layout's pruned model falls back to
another kernel: ``math`` on the CPU; on CUDA possibly ``efficient_attention``, which accepts
unequal aligned head dims -- the table says which ran).

No GPU here: the table in docs/ is filled in when one is available (``--device cpu`` runs the same
code in fp32 eager for a smoke check).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeprune.api import prune  # noqa: E402
from edgeprune.zoo.registry import get_model_spec  # noqa: E402
from runners.attention_kernels import attention_kernels, describe  # noqa: E402
from runners.compare import bench_pair  # noqa: E402
from runners.torch_runner import TorchRunner  # noqa: E402

MODELS = {"deit_small": "deit_small_patch16_224", "deit_base": "deit_base_patch16_224",
          "deit_tiny": "deit_tiny_patch16_224"}

HEADER = ("| model | pruned | precision | mode | batch | dense p50 ms | pruned p50 ms | dense img/s | pruned img/s | "
          "speed-up | FLOPs ratio | speed-up / FLOPs ratio | dense kernel | pruned kernel |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def pruned_variants(model_key: str, args) -> tuple:
    """(spec, dense model, [(label, pruned model, FLOPs ratio dense/pruned)])."""
    spec = get_model_spec(MODELS[model_key], None, True)
    dense = spec.create(pretrained=True).eval()
    g = torch.Generator().manual_seed(0)
    calib = torch.randn(args.calib_size, *spec.input_size, generator=g)
    out = []
    layouts = ["default", "fused"] if args.fused else ["default"]
    for s in (float(v) for v in args.sparsities.split(",")):
        for layout in layouts:
            res = prune(spec.create(pretrained=True), calib, target=args.target, sparsity=s, layout=layout,
                        spec=spec, progress=False, device=args.device)
            rec = res.record
            label = f"{args.target}@{s:g}" + (" fused" if layout == "fused" else "")
            out.append((label, res.model.eval(), rec["dense_flops"] / rec["flops"]))
    return spec, dense, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="deit_small,deit_base", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--sparsities", default="0.5,0.7")
    ap.add_argument("--target", default="both")
    ap.add_argument("--fused", action="store_true", help="also the --layout fused pruned model")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--precisions", default="fp16,bf16,tf32")
    ap.add_argument("--graphs", default="eager,graphs", help="comma list of eager / graphs (CUDA graphs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calib-size", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: CUDA is not available (run with --device cpu --precisions fp32 --graphs eager for a "
              "smoke run)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "CPU"
    print(f"device: {args.device} ({gpu}); torch {torch.__version__}")
    print(HEADER, flush=True)
    rows = []
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for model_key in args.models.split(","):
        spec, dense, variants = pruned_variants(model_key, args)
        for label, pruned, flops_ratio in variants:
            for precision in args.precisions.split(","):
                for mode in args.graphs.split(","):
                    ra = TorchRunner(dense, device=args.device, precision=precision, cuda_graphs=mode == "graphs",
                                     label="dense", input_shape=spec.input_size)
                    rb = TorchRunner(pruned, device=args.device, precision=precision, cuda_graphs=mode == "graphs",
                                     label=label, input_shape=spec.input_size)
                    x1 = torch.randn(1, *spec.input_size).to(args.device, ra.dtype)
                    kern_a, kern_b = describe(attention_kernels(ra.model, x1)), describe(attention_kernels(rb.model, x1))
                    for pr in bench_pair(ra, rb, batch_sizes, iterations=args.iterations, warmup=args.warmup):
                        speedup = pr.latency_ratio["median"]
                        row = {"model": model_key, "pruned": label, "precision": precision, "mode": mode,
                               "batch": pr.batch_size, "dense_p50_ms": pr.a.latency_ms["p50"],
                               "pruned_p50_ms": pr.b.latency_ms["p50"], "dense_ips": pr.a.throughput,
                               "pruned_ips": pr.b.throughput, "speedup": speedup, "flops_ratio": flops_ratio,
                               "fraction_of_flops_ratio": speedup / flops_ratio, "dense_kernel": kern_a,
                               "pruned_kernel": kern_b, "device": gpu}
                        rows.append(row)
                        print(f"| {model_key} | {label} | {precision} | {mode} | {pr.batch_size} | "
                              f"{row['dense_p50_ms']:.3f} | {row['pruned_p50_ms']:.3f} | {row['dense_ips']:.0f} | "
                              f"{row['pruned_ips']:.0f} | {speedup:.2f}x | {flops_ratio:.2f}x | "
                              f"{100 * row['fraction_of_flops_ratio']:.0f}% | {kern_a} | {kern_b} |", flush=True)
                    ra.close()
                    rb.close()
                    dense.to("cpu", torch.float32)
                    pruned.to("cpu", torch.float32)
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
