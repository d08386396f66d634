"""Sub-blocks at chosen dims timed against a latency table's prediction (issue 40: is a miss in the grid?).

    OMP_NUM_THREADS=1 python benchmarks/latency_subblocks.py --table t.json --model deit_small_patch16_224 \
        --attn 6,24,40 3,24,40 6,40,40 --mlp 384 200

Times each attention sub-block (heads, Q/K dim, V dim) and MLP sub-block (width) of the model's block shape on
the table's backend, interleaved with the table's own dense references as ``latency-table`` does, and prints the
measured ms next to the table's (interpolated) entry and their relative difference. ``--json FILE`` writes the
same. Needs the table's backend here (ONNX Runtime for a CPU table); timings are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True, help="a complete latency table (latency-table -o)")
    ap.add_argument("--model", default="deit_small_patch16_224", help="timm name of the table's model shape")
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--attn", nargs="*", default=[], metavar="H,QK,V", help="attention points to time")
    ap.add_argument("--mlp", nargs="*", default=[], type=int, metavar="W", help="MLP widths to time")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    import edgeprune
    from edgeprune.anatomy import find_anatomy
    from edgeprune.latency.measure import TimingSettings, attn_subblock, get_timer, mlp_subblock
    from edgeprune.latency.relative import References
    from edgeprune.latency.table import LatencyTable

    t = LatencyTable.load(a.table)
    k = t.key
    torch.set_num_threads(int(k["threads"] or 1))
    spec = edgeprune.get_model_spec(a.model, random_init=True, num_classes=a.num_classes)
    an = find_anatomy(spec.create().eval())
    s = TimingSettings(threads=k["threads"], warmup=3, iterations=30, clock="cpu", max_seconds=2.0,
                       min_iterations=5, repeats=3, spread=0.05, retries=2)
    refs = References(get_timer(k["backend"]), an, k, s, int(k["batch"]))
    ref, shape, rows = t.meta["reference_ms"], (int(k["batch"]), k["tokens"], k["embed_dim"]), []
    try:
        for p in a.attn:
            h, q, v = (int(x) for x in p.split(","))
            ms = refs.measure("attn", attn_subblock(an.blocks[0], k["embed_dim"], h, q, v), shape).value * ref["attn"]
            rows.append({"part": f"attn heads {h} qk {q} v {v}", "measured_ms": ms, "table_ms": t.attn_ms(h, q, v)})
        for w in a.mlp:
            ms = refs.measure("mlp", mlp_subblock(an.blocks[0], k["embed_dim"], w), shape).value * ref["mlp"]
            rows.append({"part": f"mlp {w}", "measured_ms": ms, "table_ms": t.mlp_ms(w)})
    finally:
        refs.close()
    for r in rows:
        r["error"] = r["table_ms"] / r["measured_ms"] - 1.0
        print(f"{r['part']:28s} measured {r['measured_ms']:8.2f} ms  table {r['table_ms']:8.2f} ms  "
              f"{100 * r['error']:+.1f}%")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"table": a.table, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
