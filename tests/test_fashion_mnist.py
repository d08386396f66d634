"""The Fashion-MNIST idx reader (``edgeprune.data.fashion_mnist``): values, the per-process cache of decoded files
(issue 43) and its invalidation, and one-line errors for damaged files. Small idx files written here; the real
dataset only where it is installed."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest
import torch

from edgeprune.data import fashion_mnist as fm
from edgeprune.errors import UserError


def _write_idx(path, arr: np.ndarray, gz: bool = True) -> None:
    head = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    data = head + arr.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)


def _fake(root, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    img, lbl = rng.integers(0, 256, (n, 28, 28)), rng.integers(0, 10, n)
    for split, (img_stem, lbl_stem) in fm._FILES.items():
        _write_idx(root / img_stem, img)
        _write_idx(root / lbl_stem, lbl)
    return img, lbl


@pytest.mark.parametrize("normalize", [True, False])
def test_values_equal_the_per_pixel_conversion(tmp_path, normalize):
    img, lbl = _fake(tmp_path, 5, 0)
    x, y = fm.load_split("test", tmp_path, normalize=normalize)
    ref = torch.from_numpy(img.astype(np.float32) / 255.0).unsqueeze(1)
    if normalize:
        ref = (ref - fm.MEAN) / fm.STD
    assert x.dtype == torch.float32 and x.shape == (5, 1, 28, 28) and torch.equal(x, ref)
    assert y.dtype == torch.int64 and torch.equal(y, torch.from_numpy(lbl.astype(np.int64)))


def test_a_rewritten_file_is_read_again_and_callers_cannot_change_the_cache(tmp_path):
    _fake(tmp_path, 4, 0)
    x1, _ = fm.load_split("train", tmp_path)
    first = x1.clone()
    x1 += 1.0  # the caller's copy: the next load is unaffected
    x2, _ = fm.load_split("train", tmp_path)
    assert torch.equal(first, x2)
    img_path = tmp_path / (fm._FILES["train"][0] + ".gz")
    before = img_path.stat()
    img, _ = _fake(tmp_path, 6, 1)  # other images, other size
    os.utime(img_path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    x3, _ = fm.load_split("train", tmp_path, normalize=False)
    assert x3.shape[0] == 6 and torch.equal(x3, torch.from_numpy(img.astype(np.float32) / 255.0).unsqueeze(1))


def test_damaged_files_are_one_line_errors_and_not_cached(tmp_path):
    _fake(tmp_path, 3, 0)
    img_gz = tmp_path / (fm._FILES["test"][0] + ".gz")
    raw = gzip.decompress(img_gz.read_bytes())
    with gzip.open(img_gz, "wb") as fh:
        fh.write(raw[:-10])
    with pytest.raises(UserError, match="truncated"):
        fm.load_split("test", tmp_path)
    with gzip.open(img_gz, "wb") as fh:
        fh.write(b"\x01" + raw[1:])
    with pytest.raises(UserError, match="not an unsigned-byte idx file"):
        fm.load_split("test", tmp_path)
    with gzip.open(img_gz, "wb") as fh:
        fh.write(raw)
    assert fm.load_split("test", tmp_path)[0].shape[0] == 3
