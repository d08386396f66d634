"""Image sources: in-memory tensors or ImageFolder directories, streamed in batches.

A source yields ``(images, labels)`` batches; images are preprocessed float32 (B, C, H, W), labels
int64 (B,) or ``None`` for unlabeled data. Folder sources decode lazily, so evaluation over a large
directory (ImageNet val) never holds more than one batch.

Image files are opened by :func:`open_image` (16-bit images scaled to 8 bits, decompression bombs
refused with one line); calibration and evaluation sets are compared by content
(:func:`check_disjoint`), so the same photo under two names is caught.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

from edgeprune.atomic import file_sha256
from edgeprune.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm")


class TensorSource:
    """Images (N, C, H, W) and optional labels (N,) held in memory."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | None = None,
                 description: str = "tensor") -> None:
        if labels is not None and len(labels) != len(images):
            raise ValueError("images and labels differ in length")
        self.images, self.labels, self.description = images, labels, description

    def __len__(self) -> int:
        return len(self.images)

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        for i in range(0, len(self.images), batch_size):
            yield (self.images[i:i + batch_size],
                   None if self.labels is None else self.labels[i:i + batch_size])


def list_image_folder(root: str | Path) -> tuple[list[Path], list[int], list[str]]:
    """Files, labels and class names of an ImageFolder tree (``root/<class>/<image>``).

    Classes are the sorted sub-directory names (for ImageNet synset folders this is the standard
    class index order). Images directly in ``root`` (no class folders) get label -1.

    Raises:
        UserError: missing directory or no images in it.
    """
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"image directory not found: {root}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files: list[Path] = []
    labels: list[int] = []
    for ci, cname in enumerate(classes):
        for f in sorted((root / cname).rglob("*")):
            if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file():
                files.append(f)
                labels.append(ci)
    for f in sorted(root.iterdir()):
        if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS:
            files.append(f)
            labels.append(-1)
    if not files:
        raise UserError(f"no images found in {root} (expected {root}/<class>/<image>.jpg)")
    return files, labels, classes


def _to_8bit(img):
    """A PIL image with 16-bit (``I;16*``) or 32-bit integer (``I``) samples -> 8-bit ``L``.

    PIL's own ``convert("RGB")`` clips such samples at 255 (a 16-bit photo turns almost white);
    here they are scaled: 16-bit values ``v`` become ``v >> 8`` (0..65535 -> 0..255). ``I`` images
    whose values all fit in 0..255 are kept as they are; larger ones are taken as 16-bit.
    """
    import numpy as np
    from PIL import Image

    a = np.asarray(img)
    if img.mode.startswith("I;16"):
        a8 = (a.astype(np.uint32) >> 8).astype(np.uint8)
    else:  # "I": int32
        a8 = a.clip(0, 255) if a.size == 0 or int(a.max()) <= 255 else (a.clip(0, 65535) >> 8)
        a8 = a8.astype(np.uint8)
    return Image.fromarray(a8, mode="L")


def open_image(path: str | Path):
    """Decode an image file to an 8-bit RGB PIL image.

    16-bit greyscale images (PNG ``I;16``) are scaled to 8 bits (``>> 8``), not clipped; images
    above PIL's ``Image.MAX_IMAGE_PIXELS`` (decompression-bomb guard) are refused.

    Raises:
        UserError: unreadable or undecodable file, or an image too large to decode safely (the
            message names the file).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.load()
                if img.mode.startswith("I;16") or img.mode == "I":
                    img = _to_8bit(img)
                return img.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise UserError(f"image {path} is too large to decode safely ({str(err).split('.')[0]}); "
                        "resize it or remove it from the folder") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        text = str(err).strip().splitlines()
        raise UserError(f"cannot read image {path}: {text[0] if text else type(err).__name__}") from None


class FolderSource:
    """Images from files, decoded and transformed batch by batch.

    Args:
        files: image paths; labels: one int per file (-1 = unlabeled);
        transform: PIL image -> (C, H, W) tensor (e.g. timm's eval transform).
    """

    def __init__(self, files: list[Path], labels: list[int], transform: Callable,
                 description: str = "folder") -> None:
        self.files, self.label_list, self.transform, self.description = files, labels, transform, description

    def __len__(self) -> int:
        return len(self.files)

    @property
    def labeled(self) -> bool:
        return all(lbl >= 0 for lbl in self.label_list)

    def _load(self, path: Path) -> torch.Tensor:
        return self.transform(open_image(path))

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        for i in range(0, len(self.files), batch_size):
            chunk = self.files[i:i + batch_size]
            x = torch.stack([self._load(f) for f in chunk])
            y = torch.tensor(self.label_list[i:i + batch_size]) if self.labeled else None
            yield x, y


def subset(files: list[Path], labels: list[int], n: int | None, seed: int) -> tuple[list[Path], list[int]]:
    """A seeded random subset of n files (all of them if n is None or >= len)."""
    if n is None or n >= len(files):
        return files, labels
    idx = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return [files[i] for i in idx], [labels[i] for i in idx]


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as err:
        raise UserError(f"cannot read image {path}: {err.strerror}") from None


def check_disjoint(calib_files: list[Path], eval_files: list[Path]) -> None:
    """Refuse calibration images that are also evaluation images: the same file, or the same bytes
    under another name.

    Cost: one ``stat`` per file; only files whose size occurs in both sets are hashed (sha256 of
    the bytes), each at most once.

    Raises:
        UserError: an overlap (the message names one pair and the count).
    """
    calib_sizes = {f: _size(f) for f in calib_files}
    eval_sizes = {f: _size(f) for f in eval_files}
    common = set(calib_sizes.values()) & set(eval_sizes.values())
    if not common:
        return
    hashes: dict[Path, str] = {}

    def digest(f: Path) -> str:
        key = f.resolve()
        if key not in hashes:
            try:
                hashes[key] = file_sha256(key)
            except OSError as err:
                raise UserError(f"cannot read image {f}: {err.strerror}") from None
        return hashes[key]

    eval_by_hash: dict[str, Path] = {}
    for f, size in eval_sizes.items():
        if size in common:
            eval_by_hash.setdefault(digest(f), f)
    pairs = [(f, eval_by_hash[digest(f)]) for f, size in calib_sizes.items()
             if size in common and digest(f) in eval_by_hash]
    if pairs:
        c, e = pairs[0]
        same = "the same file" if c.resolve() == e.resolve() else f"identical to {e}"
        raise UserError(f"calibration and evaluation images overlap ({len(pairs)} images, e.g. {c} is {same}); "
                        "they must be disjoint (remove them from one set)")
