#!/usr/bin/env python
"""Per-GEMM int8 sensitivity of an exported model: which GEMM, block and kind carry the int8 loss.

Static symmetric int8 as TensorRT runs it (``exporters.quantization.qdq``: per-tensor symmetric activations,
MinMax ranges from the calibration set, per-channel symmetric weights), one GEMM at a time and by
group (kind, block, all), with and without SmoothQuant (``exporters.quantization.gemm_error``). Prints a
Markdown table per smoothing setting, optionally writes the rows as JSON.

Example (exported files carry the model name, calibration record and preprocessing)::

    edgeprune export runs/dv2-flops05 -o /tmp/dv2/pruned.onnx
    python benchmarks/quant_sensitivity.py /tmp/dv2/pruned.onnx --calib-size 256 --eval-size 500 \\
        --smooth none,0.5,search --threads 1 --json /tmp/dv2/sens.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402


def parse_smooth(text: str) -> list:
    """``none,0.5,search`` -> ``[None, 0.5, "search"]``."""
    out: list = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        out.append(None if part == "none" else part if part == "search" else float(part))
    return out


def render(model: str, smooth, rows: list[dict], groups: dict, float_top1: float | None) -> str:
    """Markdown: the per-kind / per-block groups, then the costliest single GEMMs."""
    label = "none" if smooth is None else f"alpha {smooth}" if smooth != "search" else "alpha searched per site"
    top1 = f" (float top-1 {float_top1 * 100:.2f}%)" if float_top1 is not None else ""
    lines = [f"**{model}, smoothing: {label}**" + top1,
             "", "| quantized together | rel. output error | top-1 drop (points) | agreement (%) |",
             "|---|---:|---:|---:|"]
    for name, c in groups.items():
        lines.append(f"| {name} | {c['rel_err']:.2e} | {c.get('drop', float('nan')):+.2f} | "
                     f"{c['agreement'] * 100:.1f} |")
    lines += ["", "| single GEMM (costliest 8 by output error) | kind | block | rel. output error | top-1 drop "
                  "| agreement (%) |",
              "|---|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: -r["rel_err"])[:8]:
        lines.append(f"| `{r['node']}` | {r['kind']} | {r['block']} | {r['rel_err']:.2e} | "
                     f"{r.get('drop', float('nan')):+.2f} | {r['agreement'] * 100:.1f} |")
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r["rel_err"])
    lines += ["", "Single-GEMM output error by kind (mean / max): " + "; ".join(
        f"{k} {np.mean(v):.1e} / {np.max(v):.1e}" for k, v in by_kind.items())]
    return "\n".join(lines)


#: recipe variants of ``--variants``: (smoothing, QuantizeConfig overrides); "default" is the recipe
#: ``edgeprune quantize --precision int8`` runs (exporters.quantization.recipe_tensorrt), the others take steps away
_OFF = {"explicit_smooth_kinds": (), "weight_rounding": "nearest", "clip_kinds": (), "fallback_share": 1.0}
VARIANTS = {
    "minmax": (None, _OFF),
    "smooth": ("config", _OFF),
    "smooth+clip-fc2": ("config", {**_OFF, "clip_kinds": ("fc2",)}),
    "smooth+fc2": ("config", {**_OFF, "explicit_smooth_kinds": ("fc2",)}),
    "smooth+fc2+gptq": ("config", {**_OFF, "explicit_smooth_kinds": ("fc2",), "weight_rounding": "gptq"}),
    "default": ("config", {}),
    # issue 31, the fallback threshold: the earlier fixed 5 % share, and every GEMM a candidate (the cap decides)
    "default-share5": ("config", {"fallback_share": 0.05}),
    "default-cap-only": ("config", {"fallback_share": 1e-9}),
    # two steps tried and not adopted (docs/quantization.md): alphas up to 0.95, bias correction
    "default+alphas95": ("config", {}),
    "default+bias-correction": ("config", {}),
}
#: the SmoothQuant alphas of the "+alphas95" variants
ALPHAS_95 = (None, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)


def bias_correct(p, gemms) -> int:
    """Empirical bias correction (Nagel et al. 2019, §4.2) of the int8 ``MatMul -> Add(bias)`` GEMMs
    of a prepared model: ``b -= mean_rows(Q(x) W_q - x W)`` over the sampled calibration rows.
    Returns the number of biases changed."""
    from onnx import numpy_helper

    from exporters.quantization.qdq import fake_quant_act

    inits = {t.name: t for t in p.model.graph.initializer}
    nodes = {n.name: n for n in p.model.graph.node}
    consumers: dict[str, list] = {}
    for n in p.model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    done = 0
    for g in gemms:
        if g.op_type != "MatMul" or g.name not in p.weights or g.x not in p.stats.rows:
            continue
        adds = [n for n in consumers.get(nodes[g.name].output[0], []) if n.op_type == "Add"]
        b = next((i for i in adds[0].input if i in inits), None) if len(adds) == 1 else None
        if b is None:
            continue
        rows = p.stats.rows[g.x]
        q, sc = p.weights[g.name]
        shift = (fake_quant_act(rows, p.ranges[g.x]) @ (q.astype(np.float32) * sc[None, :])
                 - rows @ numpy_helper.to_array(inits[g.w]).astype(np.float32)).mean(0)
        inits[b].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(inits[b]).astype(np.float32) - shift, b))
        done += 1
    return done


def run_variants(base, calib, x, y, names, threads: int, batch_size: int, sens_images: int) -> list[dict]:
    """Top-1 / agreement / logit error of whole-model int8 variants (:data:`VARIANTS`) on ``x``,
    each built by the recipe's own steps (``prepare_int8``, ``measured_fallback``)."""
    from exporters.quantization import QuantizeConfig
    from exporters.quantization import gemm_error as sens
    from exporters.quantization.qdq import insert_qdq
    from exporters.quantization.recipe_tensorrt import measured_fallback, prepare_int8
    from exporters.quantization.smoothing import ALPHAS

    rows = []
    ev = sens.prepare_eval(base, x, y, [], batch_size=batch_size, threads=threads)
    for name in names:
        smooth, overrides = VARIANTS[name]
        cfg = QuantizeConfig(recipe="tensorrt", threads=threads, batch_size=batch_size,
                             sensitivity_images=sens_images, **overrides)
        alphas = ALPHAS_95 if "+alphas95" in name else ALPHAS
        p = prepare_int8(sens.copy_model(base), calib, cfg, smooth=smooth, alphas=alphas)
        _, fallback = measured_fallback(p, calib, cfg, set())
        int8 = [g for g in p.gemms if g.name not in fallback]
        if "+bias-correction" in name:
            bias_correct(p, int8)
        insert_qdq(p.model, int8, p.ranges, p.weights)
        c = sens.cost(sens.run_variant(p.model, ev, None, batch_size=batch_size, threads=threads), ev)
        flops = {g.name: g.flops_per_image(p.stats.shapes.get(g.x, (1, 1, g.k))) for g in p.gemms}
        share = 1.0 - sum(flops[n] for n in fallback) / sum(flops.values())
        float_top1 = None if y is None else float(np.mean(ev.float_out.argmax(1) == y))
        rows.append({"variant": name, **c, "int8_flops_share": share, "float_top1": float_top1,
                     "alphas": [r["alpha"] for r in p.smoothing], "clips": p.clips, "fallback": fallback})
        print(f"| {name} | {c.get('top1', float('nan')) * 100:.2f} | {c.get('drop', float('nan')):+.2f} | "
              f"{c['agreement'] * 100:.1f} | "
              f"{c['rel_err']:.2e} | {100 * share:.1f} | {', '.join(fallback) or '-'} |", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("onnx", type=Path, help="an fp32 ONNX file written by `edgeprune export`")
    p.add_argument("--calib-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="calibration selection seed")
    p.add_argument("--eval-size", type=int, default=500, help="held-out test images")
    p.add_argument("--eval-skip", type=int, default=0,
                   help="skip the first N test images (design checks on images a table does not use)")
    p.add_argument("--smooth", default="none,search", help="comma list of none, an alpha, search")
    p.add_argument("--no-singles", action="store_true", help="groups only (kind, block, all)")
    p.add_argument("--groups", choices=("kinds", "all"), default="all",
                   help="kinds: one group per GEMM kind and all together; all: also one per block")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--variants", default=None,
                   help=f"instead of the sensitivity pass: whole-model variants, comma list of {', '.join(VARIANTS)}")
    p.add_argument("--sensitivity-images", type=int, default=64, help="calibration images of the fallback")
    args = p.parse_args(argv)

    import onnx

    from exporters.onnx import read_metadata
    from exporters.quantization import gemm_error as sens
    from exporters.quantization.calibration import calibration_for, eval_for, source_to_array
    from exporters.quantization.qdq import find_gemms
    from exporters.quantization.smoothing import apply_smoothing
    from exporters.quantization.stats import gemm_input_stats

    t0 = time.perf_counter()
    meta = read_metadata(args.onnx)
    calib, info = calibration_for(meta, args.calib_size, args.seed)
    x, y = source_to_array(eval_for(meta, args.eval_skip + args.eval_size))
    x, y = x[args.eval_skip:], None if y is None else y[args.eval_skip:]
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = None if y is None else np.asarray(y)
    base = onnx.load(str(args.onnx))
    out: dict = {"command": " ".join(["python benchmarks/quant_sensitivity.py", *(sys.argv[1:] if argv is None else argv)]),
                 "calibration": info, "eval_size": len(x), "settings": {}}
    if args.variants:
        print("| variant | top-1 (%) | drop (points) | agreement (%) | rel. logit error | GEMM FLOPs int8 (%) "
              "| kept float |")
        print("|---|---:|---:|---:|---:|---:|---|", flush=True)
        out["variants"] = run_variants(base, calib, x, y, common.names(args.variants), args.threads,
                                       args.batch_size, args.sensitivity_images)
    for smooth in ([] if args.variants else parse_smooth(args.smooth)):
        model = sens.copy_model(base)
        gemms = find_gemms(model)
        stats = gemm_input_stats(model, calib, gemms, threads=args.threads)
        report = apply_smoothing(model, stats, smooth)
        ev = sens.prepare_eval(model, x, y, list(sens.block_cuts(model, gemms).values()),
                               batch_size=args.batch_size, threads=args.threads)
        float_top1 = None if y is None else float(np.mean(ev.float_out.argmax(1) == y))
        rows = [] if args.no_singles else sens.gemm_sensitivity(
            model, stats, ev, gemms, batch_size=args.batch_size, threads=args.threads,
            log=lambda m: print(m, file=sys.stderr, flush=True))
        wanted = {k: v for k, v in sens.default_groups(gemms).items()
                  if args.groups == "all" or not k.startswith("block:")}
        groups = sens.group_sensitivity(model, stats, ev, wanted,
                                        batch_size=args.batch_size, threads=args.threads)
        print(render(args.onnx.name, smooth, rows, groups, float_top1), "\n", flush=True)
        out["settings"][str(smooth)] = {"rows": rows, "groups": groups, "smoothing": report,
                                        "float_top1": float_top1}
    out["seconds"] = time.perf_counter() - t0
    print(f"total {out['seconds'] / 60:.1f} min", flush=True)
    if args.json:
        common.write_json(args.json, out, "quant_sensitivity", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
