#!/usr/bin/env python
"""Rotary ViTs (DINOv3): measured accuracy of the pruned ``fmnist-dinov3`` and measured latency of a pruned
``vit_small_patch16_dinov3`` (issue 54, docs/rope.md).

Two parts (``--part accuracy|latency|both``):

* ``accuracy`` (default) -- on ``fmnist-dinov3`` (a trained DINOv3-shaped timm ``Eva``, Fashion-MNIST): the
  calibration set is ``--calib-size`` images of the train split (``spec.calibration_source``, seed ``--seed``), the
  evaluation set the held-out 10k test split (disjoint from calibration; ``--eval-size`` cuts it). Rows, each pruned
  from the same dense model with ``edgeprune.prune``:

  - ``dense``;
  - ``attn 0.5``        -- ``target="attn", sparsity=0.5`` (Q/K pairs, the pair-form compensation);
  - ``attn 0.5 nocomp`` -- the same with ``compensation=False``;
  - ``flops 0.5``       -- ``flops=0.5`` (the allocator's per-block dims);
  - ``latency 0.5``     -- ``latency=0.5`` with a latency table (``--table``, else one is built here on the ``cpu``
    profile with ``edgeprune.latency_table_run(..., force=True)``; whether its self-check passed is recorded). The
    achieved latency ratio is the record's own: the kept round of its measure-and-correct loop, measured interleaved
    against the dense model (``record["latency_check"]["measured"]``).

  Per row: top-1 (%), agreement with the dense model's top-1 (%), FLOPs and params as fractions of dense, the
  prune's seconds, and the kept Q/K dims per block.

* ``latency`` -- on a random-init ``vit_small_patch16_dinov3`` at ``--img-size`` (224) px, 1000 classes (its accuracy
  means nothing, only its shapes): calibration = ``--latency-calib`` seeded noise images (``common.noise``); the dense
  model (in its exact converted ``VisionTransformer`` form, as every pruned model is) and the models pruned at
  ``target="both", sparsity=0.5`` and ``target="attn", sparsity=0.5`` are exported to ONNX
  (``exporters.onnx.export_onnx``, fixed batch ``--batch``) and timed with ONNX Runtime CPU, one intra-op thread,
  interleaved: ``--warmup`` untimed pairs, then ``--rounds`` rounds, each ``--runs`` dense/pruned pairs
  (``runners.compare.bench_pair``: D P D P ...) for every pruned model in turn. A run is read from the calling
  thread's CPU time (``runners.clock``: for one CPU thread the clock load disturbs least, as
  ``edgeprune.budget.latency_check.measure_pair`` does; ``--clock wall`` for wall time). Reported: p50 ms per batch
  of each model over all its runs, the pruned / dense ratio of the medians, and the p10-p90 over rounds of the
  per-round ratio of medians.

Each part records ``/proc/loadavg`` before and after it. The JSON (``--out``) keeps the parts of earlier runs (a run
replaces only the parts it ran); the markdown table of every part in it is written into ``--doc`` (docs/rope.md)
between ``<!-- rope-table:start -->`` and ``<!-- rope-table:end -->`` (appended under "## Measured" when missing),
with the machine, the command and the load.

Examples::

    python benchmarks/rope_table.py --part latency --out docs/results/rope_table.json
    python benchmarks/rope_table.py --part accuracy --calib-size 256 --out docs/results/rope_table.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402

PARTS = ("accuracy", "latency")
START, END = "<!-- rope-table:start -->", "<!-- rope-table:end -->"
TOOL = "benchmarks/rope_table.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module doc); bad values end with argparse's one-line error (exit 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=(*PARTS, "both"), default="accuracy", help="what to run [accuracy]")
    ap.add_argument("--out", default=str(common.REPO / "docs" / "results" / "rope_table.json"),
                    help="the JSON (parts of earlier runs kept) [docs/results/rope_table.json]")
    ap.add_argument("--doc", type=Path, default=common.REPO / "docs" / "rope.md")
    ap.add_argument("--no-doc", action="store_true", help="print the table only")
    ap.add_argument("--render", action="store_true", help="no measuring: print (and write) the table of --out")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of pruning and evaluation [1]")
    acc = ap.add_argument_group("accuracy")
    acc.add_argument("--model", default="fmnist-dinov3", help="zoo model with labels [fmnist-dinov3]")
    acc.add_argument("--calib-size", type=int, default=256, help="calibration images (train split) [256]")
    acc.add_argument("--seed", type=int, default=0, help="calibration seed [0]")
    acc.add_argument("--eval-size", type=int, default=None, help="held-out images (test split) [all 10k]")
    acc.add_argument("--eval-batch", type=int, default=250)
    acc.add_argument("--table", default=None, help="latency table of --model for the latency row [built here]")
    acc.add_argument("--table-out", default=None,
                     help="where the table built here goes [next to --out: <out stem>_latency_table.json]")
    acc.add_argument("--table-threads", type=int, default=1,
                     help="intra-op threads of the table built here (and so of the latency row's loop) [1]")
    acc.add_argument("--table-batch", type=int, default=None, help="batch of the table built here [the profile's]")
    lat = ap.add_argument_group("latency")
    lat.add_argument("--latency-model", default="vit_small_patch16_dinov3")
    lat.add_argument("--img-size", type=int, default=224)
    lat.add_argument("--latency-calib", type=int, default=32, help="noise calibration images [32]")
    lat.add_argument("--batch", type=int, default=8, help="ONNX batch (fixed) [8]")
    lat.add_argument("--warmup", type=int, default=3, help="untimed interleaved pairs per pruned model [3]")
    lat.add_argument("--rounds", type=int, default=15, help="interleaved rounds [15]")
    lat.add_argument("--runs", type=int, default=5, help="dense/pruned pairs per round and pruned model [5]")
    lat.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                     help="cpu: the calling thread's CPU time per run (1 thread); wall: wall time [cpu]")
    args = ap.parse_args(argv)
    for name in ("calib_size", "eval_batch", "threads", "latency_calib", "batch", "rounds", "runs", "table_threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.eval_size is not None and args.eval_size < 1:
        ap.error(f"--eval-size must be at least 1, got {args.eval_size}")
    if args.warmup < 0:
        ap.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.table is not None and not Path(args.table).is_file():
        ap.error(f"--table: no file {args.table}")
    return args


# -- shared ------------------------------------------------------------------------------------

def loadavg() -> dict[str, Any]:
    """``/proc/loadavg`` now: the raw line, the 1/5/15-minute averages and the time (UTC)."""
    try:
        raw = Path("/proc/loadavg").read_text().strip()
        one, five, fifteen = (float(v) for v in raw.split()[:3])
    except (OSError, ValueError):
        raw, one, five, fifteen = "", None, None, None
    return {"raw": raw, "1m": one, "5m": five, "15m": fifteen,
            "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def cores() -> int:
    from edgeprune.latency.load import usable_cores

    return usable_cores()


def is_loaded(before: dict, after: dict) -> str | None:
    """Why the part ran on a loaded machine (a 1-minute load average above the usable cores), or None."""
    n = cores()
    high = [f"{when} {d['1m']:.2f}" for when, d in (("before", before), ("after", after))
            if d.get("1m") is not None and d["1m"] > n]
    return f"1-min load average {' / '.join(high)} on {n} cores" if high else None


def command(argv: list[str]) -> str:
    return shlex.join(["python", TOOL, *argv])


def kept(record: dict, key: str = "qk_dim") -> list[int]:
    """The record's per-block ``key`` dims (qk_dim: the kept Q/K head dim per block)."""
    return [int(b[key]) for b in record.get("blocks", [])]


def pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


# -- accuracy ----------------------------------------------------------------------------------

def build_table(args, out: Path) -> tuple[str, dict]:
    """Build a cpu-profile latency table of ``args.model`` (``edgeprune.latency_table_run``, ``force=True``):
    (its path, what the JSON says about it: key, self-check, seconds, lines)."""
    import edgeprune
    from edgeprune.latency.table import LatencyTable

    path = Path(args.table_out) if args.table_out else out.with_name(out.stem + "_latency_table.json")
    lines: list[str] = []

    def echo(message: str = "", err: bool = False) -> None:
        lines.append(message)
        common.log(message)

    t0 = time.perf_counter()
    res = edgeprune.latency_table_run(path, model_name=args.model, device="cpu", threads=args.table_threads,
                                      batch=args.table_batch, force=True, quiet=True, echo=echo)
    seconds = time.perf_counter() - t0
    table = LatencyTable.load(res.out)
    chk = table.meta.get("self_check") or {}
    return str(res.out), {"path": str(res.out), "built_here": True, "seconds": seconds, "key": table.key,
                          "self_check_passed": table.unverified is None, "unverified": table.unverified,
                          "self_check": chk, "lines": lines}


def describe_table(path: str) -> dict:
    from edgeprune.latency.table import LatencyTable

    table = LatencyTable.load(path)
    return {"path": path, "built_here": False, "key": table.key, "self_check_passed": table.unverified is None,
            "unverified": table.unverified, "self_check": table.meta.get("self_check") or {}}


