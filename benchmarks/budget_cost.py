"""What a budgeted prune costs against a uniform one of the same model and images (issue 40 item 4).

    OMP_NUM_THREADS=1 python benchmarks/budget_cost.py --model deit_small_patch16_224 --images 64 --flops 0.5

Prunes a random-init timm model (10 classes) twice in one process, side by side: ``target="both",
sparsity=0.5`` (uniform) and the budget (``flops=`` or ``latency=`` with ``--latency-table``), and prints
both wall times, their ratio and the budgeted run's ``timing.split`` (statistics, curves, sensitivity,
check, allocation, solve, output; ``edgeprune.pruning.record.cost_split``), a latency prune's measurement
(every round's ``measure_seconds``) and the rest (``other_s``). ``--json FILE`` writes the same.
Timings are noisy on a shared machine: compare the ratio, measured in one process.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deit_small_patch16_224")
    ap.add_argument("--images", type=int, default=64, help="calibration images (random noise)")
    ap.add_argument("--flops", type=float, default=None)
    ap.add_argument("--latency", type=float, default=None)
    ap.add_argument("--latency-table", default=None)
    ap.add_argument("--sensitivity-images", type=int, default=None, help="[the library's default]")
    ap.add_argument("--latency-tolerance", type=float, default=None,
                    help="the measure-and-correct loop's tolerance [the library's default, 0.03]")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    import edgeprune

    budget = {"latency": a.latency, "latency_table": a.latency_table} if a.latency else {"flops": a.flops or 0.5}
    spec = edgeprune.get_model_spec(a.model, random_init=True, num_classes=10)
    model = spec.create()
    x = torch.randn(a.images, 3, *spec.input_size[1:], generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    edgeprune.prune(model, x, target="both", sparsity=0.5, batch_size=32)
    uniform = time.perf_counter() - t
    t = time.perf_counter()
    extra = {} if a.sensitivity_images is None else {"allocation_sensitivity_images": a.sensitivity_images}
    if a.latency_tolerance is not None:
        extra["correction_tolerance"] = a.latency_tolerance
    res = edgeprune.prune(model, x, batch_size=32, **extra, **budget)
    budgeted = time.perf_counter() - t
    out = {"model": a.model, "images": a.images, "budget": res.record["allocation"]["budget"],
           "uniform_s": uniform, "budgeted_s": budgeted, "ratio": budgeted / uniform,
           "split": res.record["timing"].get("split")}
    chk = res.record.get("latency_check") or {}
    if chk.get("rounds"):  # the measure-and-correct loop: what each round cost (allocation + solve, measuring)
        out["rounds"] = [{**{k: r[k] for k in ("round", "budget_value", "predicted", "measured", "miss", "seconds",
                                               "measure_seconds")},
                          "pairs": (r.get("measured_ms") or {}).get("pairs"),
                          "ratio_interval": (r.get("measured_ms") or {}).get("ratio_interval")} for r in chk["rounds"]]
        out["chosen_round"] = chk.get("chosen_round")
        out["measurement_s"] = sum(r["measure_seconds"] for r in chk["rounds"])
    # what neither the split nor the measurement holds (the dense copy, surgery, the record, earlier rounds)
    out["other_s"] = budgeted - sum((out["split"] or {}).values()) - out.get("measurement_s", 0.0)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
