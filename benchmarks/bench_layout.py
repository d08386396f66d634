#!/usr/bin/env python
"""Attention layouts at equal FLOPs: Q/K-only CORP vs the fused layout vs whole heads (issue 15).

For each model (default ``deit_small_patch16_224``, random init: speed depends on the shapes only)
and each whole-model FLOPs target (default x0.6 and x0.45 of dense), three structures with the same
attention sparsity ``--attn-sparsity`` (default 0.5) in every block and the MLP hidden (a multiple
of 8, the same in every block) chosen so that the total FLOPs hit the target:

* ``qk``    Q/K-only CORP: qk_dim = d_h (1 - s), v_dim = d_h (qk_dim != v_dim)
* ``fused`` the fused layout: qk_dim = v_dim = d_h (1 - s) (ordinary MHA)
* ``heads`` whole heads: round(H (1 - s)) heads of the dense head_dim (ordinary MHA)

Then the dense model and all pruned ones run interleaved in one process (round-robin, one
forward each per round): torch eager on the CPU and ONNX Runtime CPU (opset-17 exports), both
with ``--threads`` threads (default 1). The table gives p50 latency, the speed-up dense/pruned
(of the p50s), the FLOPs ratio dense/pruned and speed-up / FLOPs ratio (1.0 = the pruned model
is as fast as its FLOPs promise), and the SDPA kernel torch ran.

``--accuracy`` adds the one-shot (no heal) top-1 of the embedded ``fmnist-vit`` pruned with CORP
at the same FLOPs targets for the same three structures (compensation on; MLP sparsity solved for
the FLOPs as above), on the Fashion-MNIST test split.

Examples::

    python benchmarks/bench_layout.py                                  # DeiT-S speed, a few minutes
    python benchmarks/bench_layout.py --models deit_small_patch16_224 --rounds 5 --skip-ort  # smoke
    python benchmarks/bench_layout.py --accuracy --skip-speed          # fmnist-vit accuracy only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402

from edgeprune.anatomy import find_anatomy  # noqa: E402
from edgeprune.flops import model_flops  # noqa: E402
from edgeprune.plan import kept_dim, kept_heads  # noqa: E402
from edgeprune.surgery import apply_structure, block_dims  # noqa: E402

LAYOUTS = ("qk", "fused", "heads")


def attention_dims(layout: str, heads: int, head_dim: int, s: float) -> tuple[int, int, int]:
    """(num_heads, qk_dim, v_dim) of one block for ``layout`` at attention sparsity s."""
    k = kept_dim(head_dim, s, 8)
    if layout == "qk":
        return heads, k, head_dim
    if layout == "fused":
        return heads, k, k
    return kept_heads(heads, s), head_dim, head_dim


def mlp_for_flops(model: torch.nn.Module, attn: tuple[int, int, int], target: float) -> tuple[int, float]:
    """MLP hidden (multiple of 8, every block) whose model FLOPs are nearest ``target`` x dense.

    Returns (mlp_hidden, achieved FLOPs ratio pruned/dense)."""
    import copy

    an = find_anatomy(model)
    dense = model_flops(an)["total"]
    n, D, depth = an.num_tokens, an.embed_dim, len(an.blocks)
    m0 = an.blocks[0].mlp_hidden
    probe = copy.deepcopy(model)
    dims = block_dims(an)
    for d in dims:
        d.update(num_heads=attn[0], qk_dim=attn[1], v_dim=attn[2])
    apply_structure(probe, dims)
    with_dense_mlp = model_flops(find_anatomy(probe))["total"]
    per_channel = 4 * n * D * depth
    m = int(round((target * dense - (with_dense_mlp - per_channel * m0)) / per_channel / 8)) * 8
    m = max(8, min(m0, m))
    ratio = (with_dense_mlp - per_channel * (m0 - m)) / dense
    return m, ratio


def structured(model: torch.nn.Module, attn: tuple[int, int, int], mlp: int) -> torch.nn.Module:
    """A copy of ``model`` with every block's (heads, qk_dim, v_dim, mlp_hidden) set (random weights)."""
    import copy

    out = copy.deepcopy(model)
    dims = block_dims(find_anatomy(out))
    for d in dims:
        d.update(num_heads=attn[0], qk_dim=attn[1], v_dim=attn[2], mlp_hidden=mlp)
    apply_structure(out, dims)
    return out.eval()


def sdpa_kernel_used(model: torch.nn.Module, x: torch.Tensor) -> str:
    """"flash" (fused CPU kernel), "math" or "other": what torch's SDPA dispatched to."""
    with torch.profiler.profile() as prof, torch.no_grad():
        model(x)
    keys = {e.key for e in prof.key_averages()}
    if any("flash_attention" in k for k in keys):
        return "flash"
    if any("attention_math" in k for k in keys):
        return "math"
    return "other"


