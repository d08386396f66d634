"""Image sources: in-memory tensors or ImageFolder directories, streamed in batches.

A source yields ``(images, labels)`` batches; images are preprocessed float32 (B, C, H, W), labels
int64 (B,) or ``None`` for unlabeled data. Folder sources decode lazily, so evaluation over a large
directory (ImageNet val) never holds more than one batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import torch

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
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as img:
                return self.transform(img.convert("RGB"))
        except (UnidentifiedImageError, OSError) as err:
            raise UserError(f"cannot read image {path}: {err}") from None

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


def check_disjoint(calib_files: list[Path], eval_files: list[Path]) -> None:
    """Raises UserError if a calibration image is also an evaluation image (same resolved path)."""
    overlap = {f.resolve() for f in calib_files} & {f.resolve() for f in eval_files}
    if overlap:
        raise UserError(f"calibration and evaluation images overlap ({len(overlap)} files, e.g. "
                        f"{sorted(overlap)[0]}); they must be disjoint")
