"""Train the embedded ``fmnist-dinov3`` (a DINOv3-shaped timm ``Eva``) on the Fashion-MNIST train split
(reproducible, CPU, one torch thread).

The shipped weights were made with:

    python tools/train_fmnist_dinov3.py --epochs 4 --lr 2e-3 --warmup-epochs 0.3 --save-every-epoch

(one torch thread, the default; 3733 s on a shared 2-core machine; test top-1 after each epoch
79.71 / 80.80 / 85.27 / 86.16%; sha256 ae2ed3fc55f0c03b4a7ae2ac7155030147938e478859bfb9c8503c80aae79c7e).

Recipe: AdamW (weight decay 0.05, betas 0.9/0.999), batch 128, linear warm-up then cosine to 1e-5,
label smoothing 0.1, seed 0, no augmentation (as for ``fmnist-vit``'s shipped weights), one torch
thread. The test split is only evaluated and printed after each epoch; the final epoch's weights are
kept (nothing is selected on the test split). ``--max-steps N`` stops after N training steps and prints
the time per step (to size a run; it writes no weights).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeprune.data.fashion_mnist import load_split  # noqa: E402
from edgeprune.zoo.fmnist_dinov3 import CONFIG, create_fmnist_dinov3  # noqa: E402
from train_fmnist_vit import evaluate, save  # noqa: E402  (the fmnist-vit trainer's, beside this script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--data", default=None, help="Fashion-MNIST directory (default: Debian's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="edgeprune/zoo/weights/fmnist_dinov3.safetensors")
    ap.add_argument("--warmup-epochs", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps, print s/step, save nothing")
    ap.add_argument("--save-every-epoch", action="store_true", help="write the weights after every epoch")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    xtr, ytr = load_split("train", args.data)
    xte, yte = load_split("test", args.data)
    model = create_fmnist_dinov3(pretrained=False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(len(xtr) / args.batch)
    total = steps_per_epoch * args.epochs
    warm = int(steps_per_epoch * args.warmup_epochs)
    recipe = "tools/train_fmnist_dinov3.py " + " ".join(sys.argv[1:])

    def lr_at(step: int) -> float:
        if step < warm and warm > 0:
            return args.lr * (step + 1) / warm
        t = (step - warm) / max(1, total - warm)
        return 1e-5 + 0.5 * (args.lr - 1e-5) * (1 + math.cos(math.pi * t))

    step = 0
    start = time.time()
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(xtr), generator=gen)
        t0 = time.time()
        run_loss = 0.0
        for i in range(0, len(xtr), args.batch):
            idx = perm[i:i + args.batch]
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx], label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run_loss += loss.item()
            step += 1
            if args.max_steps is not None and step >= args.max_steps:
                dt = (time.time() - t0) / step
                print(f"{step} steps, {dt:.3f} s/step, loss {run_loss / step:.4f}; "
                      f"one epoch = {steps_per_epoch} steps = {dt * steps_per_epoch / 60:.1f} min", flush=True)
                t1 = time.time()
                acc = evaluate(model, xte, yte)
                print(f"test evaluation {time.time() - t1:.0f}s (top-1 {acc * 100:.2f}%)")
                return
        acc = evaluate(model, xte, yte)
        print(f"epoch {epoch + 1}/{args.epochs} loss {run_loss / steps_per_epoch:.4f} "
              f"test top-1 {acc * 100:.2f}% ({time.time() - t0:.0f}s, total {time.time() - start:.0f}s)", flush=True)
        if args.save_every_epoch:
            save(model, Path(args.out), {"config": repr(CONFIG), "epochs": f"{epoch + 1}/{args.epochs}",
                                         "test_top1": f"{acc:.4f}", "partial": "true", "recipe": recipe})

    model.eval()
    out = Path(args.out)
    save(model, out, {"config": repr(CONFIG), "epochs": str(args.epochs), "test_top1": f"{acc:.4f}",
                      "recipe": recipe})
    print(f"saved {out} (test top-1 {acc * 100:.2f}%, {time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
