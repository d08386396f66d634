"""Whole heads vs head dims at equal FLOPs, with and without the heads' MLP refit (docs/heads.md).

Usage: python tools/heads_table.py MODEL IMG_SIZE CALIB EVAL FLOPS LAYOUTS [MODES] [SEED]
  MODEL: zoo name (fmnist-vit, dinov2-s14-fmnist); IMG_SIZE: 0 = the model's own;
  CALIB / EVAL: calibration / test images; FLOPs target (x dense);
  LAYOUTS: comma list of layout:attention_sparsity (heads, fused, qk; as tools/bench_layout.py);
  MODES: "on", "off" or "on,off" (off = the refit switched off: the behaviour before it);
  SEED: calibration sampling seed (default 0).
Prints one markdown row per run: FLOPs target, layout, refit, heads/qk/v/mlp, FLOPs x, top-1,
agreement with dense, logit MSE to dense, prune seconds. One-shot CORP, no output correction.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from bench_layout import attention_dims, mlp_for_flops  # noqa: E402
from edgeprune.api import prune
from edgeprune.anatomy import find_anatomy
from edgeprune.zoo.registry import get_model_spec
import edgeprune.pipeline as pipeline
torch.set_num_threads(1)
name, img, ncal, nev, flops, lays = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
modes = sys.argv[7].split(",") if len(sys.argv) > 7 else ["on"]
seed = int(sys.argv[8]) if len(sys.argv) > 8 else 0
spec = get_model_spec(name, img_size=img if img > 0 else None)
dense = spec.create(pretrained=True)
b0 = find_anatomy(dense).blocks[0]
calib = spec.calibration_source(ncal, seed=seed)
ev = spec.eval_source(n=nev)
def logits(m):
    outs, ys = [], []
    with torch.no_grad():
        for x, y in ev.batches(64):
            outs.append(m(x)); ys.append(y)
    return torch.cat(outs), torch.cat(ys)
t0 = time.time()
ld, y = logits(dense)
print(f"{name} img {img} calib {ncal} seed {seed} eval {len(y)}: dense top1 {(ld.argmax(-1)==y).float().mean():.4f} ({time.time()-t0:.0f}s)", flush=True)
orig = pipeline.prepare_refit
for lay in lays.split(","):
    layout, s = lay.split(":"); s = float(s)
    attn = attention_dims(layout, b0.num_heads, b0.head_dim, s)
    mlp, _ = mlp_for_flops(dense, attn, flops)
    kw = {"mlp_sparsity": 1 - mlp / b0.mlp_hidden} if mlp < b0.mlp_hidden else {}
    if layout == "heads":
        kw["head_sparsity"] = s
    else:
        kw["attn_sparsity"] = s
    for mode in modes:
        if layout != "heads" and mode == "off":
            continue
        pipeline.prepare_refit = orig if mode == "on" else (lambda *a: None)
        t0 = time.time()
        res = prune(dense, calib, target="mlp", sparsity=None, layout="fused" if layout == "fused" else "default", **kw)
        tp = time.time() - t0
        lp, _ = logits(res.model)
        b = res.record["blocks"][0]
        r = res.record["flops"] / res.record["dense_flops"]
        print(f"| x{flops:g} | {layout} s={s:g} | refit {mode} | {b['num_heads']}/{b['qk_dim']}/{b['v_dim']}/{b['mlp_hidden']} | {r:.3f} | "
              f"{(lp.argmax(-1)==y).float().mean():.4f} | {(lp.argmax(-1)==ld.argmax(-1)).float().mean():.4f} | {(lp-ld).pow(2).mean():.4f} | prune {tp:.0f}s", flush=True)
