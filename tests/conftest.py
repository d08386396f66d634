"""Shared fixtures. Tests run on CPU with few threads; models are small or random-init."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

FMNIST_DIR = Path(os.environ.get("EDGEPRUNE_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
HAS_FMNIST = (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists() or (FMNIST_DIR / "train-images-idx3-ubyte").exists()
needs_fmnist = pytest.mark.skipif(not HAS_FMNIST, reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


@pytest.fixture(scope="session")
def timm():
    from edgeprune._compat import import_timm

    return import_timm()


@pytest.fixture(scope="session")
def fmnist_model():
    from edgeprune.zoo.fmnist_vit import create_fmnist_vit

    return create_fmnist_vit(pretrained=True)


@pytest.fixture(scope="session")
def fmnist_calib():
    """256 Fashion-MNIST train images (calibration) and 256 test images (evaluation)."""
    if not HAS_FMNIST:
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    from edgeprune.data.fashion_mnist import load_split

    xtr, _ = load_split("train")
    xte, yte = load_split("test")
    g = torch.Generator().manual_seed(0)
    return xtr[torch.randperm(len(xtr), generator=g)[:256]], xte[:256], yte[:256]
