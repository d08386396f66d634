"""``fmnist-dinov3``: a small DINOv3-shaped timm ``Eva`` trained on Fashion-MNIST, for measured accuracy.

Architecture: timm's ``vit_small_patch16_dinov3`` (a plain ``timm.models.eva.Eva``) with its DINOv3
settings kept -- 2D RoPE of DINOv3 (``rope_type="dinov3"``, half rotation, temperature 100, no absolute
position embedding), no qkv bias, LayerNorm eps 1e-5, no fc norm, a class token + 4 register tokens,
LayerScale -- and its size overridden: 28x28x1 input, patch 4 (7x7 = 49 patch tokens, fixed grid,
``dynamic_img_size=False``), embed_dim 128, 6 blocks, 2 heads of head_dim 64, MLP hidden 512
(mlp_ratio 4), 10 classes. The head reads the average of the patch tokens, ``global_pool="avg"``: timm's
default for DINOv3 (upstream DINOv3 reads the class token; the average also trains much faster on a small
dataset, as in ``fmnist-vit``).

LayerScale ``init_values=0.1`` rather than DINOv3's 1e-5: with 1e-5 every residual branch starts at
(almost) zero and a from-scratch run of a few CPU epochs spends much of its budget growing the scales;
0.1 keeps LayerScale a real, trained per-channel scale (the pruning pipeline has to handle it) while the
blocks contribute from the first step.

Weights: ``edgeprune/zoo/weights/fmnist_dinov3.safetensors``, produced by
``tools/train_fmnist_dinov3.py`` on the Fashion-MNIST train split (4 epochs; 86.16% top-1 on the 10k
test split, which only measured it). Inputs are normalised like
``fmnist-vit``'s (``edgeprune.data.fashion_mnist.MEAN`` / ``STD``).
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn
from safetensors.torch import load_file

from edgeprune._compat import import_timm
from edgeprune.errors import UserError

WEIGHTS = Path(__file__).parent / "weights" / "fmnist_dinov3.safetensors"

#: keyword arguments of ``timm.create_model("vit_small_patch16_dinov3", ...)``; the DINOv3 settings not
#: named here (rope_type "dinov3", rope_rotate_half, rope_temperature 100, use_rot_pos_emb, no abs pos
#: embed, qkv_bias False, LayerNorm eps 1e-5, use_fc_norm False) are the timm variant's own.
CONFIG = dict(
    img_size=28,
    patch_size=4,
    in_chans=1,
    num_classes=10,
    embed_dim=128,
    depth=6,
    num_heads=2,
    mlp_ratio=4.0,
    num_reg_tokens=4,
    class_token=True,
    init_values=0.1,
    global_pool="avg",
    dynamic_img_size=False,
)


def create_fmnist_dinov3(pretrained: bool = True) -> nn.Module:
    """Build ``fmnist-dinov3`` (a timm ``Eva``) in eval mode; load the shipped weights when ``pretrained``.

    Raises:
        UserError: ``pretrained`` and the weights file is missing (broken install).
    """
    timm = import_timm()
    model = timm.create_model("vit_small_patch16_dinov3", pretrained=False, **CONFIG)
    if pretrained:
        if not WEIGHTS.exists():
            raise UserError(f"fmnist-dinov3 weights missing at {WEIGHTS} (reinstall edgeprune)")
        model.load_state_dict(load_file(str(WEIGHTS)), strict=True)
    return model.eval()
