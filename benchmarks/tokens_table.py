#!/usr/bin/env python
"""Widths vs tokens vs both at one measured latency (issue 44, item 4).

For one zoo model with labels and a latency table of it with a token axis (``edgeprune latency-table
--tokens ...``), per calibration seed this prunes from the same dense model and calibration set (the model's
train split, ``spec.calibration_source``):

* ``widths`` -- ``latency=B``: the widths alone, allocated by the table, measured and corrected
  (``edgeprune.budget.correction_loop``);
* ``tokens`` -- ``target="mlp", sparsity=0, tokens_merge=R``: no width pruning, ToMe merging R tokens per
  block (training-free; no budget, so no output correction);
* ``both``   -- ``latency=B, tokens_merge="auto"`` with ``tokens_candidates`` (``--candidates``): the schedule
  and the widths share the budget (``edgeprune.pruning.tokens_auto``);

and reports for each, and for the dense model, the latency measured against the dense model *interleaved* on the
table's backend, batch and threads (``edgeprune.budget.latency_check.measure_pair``: for ``widths`` and
``both`` the measurement of the kept round of their own measure-and-correct loop, for ``tokens`` one run of the
same measurer), FLOPs (fraction of dense), top-1 and agreement with the dense model on the first ``--eval-size``
images of the held-out split (disjoint from calibration; ``spec.eval_source``), and the prune's seconds.

Every row is appended to ``--out`` (JSON) as soon as it is done, so ``--rows`` can run the rows in several
commands (one per row, or a rerun of one) and the table is rendered from every row in the file.

Example::

    python benchmarks/tokens_table.py --model dinov2-s14-fmnist --img-size 224 --table t224.json \\
        --budget 0.5 --tokens-r 9 --candidates 0,6,12 --seeds 0 --calib-size 64 --eval-size 500 \\
        --out docs/results/tokens_dinov2_224.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import common  # noqa: E402

ROWS = ("dense", "widths", "tokens", "both")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module doc); bad values end with argparse's one-line error (exit 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dinov2-s14-fmnist", help="zoo model with labels")
    ap.add_argument("--img-size", type=int, default=None, help="input side in px [the model's own]")
    ap.add_argument("--table", required=True, help="latency table of the model with a token axis")
    ap.add_argument("--budget", type=float, default=0.5, help="latency budget, fraction of dense [0.5]")
    ap.add_argument("--tokens-r", default="9", help="the tokens row's --tokens-merge schedule (R, r0,r1,.., "
                                                    "decreasing:R) [9]")
    ap.add_argument("--candidates", default="0,6,12",
                    help="the both row's tokens_candidates (ints or decreasing:R, comma-separated) [0,6,12]")
    ap.add_argument("--seeds", default="0", help="calibration seeds [0]")
    ap.add_argument("--calib-size", type=int, default=64, help="calibration images (train split) [64]")
    ap.add_argument("--eval-size", type=int, default=500, help="held-out images (test split) [500]")
    ap.add_argument("--eval-batch", type=int, default=50)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which rows to run, of {','.join(ROWS)}")
    ap.add_argument("--iterations", type=int, default=8,
                    help="interleaved pairs per latency measurement (every round of the loops too) [8]")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of pruning and evaluation [1]")
    ap.add_argument("--out", required=True, help="the JSON the rows are appended to")
    ap.add_argument("--render", action="store_true", help="no pruning: print the table of --out's rows")
    args = ap.parse_args(argv)
    bad = sorted(set(common.names(args.rows)) - set(ROWS))
    if bad:
        ap.error(f"--rows: unknown row(s) {', '.join(bad)}; choose from {', '.join(ROWS)}")
    if not 0 < args.budget < 1:
        ap.error(f"--budget must be a fraction in (0, 1), got {args.budget}")
    for name in ("calib_size", "eval_size", "eval_batch", "iterations", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.render and not Path(args.table).is_file():
        ap.error(f"--table: no file {args.table}")
    return args


def schedule(text: str) -> Any:
    """``"9"`` -> 9, ``"8,8,4"`` -> (8, 8, 4), ``"decreasing:4"`` stays a string (the library checks it)."""
    text = text.strip()
    if text.startswith("decreasing"):
        return text
    values = common.ints(text)
    return values[0] if len(values) == 1 else tuple(values)


def candidates(text: str) -> list[Any]:
    """``"0,6,decreasing:4"`` -> ``[0, 6, "decreasing:4"]``."""
    return [t if t.startswith("decreasing") else int(t) for t in common.names(text)]


def load_rows(path: Path) -> list[dict]:
    """The rows already in ``path`` (none when it does not exist)."""
    return json.loads(path.read_text())["rows"] if path.exists() else []


def save_row(path: Path, row: dict) -> None:
    """Append ``row`` to ``path``, replacing an earlier row of the same (seed, row) and settings."""
    same = ("seed", "row", "budget", "tokens_r", "candidates", "calib_size", "eval_size")
    rows = [r for r in load_rows(path) if any(r.get(k) != row.get(k) for k in same)] + [row]
    common.write_json(path, {"rows": rows}, "benchmarks/tokens_table.py")


def prune_settings(row: str, args) -> dict[str, Any]:
    """The ``edgeprune.prune`` keywords of one row."""
    if row == "tokens":
        return {"target": "mlp", "sparsity": 0.0, "tokens_merge": schedule(args.tokens_r)}
    kw: dict[str, Any] = {"target": "all", "sparsity": None, "latency": args.budget, "latency_table": args.table}
    if row == "both":
        kw.update(tokens_merge="auto", tokens_candidates=candidates(args.candidates))
    return kw


def measured_ratio(rec: dict, dense, model, key: dict, shape, iterations: int) -> tuple[dict, str]:
    """(``{"dense_ms", "pruned_ms", "ratio"}``, where it came from): the kept round of the record's own
    measure-and-correct loop where it has one, else one interleaved measurement here."""
    from edgeprune.budget.latency_check import measure_pair

    got = (rec.get("latency_check") or {}).get("measured")
    if got:
        return got, "loop"
    return measure_pair(dense, model, key, shape, iterations), "here"


def tokens_summary(rec: dict) -> dict[str, Any]:
    """The merge of a record: schedule, r and tokens per block, and for auto its candidates."""
    tm = rec.get("tokens_merge") or {}
    auto = rec.get("tokens_auto") or {}
    out = {"schedule": tm.get("schedule"), "r": tm.get("r"), "tokens": tm.get("tokens")}
    if auto:
        out["auto"] = {"chosen": auto.get("chosen"), "skipped": auto.get("skipped"),
                       "candidates": [{k: c.get(k) for k in ("schedule", "r", "predicted_fraction", "measured",
                                                            "rounds", "check_error", "seconds")}
                                      for c in auto.get("candidates", [])]}
    return out


def run_seed(seed: int, args, spec, dense, batches, dense_eval: dict, key: dict, log) -> None:
    """Prune, measure and evaluate the asked rows of one seed; each row saved as it is done."""
    import edgeprune
    from edgeprune.anatomy import find_anatomy
    from edgeprune.budget import Budget
    from edgeprune.budget.correction_loop import table_measurer

    base = {"seed": seed, "budget": args.budget, "tokens_r": args.tokens_r, "candidates": args.candidates,
            "calib_size": args.calib_size, "eval_size": args.eval_size, "iterations": args.iterations}
    measurer = None
    for row in [r for r in common.names(args.rows) if r != "dense"]:
        if measurer is None and row != "tokens":  # the budgeted rows' loops (the table must be complete)
            measurer, why = table_measurer(Budget("latency", args.budget, table=args.table), find_anatomy(dense),
                                           iterations=args.iterations)
            if measurer is None:
                raise SystemExit(f"the table's latency cannot be measured here: {why}")
        calib = spec.calibration_source(args.calib_size, seed=seed)
        t0 = time.perf_counter()
        res = edgeprune.prune(dense, calib, spec=spec, measurer=measurer, **prune_settings(row, args))
        seconds = time.perf_counter() - t0
        lat, source = measured_ratio(res.record, dense, res.model, key, spec.input_size, args.iterations)
        m = common.top1(res.model, batches, dense_eval["preds"])
        out = {**base, "row": row, "prune_s": seconds, "measured": lat, "measured_in": source,
               "flops": common.ratios(res.record)[0], "params": common.ratios(res.record)[1],
               "top1": m["top1"], "agreement": m["agreement"], "dense_top1": dense_eval["top1"],
               "predicted": (res.record.get("latency_check") or {}).get("predicted_ratio"),
               "tokens_merge": tokens_summary(res.record)}
        save_row(Path(args.out), out)
        log(f"seed {seed} {row}: latency x{lat['ratio']:.3f} ({source}) FLOPs x{out['flops']:.3f} "
            f"top-1 {m['top1'] * 100:.2f}% (dense {dense_eval['top1'] * 100:.2f}%) prune {seconds:.0f} s")


def render(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (dense first, then by row and seed)."""
    order = {r: i for i, r in enumerate(ROWS)}
    lines = ["| row | latency budget | seed | measured latency x dense | FLOPs x dense | top-1 % | dense top-1 % | "
             "agreement % | merge (r per block) | prune s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (order[r["row"]], -r["budget"], r["seed"])):
        budget = f"x{r['budget']:g}" if r["row"] in ("widths", "both") else "-"
        tm = r.get("tokens_merge") or {}
        merge = "-" if not tm.get("r") or not any(tm["r"]) else f"{tm.get('schedule')} ({','.join(map(str, tm['r']))})"
        lat = r.get("measured")
        lines.append(f"| {r['row']} | {budget} | {r['seed']} | {'1' if lat is None else format(lat['ratio'], '.3f')} | "
                     f"{r['flops']:.3f} | {r['top1'] * 100:.2f} | {r['dense_top1'] * 100:.2f} | "
                     f"{r['agreement'] * 100:.2f} | {merge} | {r['prune_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.render:
        print(render(load_rows(out)))
        return 0
    import torch

    torch.set_num_threads(args.threads)
    key = json.loads(Path(args.table).read_text())["key"]  # backend, batch, threads (a table still building too)
    spec, dense = common.model(args.model, img_size=args.img_size)
    batches = common.eval_batches(spec, args.eval_size, args.eval_batch)
    t0 = time.perf_counter()
    dense_eval = common.top1(dense, batches)
    common.log(f"dense top-1 {dense_eval['top1'] * 100:.2f}% on {args.eval_size} held-out images "
               f"({time.perf_counter() - t0:.0f} s); {shlex.join(sys.argv)}")
    for seed in common.ints(args.seeds):
        if "dense" in common.names(args.rows):
            save_row(out, {"seed": seed, "row": "dense", "budget": args.budget, "tokens_r": args.tokens_r,
                           "candidates": args.candidates, "calib_size": args.calib_size, "eval_size": args.eval_size,
                           "measured": None, "flops": 1.0, "params": 1.0, "top1": dense_eval["top1"],
                           "agreement": 1.0, "dense_top1": dense_eval["top1"], "prune_s": 0.0})
        run_seed(seed, args, spec, dense, batches, dense_eval, key, common.log)
    print(render(load_rows(out)))
    return 0


if __name__ == "__main__":
    common.run_main(main)
