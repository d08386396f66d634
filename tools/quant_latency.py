"""ONNX Runtime CPU latency of dense fp32 vs pruned fp32 / int8 on a MatMul-bound ViT.

Complements ``tools/quant_table.py`` (accuracy on fmnist-vit, a 1.2 M-parameter model whose cost is
not dominated by MatMuls): a random-init timm DeiT is pruned with CORP (target both), exported,
quantized to int8 with ``exporters.quantization.quantize.quantize_onnx`` (static QDQ, per-channel symmetric
weights, MinMax), and dense fp32, pruned fp32 and pruned int8 run interleaved in one process
(``runners.compare.bench_pair`` via ``edgeprune bench``'s library path), one intra-op thread.
Random weights: latency only, no accuracy.

    python tools/quant_latency.py --model deit_small_patch16_224 --sparsity 0.5 --batch-size 8 --iterations 10
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import edgeprune
from exporters.onnx import export_onnx
from exporters.quantization.quantize import QuantizeConfig, quantize_onnx


def p50_ms(sess, x: np.ndarray, iterations: int) -> list[float]:
    out = []
    for _ in range(iterations):
        t = time.perf_counter()
        sess.run(None, {"input": x})
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deit_small_patch16_224")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calib-size", type=int, default=16)
    ap.add_argument("--asymmetric-activations", action="store_true",
                    help="uint8 activations (ONNX Runtime's fast U8S8 path on x86; TensorRT needs the default)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    import onnxruntime as ort

    spec = edgeprune.get_model_spec(args.model, random_init=True)
    dense = spec.create(pretrained=False)
    g = torch.Generator().manual_seed(0)
    calib = torch.randn(args.calib_size, *spec.input_size, generator=g)
    res = edgeprune.prune(dense, calib, edgeprune.CorpConfig.from_target("both", args.sparsity), batch_size=8)
    flops_ratio = res.record["flops"] / res.record["dense_flops"]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        shape = tuple(spec.input_size)
        export_onnx(dense, d / "dense.onnx", shape)
        export_onnx(res.model, d / "pruned.onnx", shape)
        cfg = QuantizeConfig(precision="int8", activation_symmetric=not args.asymmetric_activations)
        quantize_onnx(d / "pruned.onnx", d / "pruned.int8.onnx", cfg,
                      calibration=calib.numpy(), eval_source=(calib[:8], None))
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
        names = ("dense fp32", "pruned fp32", "pruned int8")
        files = ("dense.onnx", "pruned.onnx", "pruned.int8.onnx")
        sess = [ort.InferenceSession(str(d / f), so, providers=["CPUExecutionProvider"]) for f in files]
        sizes = [(d / f).stat().st_size for f in files]
        x = torch.randn(args.batch_size, *spec.input_size, generator=g).numpy()
        times: list[list[float]] = [[], [], []]
        for i in range(args.warmup + args.iterations):  # interleaved rounds
            for k, s in enumerate(sess):
                t = p50_ms(s, x, 1)[0]
                if i >= args.warmup:
                    times[k].append(t)
    p50 = [float(np.median(t)) for t in times]
    act = "uint8 (asymmetric)" if args.asymmetric_activations else "int8 (symmetric)"
    print(f"{args.model}, random init, CORP both@{args.sparsity} (FLOPs x{flops_ratio:.3f}), activations {act}, "
          f"batch {args.batch_size}, "
          f"ONNX Runtime {ort.__version__} CPU, 1 thread, {args.iterations} interleaved rounds")
    print("| model | file MB | size vs dense fp32 | p50 ms | latency vs dense fp32 |")
    print("|---|---:|---:|---:|---:|")
    for n, s, t in zip(names, sizes, p50):
        print(f"| {n} | {s / 1e6:.1f} | {s / sizes[0]:.2f} | {t:.1f} | {t / p50[0]:.2f} |")


if __name__ == "__main__":
    main()
