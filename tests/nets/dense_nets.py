"""Networks with a timm ViT inside, for the dense-network tests (issue 55): builders a user would pass as
``--model-file tests/nets/dense_nets.py:BUILDER``.

* :func:`saliency_net` -- a ``dinov2-s14``-like wrapper: a DINOv2-style ViT (registers, LayerScale) at
  ``.encoder``, a conv decoder on its final patch tokens -> (B, 1, H, W) probabilities.
* :func:`dpt_net` -- a DPT-style head reading 4 intermediate blocks (``forward_intermediates``) of a ViT at
  ``.pretrained`` -> ``{"depth": (B, 1, H, W), "features": (B, C)}``.
* :func:`hook_net` -- a head reading blocks 1 and 3 through forward hooks -> a tuple.
* :func:`two_vit_net` -- two ViTs (``rgb.vit``, ``aux``): needs a named backbone.
* :func:`fixed_count_net` -- a head that reads the patch tokens by a fixed count.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import edgeprune  # noqa: F401  (timm shim)
import timm

IMG = 32


def tiny_vit(img: int = IMG, depth: int = 4, reg: int = 0, cls: bool = True, dinov2: bool = False) -> nn.Module:
    """A small timm ViT (patch 8, dim 64, 4 heads) with seeded weights."""
    torch.manual_seed(0)
    kw = dict(img_size=img, patch_size=8, embed_dim=64, depth=depth, num_heads=4, num_classes=0,
              reg_tokens=reg, class_token=cls, global_pool="token" if cls else "avg")
    if dinov2:
        kw.update(init_values=1e-1)
    vit = timm.create_model("vit_small_patch16_224", **kw)
    return vit.eval()


class SaliencyNet(nn.Module):
    """ViT at ``.encoder`` + conv decoder on the final normalised patch tokens."""

    def __init__(self, img: int = IMG):
        super().__init__()
        self.encoder = tiny_vit(img, reg=4, dinov2=True)
        self.decoder = nn.Sequential(nn.Conv2d(64, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 1, 1))

    def forward(self, x):
        t = self.encoder.forward_features(x)[:, self.encoder.num_prefix_tokens:]
        h, w = self.encoder.patch_embed.grid_size
        m = self.decoder(t.transpose(1, 2).unflatten(2, (h, w)))
        return torch.sigmoid(F.interpolate(m, size=x.shape[-2:], mode="bilinear", align_corners=False))


class DPTNet(nn.Module):
    """DPT-style: 4 taps of ``.pretrained`` (blocks 0..3) fused by convs; a dict output."""

    def __init__(self, img: int = IMG):
        super().__init__()
        self.pretrained = tiny_vit(img, depth=4)
        self.proj = nn.ModuleList(nn.Conv2d(64, 16, 1) for _ in range(4))
        self.head = nn.Conv2d(16, 1, 3, padding=1)
        self.pool = nn.Linear(64, 8)

    def forward(self, x):
        final, taps = self.pretrained.forward_intermediates(x, indices=[0, 1, 2, 3], norm=True)
        fused = sum(p(t) for p, t in zip(self.proj, taps))
        depth = F.interpolate(self.head(F.relu(fused)), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return {"depth": depth, "features": self.pool(final[:, 0])}


def _keep_output(module, _args, out):
    module.tap = out  # on the module itself: a deepcopy of the network copies the hook with its block


class HookNet(nn.Module):
    """A head that reads blocks 1 and 3 through forward hooks registered at construction (a tuple output)."""

    def __init__(self):
        super().__init__()
        self.vit = tiny_vit(reg=2, cls=False)
        for i in (1, 3):
            self.vit.blocks[i].register_forward_hook(_keep_output)
        self.head = nn.Linear(128, 6)

    def forward(self, x):
        final = self.vit.forward_features(x)
        taps = [self.vit.blocks[i].__dict__.pop("tap").mean(1) for i in (1, 3)]  # read once: nothing kept
        return self.head(torch.cat(taps, -1)), final[:, 2:].mean(1)


class TwoViTNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rgb = nn.Module()
        self.rgb.vit = tiny_vit(depth=2)
        self.aux = tiny_vit(depth=2)

    def forward(self, x):
        return self.rgb.vit.forward_features(x).mean(1) + self.aux.forward_features(x).mean(1)


class FixedCountNet(nn.Module):
    """A head that reads exactly 16 patch tokens by a fixed reshape (breaks under token merging)."""

    def __init__(self):
        super().__init__()
        self.vit = tiny_vit()
        self.lin = nn.Linear(16 * 64, 4)

    def forward(self, x):
        t = self.vit.forward_features(x)[:, 1:]
        return self.lin(t.reshape(x.shape[0], 16 * 64))


def image_folder(folder, n: int, seed: int):
    """``folder/x/*.png``: n seeded 40 x 40 noise photos (an unlabeled ImageFolder); returns ``folder``."""
    from pathlib import Path

    import numpy as np
    from PIL import Image

    folder = Path(folder)
    rng = np.random.default_rng(seed)
    (folder / "x").mkdir(parents=True)
    for i in range(n):
        Image.fromarray((rng.random((40, 40, 3)) * 255).astype("uint8")).save(folder / "x" / f"{seed}_{i}.png")
    return folder


def saliency_net() -> nn.Module:
    return SaliencyNet().eval()


def dpt_net(img_size: int = IMG) -> nn.Module:
    """``img_size``: the builder's own keyword (``--model-kwargs img_size=48``), not timm's option."""
    return DPTNet(int(img_size)).eval()


def hook_net() -> nn.Module:
    return HookNet().eval()


def two_vit_net() -> nn.Module:
    return TwoViTNet().eval()


def fixed_count_net() -> nn.Module:
    return FixedCountNet().eval()


def raising_net() -> nn.Module:
    raise RuntimeError("weights file not found")


def not_a_module():
    return 42


class StringOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.vit = tiny_vit(depth=1)

    def forward(self, x):
        return "no tensor"


def string_net() -> nn.Module:
    return StringOut().eval()


class NotViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.vit = tiny_vit(depth=1)
        self.decoder = nn.Conv2d(3, 1, 1)

    def forward(self, x):
        return self.decoder(x) + self.vit.forward_features(x).mean()


def not_vit_path_net() -> nn.Module:
    return NotViT().eval()
