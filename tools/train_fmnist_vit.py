"""Train the embedded ``fmnist-vit`` on the Fashion-MNIST train split (reproducible, CPU).

The shipped weights were made with:

    python tools/train_fmnist_vit.py --epochs 7 --lr 1.5e-3 --no-augment --warmup-epochs 0.3 \
        --save-every-epoch

Recipe: AdamW (weight decay 0.05, betas 0.9/0.999), batch 128, linear warm-up then cosine to
1e-5, label smoothing 0.1, seed 0; optional augmentation (random 28x28 crop of the 2-pixel padded
image + horizontal flip; off for the shipped weights: with a 7-epoch budget on 2 CPU cores it
slowed convergence). The test split is only evaluated and printed after each epoch; the final
epoch's weights are kept (nothing is selected on the test split).
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
from edgeprune.zoo.fmnist_vit import CONFIG, create_fmnist_vit  # noqa: E402


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random 2-pixel shift (crop of the zero-padded image) and horizontal flip; x (B,1,28,28)."""
    b = x.shape[0]
    pad = F.pad(x, (2, 2, 2, 2), value=float(x.min()))
    dx = torch.randint(0, 5, (b,), generator=gen)
    dy = torch.randint(0, 5, (b,), generator=gen)
    out = torch.stack([pad[i, :, dy[i]:dy[i] + 28, dx[i]:dx[i] + 28] for i in range(b)])
    flip = torch.rand(b, generator=gen) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


@torch.no_grad()
def evaluate(model, x, y, batch=1000) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        correct += (model(x[i:i + batch]).argmax(-1) == y[i:i + batch]).sum().item()
    return correct / len(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", default=None, help="Fashion-MNIST directory (default: Debian's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="edgeprune/zoo/weights/fmnist_vit.safetensors")
    ap.add_argument("--init", default=None, help="start from these weights (second stage)")
    ap.add_argument("--no-augment", action="store_true", help="no shift/flip augmentation")
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--save-every-epoch", action="store_true", help="write the weights after every epoch")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    xtr, ytr = load_split("train", args.data)
    xte, yte = load_split("test", args.data)
    model = create_fmnist_vit(pretrained=False).train()
    if args.init:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(args.init), strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(len(xtr) / args.batch)
    total = steps_per_epoch * args.epochs
    warm = int(steps_per_epoch * args.warmup_epochs)

    def lr_at(step: int) -> float:
        if step < warm and warm > 0:
            return args.lr * (step + 1) / warm
        t = (step - warm) / max(1, total - warm)
        return 1e-5 + 0.5 * (args.lr - 1e-5) * (1 + math.cos(math.pi * t))

    step = 0
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(xtr), generator=gen)
        t0 = time.time()
        run_loss = 0.0
        for i in range(0, len(xtr), args.batch):
            idx = perm[i:i + args.batch]
            xb = xtr[idx] if args.no_augment else augment(xtr[idx], gen)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = F.cross_entropy(model(xb), ytr[idx], label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run_loss += loss.item()
            step += 1
        acc = evaluate(model, xte, yte)
        print(f"epoch {epoch + 1}/{args.epochs} loss {run_loss / steps_per_epoch:.4f} "
              f"test top-1 {acc * 100:.2f}% ({time.time() - t0:.0f}s)", flush=True)
        if args.save_every_epoch:
            save(model, Path(args.out), {"config": repr(CONFIG), "epochs": f"{epoch + 1}/{args.epochs}",
                                         "test_top1": f"{acc:.4f}", "partial": "true",
                                         "recipe": "tools/train_fmnist_vit.py " + " ".join(sys.argv[1:])})

    model.eval()
    out = Path(args.out)
    save(model, out, {"config": repr(CONFIG), "epochs": str(args.epochs), "test_top1": f"{acc:.4f}",
                      "recipe": "tools/train_fmnist_vit.py " + " ".join(sys.argv[1:])})
    print(f"saved {out} (test top-1 {acc * 100:.2f}%)")


def save(model, out: Path, meta: dict) -> None:
    """Write the weights atomically (temp file + rename)."""
    from edgeprune.atomic import atomic_save_safetensors

    atomic_save_safetensors(out, {k: v.contiguous() for k, v in model.state_dict().items()}, meta)


if __name__ == "__main__":
    main()