def interleaved(runners: dict[str, object], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Round-robin timing: each round calls every runner once. Returns seconds per call."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(warmup + rounds):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    return times


def speed(args: argparse.Namespace) -> None:
    from edgeprune._compat import import_timm

    timm = import_timm()
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        torch.manual_seed(0)
        dense = timm.create_model(name, pretrained=False).eval()
        an = find_anatomy(dense)
        b0 = an.blocks[0]
        dense_flops = model_flops(an)["total"]
        models = {"dense": dense}
        meta = {"dense": ("-", f"{b0.num_heads}/{b0.qk_dim}/{b0.v_dim}/{b0.mlp_hidden}", 1.0)}
        for target in args.flops:
            for layout in LAYOUTS:
                attn = attention_dims(layout, b0.num_heads, b0.head_dim, args.attn_sparsity)
                mlp, ratio = mlp_for_flops(dense, attn, target)
                key = f"x{target:g} {layout}"
                models[key] = structured(dense, attn, mlp)
                meta[key] = (layout, f"{attn[0]}/{attn[1]}/{attn[2]}/{mlp}", ratio)
        x = torch.randn(args.batch, 3, *an.img_size, generator=torch.Generator().manual_seed(0))
        kernels = {k: sdpa_kernel_used(m, x) for k, m in models.items()}
        results = {}
        if not args.skip_torch:
            runners = {k: (lambda m=m: m(x)) for k, m in models.items()}
            with torch.no_grad():
                results["torch"] = interleaved(runners, args.rounds, args.warmup)
        if not args.skip_ort:
            results["ort"] = _ort_times(models, x, args)
        print(f"\n### {name}, batch {args.batch}, {args.threads} thread(s), {args.rounds} interleaved rounds, "
              f"attention sparsity {args.attn_sparsity:g}; dense {dense_flops / 1e9:.2f} GFLOPs\n")
        cols = " | ".join(f"{b} p50 ms | {b} speed-up | {b} speed-up / FLOPs ratio" for b in results)
        print(f"| model | layout | heads/qk/v/mlp | FLOPs x | SDPA kernel | {cols} |")
        print("|" + "---|" * (5 + 3 * len(results)))
        p50 = {b: {k: statistics.median(t) for k, t in res.items()} for b, res in results.items()}
        for key, (layout, dims, ratio) in meta.items():
            cells = []
            for b in results:
                su = p50[b]["dense"] / p50[b][key]
                cells.append(f"{p50[b][key] * 1e3:.1f} | {su:.2f} | {su * ratio:.2f}")
            print(f"| {key} | {layout} | {dims} | {ratio:.3f} | {kernels[key]} | {' | '.join(cells)} |")


def _ort_times(models: dict, x: torch.Tensor, args: argparse.Namespace) -> dict[str, list[float]]:
    import onnxruntime as ort

    from exporters.onnx import export_onnx

    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.inter_op_num_threads = 1
    sessions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, m in models.items():
            path = export_onnx(m, Path(tmp) / f"{len(sessions)}.onnx", tuple(x.shape[1:]), {})
            sessions[k] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feed = {"input": x.numpy()}
    runners = {k: (lambda s=s: s.run(None, feed)) for k, s in sessions.items()}
    return interleaved(runners, args.rounds, args.warmup)


def accuracy(args: argparse.Namespace) -> None:
    from edgeprune.api import prune
    from edgeprune.evaluate import evaluate

    torch.set_num_threads(args.threads)
    spec, dense = common.model("fmnist-vit")
    an = find_anatomy(dense)
    b0 = an.blocks[0]
    calib = spec.calibration_source(args.calib_size, seed=0)
    ev = spec.eval_source(n=args.eval_size)
    top1 = evaluate(spec, dense, ev)["top1"]
    print(f"\n### fmnist-vit one-shot CORP (no heal), calibration {args.calib_size} train images, "
          f"evaluation {ev.description}; dense top-1 {top1:.4f}\n")
    print("| FLOPs target | layout | heads/qk/v/mlp | FLOPs x | top-1 | agreement with dense |")
    print("|---|---|---|---|---|---|")
    for target in args.flops:
        for layout in LAYOUTS:
            attn = attention_dims(layout, b0.num_heads, b0.head_dim, args.attn_sparsity)
            mlp, _ = mlp_for_flops(dense, attn, target)
            kw = {"mlp_sparsity": 1 - mlp / b0.mlp_hidden}
            if layout == "heads":
                kw["head_sparsity"] = args.attn_sparsity
            else:
                kw["attn_sparsity"] = args.attn_sparsity
            res = prune(dense, calib, target="mlp", sparsity=None, layout="fused" if layout == "fused" else "default",
                        **kw)
            ratio = res.record["flops"] / res.record["dense_flops"]
            m = evaluate(spec, res.model, ev, dense=dense)
            b = res.record["blocks"][0]
            print(f"| x{target:g} | {layout} | {b['num_heads']}/{b['qk_dim']}/{b['v_dim']}/{b['mlp_hidden']} | "
                  f"{ratio:.3f} | {m['top1']:.4f} | {m.get('agreement', float('nan')):.4f} |", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="deit_small_patch16_224", help="comma-separated timm names")
    ap.add_argument("--flops", default="0.6,0.45", type=lambda t: [float(v) for v in t.split(",")],
                    help="FLOPs targets, pruned/dense (default: %(default)s)")
    ap.add_argument("--attn-sparsity", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-ort", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--accuracy", action="store_true", help="fmnist-vit one-shot top-1 at equal FLOPs")
    ap.add_argument("--calib-size", type=int, default=512)
    ap.add_argument("--eval-size", type=int, default=None, help="default: the whole test split")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.skip_speed:
        speed(args)
    if args.accuracy:
        accuracy(args)


if __name__ == "__main__":
    main()
