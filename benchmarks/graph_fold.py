"""Node counts and ONNX Runtime CPU latency of dynamic-batch exports before / after the shape-chain
fold (:func:`exporters.onnx_fold.fold_shape_chains`; issue 56 item 2).

    python benchmarks/graph_fold.py
    python benchmarks/graph_fold.py --skip-deit --rounds 5     # quick

"before" is the same export with the fold switched off (graphsurgeon's clean-up only, as before
the fold existed); "after" is ``export_onnx`` as it is. Models: fmnist-vit dense, ``both 0.5``,
``attn 0.5`` (Q/K-only: qk_dim != v_dim) and a random-init ``deit_small_patch16_224``
(num_classes 10) dense and ``both 0.5`` (calibrated on ``--deit-calib`` noise images at 224).
Columns: total nodes, Shape/Gather/Unsqueeze/Concat nodes, and the run-time shape sub-graph
(:func:`exporters.onnx_fold.shape_chain_nodes`). Latency: fmnist-vit dense and ``both 0.5``, one
ORT thread, batch 1 and 8, before and after timed in alternation (``--rounds`` rounds of
``--reps`` runs each, order flipped every round), medians of the per-round mean.

Prints a markdown table; writes JSON to ``docs/results/graph_fold.json`` (``--out``).

Reading it: a class token (DeiT) keeps one real batch-dependent chain (``cls_token.expand(B, ...)``).
Random-init timm models have zero biases, and a zero-bias ``Add`` is folded away, so a pruned
random-init DeiT (whose compensated ``fc2`` bias is non-zero) shows one ``Add`` per block more than
its dense model; the attention itself costs the same nodes dense or Q/K-pruned.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks import common  # noqa: E402

import torch  # noqa: E402

CHAIN_OPS = ("Shape", "Gather", "Unsqueeze", "Concat")


@contextlib.contextmanager
def fold_off():
    """Switch :func:`exporters.onnx_fold.fold_shape_chains` off (``_clean_graph`` looks it up per call)."""
    import exporters.onnx_fold as fold

    real = fold.fold_shape_chains
    fold.fold_shape_chains = lambda proto: proto
    try:
        yield
    finally:
        fold.fold_shape_chains = real


def export_pair(model, input_shape, folder: Path, tag: str, attention: str | None) -> dict[str, Path]:
    from exporters.onnx import export_onnx

    kw = {"attention": attention} if attention else {}
    with fold_off():
        before = export_onnx(model, folder / f"{tag}-before.onnx", input_shape, **kw)
    after = export_onnx(model, folder / f"{tag}-after.onnx", input_shape, **kw)
    return {"before": before, "after": after}


def counts(path: Path) -> dict[str, int]:
    import onnx

    from exporters.onnx_fold import op_counts, shape_chain_nodes

    proto = onnx.load(str(path), load_external_data=False)
    ops = op_counts(proto)
    return {"nodes": len(proto.graph.node), "shape_ops": sum(ops[o] for o in CHAIN_OPS),
            "shape_chain": shape_chain_nodes(proto),
            "batch": proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param or None}


def latency(paths: dict[str, Path], input_shape, batch: int, rounds: int, reps: int) -> dict[str, float]:
    """Median (over rounds) per-run ms of each file; the files alternate within every round."""
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    sessions = {k: ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"])
                for k, p in paths.items()}
    x = np.random.default_rng(0).standard_normal((batch, *input_shape)).astype(np.float32)
    for s in sessions.values():  # warm-up
        for _ in range(3):
            s.run(None, {"input": x})
    per: dict[str, list[float]] = {k: [] for k in sessions}
    order = list(sessions)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            for _ in range(reps):
                sessions[k].run(None, {"input": x})
            per[k].append((time.perf_counter() - t0) / reps * 1e3)
    return {k: statistics.median(v) for k, v in per.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(common.REPO / "docs/results/graph_fold.json"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--deit-calib", type=int, default=32)
    ap.add_argument("--skip-deit", action="store_true")
    ap.add_argument("--attention", default=None,
                    help="export_onnx's attention= (where it has one; default: packed, the models' own qkv + SDPA)")
    args = ap.parse_args(argv)

    import timm

    import edgeprune
    from exporters.onnx import export_onnx

    attention = args.attention
    if attention is None and "attention" in inspect.signature(export_onnx).parameters:
        attention = "packed"
    torch.manual_seed(0)
    spec, dense = common.model("fmnist-vit")
    fm_shape = tuple(spec.input_size)
    calib = common.noise(spec, 64, seed=1)
    models = {"fmnist-vit dense": (dense, fm_shape)}
    for name, kw in (("both 0.5", dict(target="both", sparsity=0.5)), ("attn 0.5", dict(target="attn", sparsity=0.5))):
        common.log(f"pruning fmnist-vit {name}")
        models[f"fmnist-vit {name}"] = (edgeprune.prune(copy.deepcopy(dense), calib, **kw).model.eval(), fm_shape)
    if not args.skip_deit:
        torch.manual_seed(0)
        deit = timm.create_model("deit_small_patch16_224", pretrained=False, num_classes=10).eval()
        models["deit-s dense"] = (deit, (3, 224, 224))
        common.log("pruning deit-s both 0.5")
        dcal = torch.randn(args.deit_calib, 3, 224, 224, generator=torch.Generator().manual_seed(1))
        models["deit-s both 0.5"] = (edgeprune.prune(copy.deepcopy(deit), dcal, target="both", sparsity=0.5).model.eval(),
                                     (3, 224, 224))

    rows, lat = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (model, shape)) in enumerate(models.items()):
            common.log(f"exporting {name}")
            paths = export_pair(model, shape, Path(tmp), f"m{i}", attention)
            c = {k: counts(p) for k, p in paths.items()}
            rows.append({"model": name, "before": c["before"], "after": c["after"]})
            if name in ("fmnist-vit dense", "fmnist-vit both 0.5"):
                for batch in (1, 8):
                    common.log(f"timing {name} batch {batch}")
                    ms = latency(paths, shape, batch, args.rounds, args.reps)
                    lat.append({"model": name, "batch": batch, "before_ms": ms["before"], "after_ms": ms["after"],
                                "speedup": ms["before"] / ms["after"]})

    lines = ["| model | nodes before | nodes after | change | Shape/Gather/Unsqueeze/Concat before | after "
             "| shape sub-graph before | after | batch axis after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(f"| {r['model']} | {b['nodes']} | {a['nodes']} | {(a['nodes'] - b['nodes']) / b['nodes']:+.0%} "
                     f"| {b['shape_ops']} | {a['shape_ops']} | {b['shape_chain']} | {a['shape_chain']} | {a['batch']} |")
    lines += ["", "| model | batch | before ms | after ms | before / after |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in lat:
        lines.append(f"| {r['model']} | {r['batch']} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | {r['speedup']:.2f}x |")
    print(f"attention={attention or 'default'}; ORT CPU, 1 thread, {args.rounds} rounds x {args.reps} runs, "
          f"interleaved, medians; {common.machine()}\n")
    print("\n".join(lines))
    out = common.write_json(args.out, {"attention": attention, "rounds": args.rounds, "reps": args.reps,
                                       "graphs": rows, "latency": lat}, "benchmarks/graph_fold.py", argv)
    common.log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    common.run_main(main)
