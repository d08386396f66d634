"""``fmnist-vit``: the embedded default model, a small timm ViT trained on Fashion-MNIST.

Architecture (timm ``VisionTransformer``): 28x28x1 input, patch 4 (7x7 = 49 patch tokens, no class
token; the head reads the average token, ``global_pool="avg"``, which trains much faster than a
class token on a small dataset), embed_dim 128, 6 blocks, 2 heads of head_dim 64 (as in DeiT),
MLP hidden 512, 10 classes.
Weights: ``edgeprune/zoo/weights/fmnist_vit.safetensors``, produced by
``tools/train_fmnist_vit.py`` on the Fashion-MNIST train split.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn
from safetensors.torch import load_file

from edgeprune._compat import import_timm

WEIGHTS = Path(__file__).parent / "weights" / "fmnist_vit.safetensors"

CONFIG = dict(
    img_size=28,
    patch_size=4,
    in_chans=1,
    num_classes=10,
    embed_dim=128,
    depth=6,
    num_heads=2,
    mlp_ratio=4.0,
    qkv_bias=True,
    class_token=False,
    global_pool="avg",
)


def create_fmnist_vit(pretrained: bool = True) -> nn.Module:
    """Build ``fmnist-vit`` in eval mode; load the shipped weights when ``pretrained``.

    Raises:
        FileNotFoundError: ``pretrained`` and the weights file is missing (broken install).
    """
    timm = import_timm()
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(**CONFIG)
    if pretrained:
        if not WEIGHTS.exists():
            raise FileNotFoundError(f"fmnist-vit weights missing at {WEIGHTS}: reinstall edgeprune")
        model.load_state_dict(load_file(str(WEIGHTS)), strict=True)
    del timm
    return model.eval()