def accuracy_rows(table: str) -> list[tuple[str, dict]]:
    """(row name, ``edgeprune.prune`` keywords) of the pruned rows."""
    return [("attn 0.5", {"target": "attn", "sparsity": 0.5}),
            ("attn 0.5 nocomp", {"target": "attn", "sparsity": 0.5, "compensation": False}),
            ("attn 0.5 general", {"target": "attn", "sparsity": 0.5, "rope_compensation": "general"}),
            ("attn 0.75", {"target": "attn", "sparsity": 0.75}),
            ("attn 0.75 nocomp", {"target": "attn", "sparsity": 0.75, "compensation": False}),
            ("attn 0.75 general", {"target": "attn", "sparsity": 0.75, "rope_compensation": "general"}),
            ("flops 0.5", {"flops": 0.5}),
            ("latency 0.5", {"latency": 0.5, "latency_table": table})]


def run_accuracy(args, out: Path, argv: list[str]) -> dict:
    import torch

    import edgeprune

    before = loadavg()
    t_part = time.perf_counter()
    torch.set_num_threads(args.threads)
    spec, dense = common.model(args.model)
    weights = weights_meta(args.model)
    if args.table:
        table_path, table_info = args.table, describe_table(args.table)
    else:
        common.log(f"building a cpu latency table of {args.model} (threads {args.table_threads}) ...")
        table_path, table_info = build_table(args, out)
        common.log(f"table {table_path}: {table_info['seconds']:.0f} s, self-check "
                   f"{'passed' if table_info['self_check_passed'] else 'missed: ' + str(table_info['unverified'])}")
    batches = common.eval_batches(spec, args.eval_size, args.eval_batch)
    n_eval = sum(len(y) for _, y in batches)
    t0 = time.perf_counter()
    d = common.top1(dense, batches)
    common.log(f"dense top-1 {d['top1'] * 100:.2f}% on {n_eval} held-out images ({time.perf_counter() - t0:.0f} s)")
    dense_blocks = edgeprune.structure_summary(dense)["blocks"]
    rows: list[dict] = [{"row": "dense", "settings": {}, "top1": d["top1"], "agreement": 1.0, "flops": 1.0,
                         "params": 1.0, "prune_s": 0.0, "latency": None, "blocks": dense_blocks,
                         "qk_dim": kept({"blocks": dense_blocks})}]
    for name, kw in accuracy_rows(table_path):
        # the zoo model's own train split (common.calibration falls back to noise for names outside common.ZOO)
        calib = spec.calibration_source(args.calib_size, seed=args.seed)
        t0 = time.perf_counter()
        res = edgeprune.prune(dense, calib, spec=spec, **kw)
        seconds = time.perf_counter() - t0
        rec = res.record
        m = common.top1(res.model, batches, d["preds"])
        flops, params = common.ratios(rec)
        chk = rec.get("latency_check")
        lat = None
        if chk is not None:
            meas = chk.get("measured") or {}
            lat = {"measured_ratio": meas.get("ratio"), "ratio_interval": meas.get("ratio_interval"),
                   "pairs": meas.get("pairs"), "dense_ms": meas.get("dense_ms"), "pruned_ms": meas.get("pruned_ms"),
                   "clock": meas.get("clock"), "loaded": chk.get("loaded"), "predicted_ratio": chk.get("predicted_ratio"),
                   "budget_ratio": chk.get("budget_ratio"), "meets_budget": chk.get("meets_budget"),
                   "not_measured": chk.get("not_measured"), "table_unverified": chk.get("table_unverified"),
                   "rounds": len(chk.get("rounds", []) or []), "chosen_round": chk.get("chosen_round"),
                   "load": meas.get("load")}
        row = {"row": name, "settings": {k: v for k, v in kw.items() if k != "latency_table"},
               "top1": m["top1"], "agreement": m["agreement"], "flops": flops, "params": params, "prune_s": seconds,
               "latency": lat, "blocks": rec.get("blocks"), "qk_dim": kept(rec), "v_dim": kept(rec, "v_dim"),
               "mlp_hidden": kept(rec, "mlp_hidden"), "num_heads": kept(rec, "num_heads")}
        rows.append(row)
        msg = (f"{name}: top-1 {m['top1'] * 100:.2f}% agreement {m['agreement'] * 100:.2f}% FLOPs x{flops:.3f} "
               f"params x{params:.3f} qk {row['qk_dim']} prune {seconds:.1f} s")
        if lat is not None:
            msg += f"; measured latency x{lat['measured_ratio']} (predicted x{lat['predicted_ratio']})"
        common.log(msg)
    after = loadavg()
    return {"command": command(argv), "argv": argv, "machine": common.machine(), "model": args.model,
            "weights": weights, "calibration": {"source": "train split", "images": args.calib_size, "seed": args.seed},
            "evaluation": {"source": "test split (held out)", "images": n_eval}, "table": table_info,
            "rows": rows, "loadavg": {"before": before, "after": after, "cores": cores()},
            "loaded": is_loaded(before, after), "minutes": (time.perf_counter() - t_part) / 60,
            "created": after["at"]}


