"""Weights of a fixed list of prunes, hashed: the output-invariance check of a refactor (issue 39).

    python tools/output_hashes.py -o hashes.json            # on the old commit, then on the new one
    python tools/output_hashes.py --compare old.json new.json

Each case runs the CLI on the embedded ``fmnist-vit`` (64 calibration images, no evaluation, one torch
thread so that the sums are ordered the same way) and hashes the run's ``model.safetensors`` tensors
(sha256 over the sorted names, dtypes, shapes and bytes: the state_dict, not the file's header). The
int8 case hashes the ONNX Runtime outputs of the quantized file on fixed inputs (rounded to 1e-5), since a
graph's bytes also hold names and metadata. The latency case prunes against a hand-made table of
fmnist-vit's shape written by this script (no timing: the same table on every machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["--model", "fmnist-vit", "--calib-size", "64", "--no-eval", "--quiet"]
CASES = {
    "default": ["prune"],
    "flops0.5": ["prune", "--flops", "0.5"],
    "params0.6-sequential": ["prune", "--params", "0.6", "--sequential"],
    "latency0.5": ["prune", "--latency", "0.5", "--latency-table", "{table}"],
    "embed0.25": ["prune", "--embed-sparsity", "0.25"],
    "embed-auto-flops0.5": ["prune", "--embed-sparsity", "auto", "--flops", "0.5"],
    "fused-all-0.4": ["prune", "--layout", "fused", "--target", "all", "--sparsity", "0.4"],
    "derive-flops60M": ["derive", "--flops", "60M", "--classes", "0,3,7"],
}


def write_table(path: Path) -> None:
    """A hand-made latency table of fmnist-vit's shape (attention: per head and per dim; MLP: per width)."""
    from edgeprune.latency.table import LatencyTable
    from edgeprune.zoo.registry import get_model_spec
    from edgeprune.anatomy import find_anatomy

    an = find_anatomy(get_model_spec("fmnist-vit").create())
    b = an.blocks[0]
    d, depth, h, hd, hidden = an.embed_dim, len(an.blocks), b.num_heads, b.head_dim, b.fc1.out_features
    tokens = an.vit.patch_embed.num_patches + an.vit.num_prefix_tokens
    key = {"embed_dim": d, "depth": depth, "num_heads": h, "head_dim": hd, "mlp_hidden": hidden, "tokens": tokens,
           "batch": 8, "precision": "fp32", "backend": "onnxruntime", "backend_version": "0",
           "device_name": "hand-made", "profile": "cpu", "threads": 1}
    heads, dims = list(range(1, h + 1)), list(range(8, hd + 1, 8))
    widths = list(range(0, hidden + 1, 32))
    ms = [[[0.05 + hh * (0.02 + 0.004 * (q + v)) for v in dims] for q in dims] for hh in heads]
    t = LatencyTable(key=key, rules={"mlp_round_to": 8, "head_dim_round_to": 8, "qk_equals_v": False},
                     mlp={"widths": widths, "ms": [0.05 + 0.003 * w for w in widths]},
                     attn={"heads": heads, "qk": dims, "v": dims, "ms": ms}, fixed_ms=0.5, dense_model_ms=0.0,
                     measured={"mlp": widths, "attn": [[a, q, v] for a in heads for q in dims for v in dims]})
    t.dense_model_ms = t.dense_ms()
    t.save(str(path))


def state_hash(path: Path) -> str:
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = tensors[name]
        h.update(f"{name}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def outputs_hash(onnx_path: Path) -> str:
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    shape = [8 if not isinstance(s, int) else s for s in inp.shape]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = sess.run(None, {inp.name: x})[0]
    return hashlib.sha256(np.round(y, 5).astype(np.float32).tobytes()).hexdigest()


def run(args: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "edgeprune.cli", *args], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    ap.add_argument("--only", nargs="*", help="case names")
    a = ap.parse_args()
    if a.compare:
        old, new = (json.loads(p.read_text()) for p in a.compare)
        bad = [k for k in old if old[k] != new.get(k)]
        for k in old:
            print(f"{k:24s} {old[k][:16]}  {'same' if k not in bad else 'DIFFERENT ' + str(new.get(k))[:16]}")
        raise SystemExit(1 if bad else 0)
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        write_table(tmp_path / "table.json")
        for name, args in CASES.items():
            if a.only and name not in a.only:
                continue
            run_dir = tmp_path / name
            args = [s.replace("{table}", str(tmp_path / "table.json")) for s in args]
            run([*args, *COMMON, "-o", str(run_dir)])
            out[name] = state_hash(run_dir / "model.safetensors")
            print(f"{name:24s} {out[name]}", flush=True)
            if name == "default":
                run(["export", str(run_dir), "-o", str(tmp_path / "m.onnx")])
                run(["quantize", str(tmp_path / "m.onnx"), "--precision", "int8", "-o", str(tmp_path / "q.onnx"),
                     "--calib-size", "64"])
                out["default-int8-outputs"] = outputs_hash(tmp_path / "q.onnx")
                print(f"{'default-int8-outputs':24s} {out['default-int8-outputs']}", flush=True)
    if a.output:
        a.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
