"""Near-tied matches of a merged model, ONNX Runtime vs PyTorch (docs/tokens.md, "ONNX vs PyTorch"; issue 55):

    python benchmarks/merge_ties.py --run runs/dpt-example/run --onnx runs/dpt-example/pruned.onnx \\
        --img-size 448 --out docs/results/merge_ties.json

For each of foolbox's 20 ImageNet photos (resized bicubically to --img-size): the largest |ONNX - PyTorch| of the
output, and the smallest gap at a merge decision in PyTorch over every merge of every block -- the r-th vs the
(r+1)-th best similarity (which pairs merge) and the best vs the second-best partner of a merged token (where it
goes). A flip needs a gap within float rounding; the table shows whether the inputs that differ are those.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--onnx", type=Path, required=True)
    p.add_argument("--img-size", type=int, default=448)
    p.add_argument("--out", type=Path, default=Path("docs/results/merge_ties.json"))
    args = p.parse_args(argv)
    import numpy as np
    import onnxruntime as ort
    import torch
    import torch.nn.functional as F

    import edgeprune.tokens.merge as merge
    import edgeprune.tokens.unmerge as unmerge
    from edgeprune.artifact import load_run
    from edgeprune.data.photos import eval_photos

    model, _ = load_run(args.run)
    x = F.interpolate(eval_photos(), size=(args.img_size,) * 2, mode="bicubic", align_corners=False)
    gaps: list[tuple[float, float]] = []
    original = merge.bipartite_soft_matching

    def spy(metric, r, num_prefix=0, num_tokens=None):
        plan = original(metric, r, num_prefix, num_tokens)
        m = metric[:, num_prefix:]
        m = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        scores = m[:, 0::2] @ m[:, 1::2].transpose(-1, -2)
        ranked = scores.max(-1).values.sort(-1, descending=True).values
        two = scores.topk(2, -1).values
        gaps.append((float((ranked[:, r - 1] - ranked[:, r]).min()),
                     float((two[..., 0] - two[..., 1]).gather(-1, plan.src).min())))
        return plan

    for mod in (merge, unmerge):
        for name in dir(mod):
            if getattr(mod, name) is original:
                setattr(mod, name, spy)
    session = ort.InferenceSession(str(args.onnx), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    rows = []
    for i in range(len(x)):
        gaps.clear()
        with torch.no_grad():
            y = model(x[i:i + 1]).numpy()
        o = session.run(None, {name: x[i:i + 1].numpy()})[0]
        rows.append({"image": i, "max_abs_diff": float(np.abs(o - y).max()),
                     "min_gap_which": min(g[0] for g in gaps), "min_gap_where": min(g[1] for g in gaps),
                     "merges": len(gaps)})
        common.log(f"{i}: max |diff| {rows[-1]['max_abs_diff']:.2e}, gaps {rows[-1]['min_gap_which']:.1e} / "
                   f"{rows[-1]['min_gap_where']:.1e}")
    common.write_json(args.out, {"rows": rows, "img_size": args.img_size}, "benchmarks/merge_ties.py",
                      " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    return 0


if __name__ == "__main__":
    common.run_main(main)