def weights_meta(model: str) -> dict | None:
    """The safetensors metadata of ``fmnist-dinov3``'s weights (epochs, test top-1 of the training run), if any."""
    if model != "fmnist-dinov3":
        return None
    try:
        from safetensors import safe_open

        from edgeprune.zoo.fmnist_dinov3 import WEIGHTS

        with safe_open(str(WEIGHTS), "pt") as f:
            return {"path": str(WEIGHTS.relative_to(common.REPO)), **(f.metadata() or {})}
    except Exception as err:  # noqa: BLE001  (informational only)
        return {"error": repr(err)}


# -- latency -----------------------------------------------------------------------------------

def time_interleaved(paths: dict[str, Path], args) -> dict[str, Any]:
    """Time the dense ONNX and every pruned one, interleaved (module doc): per model its runs by round."""
    from runners.clock import ThreadClock
    from runners.compare import bench_pair
    from runners.onnxruntime_runner import OrtRunner

    runners = {n: OrtRunner(p, providers=("cpu",), threads=1, label=n) for n, p in paths.items()}
    timed = {n: (ThreadClock(r) if args.clock == "cpu" else r) for n, r in runners.items()}
    pruned = [n for n in paths if n != "dense"]
    # per pruned model: the dense runs paired with it and its own runs, one list per round
    got: dict[str, dict[str, list[list[float]]]] = {n: {"dense": [], "pruned": []} for n in pruned}
    try:
        for r in range(args.rounds):
            for n in pruned:
                (res,) = bench_pair(timed["dense"], timed[n], [args.batch], iterations=args.runs,
                                    warmup=args.warmup if r == 0 else 0)
                got[n]["dense"].append(list(res.latencies_a))
                got[n]["pruned"].append(list(res.latencies_b))
            common.log(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {statistics.median(got[n]['pruned'][-1]):.1f} / dense "
                f"{statistics.median(got[n]['dense'][-1]):.1f} ms" for n in pruned))
    finally:
        for r in runners.values():
            r.close()
    return got


def summarize(got: dict[str, dict[str, list[list[float]]]]) -> dict[str, Any]:
    """p50 ms per model, pruned / dense ratio of medians, and the p10-p90 / median over rounds of the per-round
    ratio of medians."""
    dense_all = [t for g in got.values() for rnd in g["dense"] for t in rnd]
    out: dict[str, Any] = {"dense": {"p50_ms": statistics.median(dense_all), "runs": len(dense_all),
                                     "p10_ms": pct(dense_all, 10), "p90_ms": pct(dense_all, 90)}}
    for n, g in got.items():
        own = [t for rnd in g["pruned"] for t in rnd]
        paired = [t for rnd in g["dense"] for t in rnd]
        per_round = [statistics.median(b) / statistics.median(a) for a, b in zip(g["dense"], g["pruned"])]
        out[n] = {"p50_ms": statistics.median(own), "runs": len(own), "p10_ms": pct(own, 10), "p90_ms": pct(own, 90),
                  "paired_dense_p50_ms": statistics.median(paired),
                  "ratio_of_medians": statistics.median(own) / statistics.median(paired),
                  "round_ratio_median": statistics.median(per_round), "round_ratio_p10": pct(per_round, 10),
                  "round_ratio_p90": pct(per_round, 90), "round_ratios": per_round, "rounds": len(per_round)}
    return out


def run_latency(args, argv: list[str]) -> dict:
    import torch

    import edgeprune
    from edgeprune.latency.load import spread_of
    from edgeprune.zoo.canonical import canonical_model
    from edgeprune.zoo.registry import get_model_spec
    from exporters.onnx import export_onnx

    before = loadavg()
    t_part = time.perf_counter()
    torch.set_num_threads(args.threads)
    spec = get_model_spec(args.latency_model, random_init=True, img_size=args.img_size, num_classes=1000)
    dense = canonical_model(spec.create(pretrained=False).eval()).eval()  # the exact VisionTransformer form
    calib = common.noise(spec, args.latency_calib, 0)
    models: dict[str, Any] = {"dense": dense}
    dense_blocks = edgeprune.structure_summary(dense)["blocks"]
    rows: dict[str, dict] = {"dense": {"settings": {}, "flops": 1.0, "params": 1.0, "prune_s": 0.0,
                                       "blocks": dense_blocks, "qk_dim": kept({"blocks": dense_blocks}),
                                       "mlp_hidden": kept({"blocks": dense_blocks}, "mlp_hidden")}}
    for name, kw in (("both 0.5", {"target": "both", "sparsity": 0.5}), ("attn 0.5", {"target": "attn", "sparsity": 0.5})):
        t0 = time.perf_counter()
        res = edgeprune.prune(dense, calib, spec=spec, **kw)
        seconds = time.perf_counter() - t0
        flops, params = common.ratios(res.record)
        models[name] = res.model.eval()
        rows[name] = {"settings": kw, "flops": flops, "params": params, "prune_s": seconds,
                      "blocks": res.record.get("blocks"), "qk_dim": kept(res.record),
                      "mlp_hidden": kept(res.record, "mlp_hidden")}
        common.log(f"{name}: FLOPs x{flops:.3f} params x{params:.3f} qk {rows[name]['qk_dim']} "
                   f"mlp {rows[name]['mlp_hidden']} prune {seconds:.0f} s")
    with tempfile.TemporaryDirectory(prefix="rope-table-") as tmp:
        paths = {}
        for name, m in models.items():
            t0 = time.perf_counter()
            paths[name] = export_onnx(m, Path(tmp) / f"{name.replace(' ', '_')}.onnx", spec.input_size,
                                      dynamic_batch=False, batch_size=args.batch)
            rows[name]["export_s"] = time.perf_counter() - t0
            rows[name]["onnx_mb"] = paths[name].stat().st_size / 2**20
        mid = loadavg()
        common.log(f"timing {len(paths)} ONNX models, batch {args.batch}, 1 thread, {args.rounds} rounds x "
                   f"{args.runs} pairs ({args.clock} clock); load {mid['raw']}")
        t0 = time.perf_counter()
        got = time_interleaved(paths, args)
        timing_s = time.perf_counter() - t0
    stats = summarize(got)
    dense_runs = [t for g in got.values() for rnd in g["dense"] for t in rnd]
    for name in rows:
        rows[name]["timing"] = stats[name]
    after = loadavg()
    return {"command": command(argv), "argv": argv, "machine": common.machine(), "model": args.latency_model,
            "img_size": args.img_size, "num_classes": 1000, "random_init": True,
            "calibration": {"source": "seeded N(0,1) noise (common.noise, seed 0)", "images": args.latency_calib},
            "timing": {"backend": "onnxruntime CPUExecutionProvider", "onnxruntime": ort_version(), "batch": args.batch,
                       "intra_op_threads": 1, "clock": args.clock, "warmup_pairs": args.warmup, "rounds": args.rounds,
                       "pairs_per_round": args.runs, "seconds": timing_s,
                       "dense_spread_p90_p10": spread_of(dense_runs)},
            "rows": rows, "loadavg": {"before": before, "before_timing": mid, "after": after, "cores": cores()},
            "loaded": is_loaded(before, after), "minutes": (time.perf_counter() - t_part) / 60,
            "created": after["at"]}


def ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


# -- output ------------------------------------------------------------------------------------

def load_parts(path: Path) -> dict[str, dict]:
    return json.loads(path.read_text()).get("parts", {}) if path.exists() else {}


def _load_line(part: dict) -> str:
    la = part["loadavg"]
    seq = [("before", la["before"])] + ([("before timing", la["before_timing"])] if "before_timing" in la else []) \
        + [("after", la["after"])]
    text = "; ".join(f"{w} {d['raw'].split(' ')[0]} / {d['raw'].split(' ')[1]} / {d['raw'].split(' ')[2]} "
                     f"({d['at'][11:16]} UTC)" for w, d in seq)
    verdict = (f"**loaded machine** ({part['loaded']}): every number of this part was measured on a loaded machine"
               if part.get("loaded") else "not loaded (1-min load average at most the usable cores)")
    return f"Load averages (1 / 5 / 15 min, /proc/loadavg) on {la['cores']} usable cores: {text}. {verdict}."


def render_latency(p: dict) -> str:
    t = p["timing"]
    lines = [f"### Latency: `{p['model']}` (random init), {p['img_size']} px, ONNX Runtime CPU", "",
             f"Command: `{p['command']}`  ",
             f"Machine: {p['machine']}; onnxruntime {t['onnxruntime']}, batch {t['batch']} (fixed-batch export), "
             f"{t['intra_op_threads']} intra-op thread, {t['clock']} clock (the calling thread's CPU time per run)"
             if t["clock"] == "cpu" else
             f"Machine: {p['machine']}; onnxruntime {t['onnxruntime']}, batch {t['batch']} (fixed-batch export), "
             f"{t['intra_op_threads']} intra-op thread, wall clock",
             "", f"Calibration: {p['calibration']['images']} noise images (a random-init model: only its latency "
             f"means something). Timing: {t['warmup_pairs']} warm-up pairs, then {t['rounds']} rounds of "
             f"{t['pairs_per_round']} interleaved dense/pruned pairs per pruned model (D P D P ..., "
             f"`runners.compare.bench_pair`); {t['seconds']:.0f} s of timing, {p['minutes']:.1f} min in all. "
             "The dense model is timed in its exact converted `VisionTransformer` form.", "",
             "| model | FLOPs x dense | params x dense | kept qk_dim per block | MLP hidden per block | "
             "p50 ms / batch | pruned / dense (ratio of medians) | p10-p90 over rounds | prune s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in p["rows"].items():
        tm = r["timing"]
        if name == "dense":
            lines.append(f"| dense | 1 | 1 | {_dims(r.get('qk_dim'))} | {_dims(r.get('mlp_hidden'))} | "
                         f"{tm['p50_ms']:.1f} | 1 | - | - |")
            continue
        lines.append(f"| {name} (`{', '.join(f'{k}={v!r}' for k, v in r['settings'].items())}`) | {r['flops']:.3f} | "
                     f"{r['params']:.3f} | {_dims(r['qk_dim'])} | {_dims(r['mlp_hidden'])} | {tm['p50_ms']:.1f} | "
                     f"{tm['ratio_of_medians']:.3f} | {tm['round_ratio_p10']:.3f}-{tm['round_ratio_p90']:.3f} | "
                     f"{r['prune_s']:.0f} |")
    sp = t.get("dense_spread_p90_p10")
    lines += ["", _load_line(p) + (f" The dense model's own runs spread {100 * sp:.0f}% (p90/p10 - 1)."
                                   if sp is not None else "")]
    return "\n".join(lines)


def _dims(values: list[int] | None) -> str:
    if not values:
        return "-"
    return f"{values[0]} x{len(values)}" if len(set(values)) == 1 else ",".join(map(str, values))


def render_accuracy(p: dict) -> str:
    tab = p["table"]
    w = p.get("weights") or {}
    wtxt = ", ".join(f"{k} {w[k]}" for k in ("epochs", "test_top1", "partial") if k in w)
    chk = tab.get("self_check") or {}
    models = ", ".join(f"{m['name']} {m['predicted_ms']:.2f}/{m['measured_ms']:.2f} ms ({100 * m['error']:+.1f}%)"
                       for m in chk.get("models", []))
    key = tab.get("key") or {}
    lines = [f"### Accuracy: `{p['model']}` (Fashion-MNIST)", "",
             f"Command: `{p['command']}`  ",
             f"Machine: {p['machine']}. Weights: `{w.get('path', '?')}`" + (f" ({wtxt})" if wtxt else "") + ".", "",
             f"Calibration: {p['calibration']['images']} train-split images (seed {p['calibration']['seed']}); "
             f"evaluation: {p['evaluation']['images']} held-out test-split images, the same for every row. "
             f"{p['minutes']:.1f} min in all.  ",
             f"Latency table: `{tab['path']}` ({'built here' if tab.get('built_here') else 'given'}"
             + (f", {tab['seconds']:.0f} s" if tab.get("seconds") is not None else "")
             + f"; {key.get('backend')} {key.get('backend_version', '')}, batch {key.get('batch')}, threads "
             f"{key.get('threads') or 'default'}); self-check "
             + ("**passed**" if tab.get("self_check_passed") else f"**missed** ({tab.get('unverified')})")
             + (f" (predicted / measured whole: {models})" if models else "") + ".", "",
             "| row | top-1 % | agreement with dense % | FLOPs x dense | params x dense | measured latency x dense | "
             "kept qk_dim per block | prune s |", "|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        lat = r.get("latency")
        if lat is None:
            ltxt = "1" if r["row"] == "dense" else "-"
        elif lat.get("measured_ratio") is None:
            ltxt = f"not measured ({lat.get('not_measured')}); predicted x{lat['predicted_ratio']:.3f}"
        else:
            iv = lat.get("ratio_interval")
            ltxt = (f"{lat['measured_ratio']:.3f}" + (f" (95% {iv[0]:.3f}-{iv[1]:.3f}, {lat['pairs']} pairs)" if iv else "")
                    + f"; predicted {lat['predicted_ratio']:.3f}" + ("; loaded" if lat.get("loaded") else ""))
        settings = ", ".join(f"{k}={v!r}" for k, v in r["settings"].items())
        name = r["row"] + (f" (`{settings}`)" if settings else "")
        lines.append(f"| {name} | {r['top1'] * 100:.2f} | {r['agreement'] * 100:.2f} | {r['flops']:.3f} | "
                     f"{r['params']:.3f} | {ltxt} | {_dims(r.get('qk_dim'))} "
                     f"| {r['prune_s']:.1f} |")
    lat_rows = [r for r in p["rows"] if r.get("latency")]
    lines += ["", _load_line(p)]
    for r in lat_rows:
        lat = r["latency"]
        if lat.get("loaded"):
            lines.append(f"The {r['row']} row's measured ratio was taken on a loaded machine ({lat['loaded']}).")
    return "\n".join(lines)


def render(parts: dict[str, dict]) -> str:
    blocks = [f(parts[k]) for k, f in (("latency", render_latency), ("accuracy", render_accuracy)) if k in parts]
    return "\n\n".join(blocks) if blocks else "(nothing measured yet)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv_used = list(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    parts = load_parts(out)
    if not args.render:
        todo = PARTS if args.part == "both" else (args.part,)
        for part in ("latency", "accuracy"):  # the latency part first: it does not need the trained model
            if part not in todo:
                continue
            common.log(f"part {part}: {command(argv_used)}")
            parts[part] = run_latency(args, argv_used) if part == "latency" else run_accuracy(args, out, argv_used)
            common.write_json(out, {"parts": parts}, TOOL, argv_used)
            common.log(f"part {part} written to {out}")
    block = render(parts)
    print(block)
    if not args.no_doc:
        common.write_between(args.doc, START, END, block, heading="## Measured")
        common.log(f"written to {args.doc}")
    return 0


if __name__ == "__main__":
    common.run_main(main)
