"""``fmnist-dinov3`` (issue 54 item 5): the shipped weights load strictly into a timm ``Eva`` with DINOv3's 2D RoPE,
a class token and 4 registers, and reach >= 85% top-1 on the first 2000 Fashion-MNIST test images."""

from __future__ import annotations

import pytest
import torch

import edgeprune  # noqa: F401  (installs the torchvision shim before timm)
from edgeprune.errors import UserError
from edgeprune.zoo import fmnist_dinov3
from edgeprune.zoo.entries import zoo_entry
from tests.conftest import needs_fmnist


@pytest.fixture(scope="module")
def model():
    return fmnist_dinov3.create_fmnist_dinov3(pretrained=True)


def test_shipped_weights_build_a_dinov3_shaped_eva(model):
    from timm.layers import RotaryEmbeddingDinoV3
    from timm.models.eva import Eva

    assert isinstance(model, Eva) and not model.training
    assert isinstance(model.rope, RotaryEmbeddingDinoV3) and model.pos_embed is None
    assert model.cls_token is not None and model.reg_token.shape == (1, 4, 128) and model.num_prefix_tokens == 5
    assert model.patch_embed.grid_size == (7, 7) and len(model.blocks) == 6 and model.global_pool == "avg"
    gamma = model.blocks[0].gamma_1.detach()
    assert gamma.shape == (128,) and not torch.allclose(gamma, torch.full_like(gamma, 0.1))  # LayerScale, trained
    with torch.no_grad():
        assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_zoo_entry_builds_it_with_fmnist_vit_inputs():
    entry, vit = zoo_entry("fmnist-dinov3"), zoo_entry("fmnist-vit")
    assert entry.spec_fields(None, None, None) == vit.spec_fields(None, None, None)
    assert type(entry.build(None, pretrained=False)).__name__ == "Eva"


def test_missing_weights_are_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setattr(fmnist_dinov3, "WEIGHTS", tmp_path / "absent.safetensors")
    with pytest.raises(UserError, match="fmnist-dinov3 weights missing"):
        fmnist_dinov3.create_fmnist_dinov3(pretrained=True)


@needs_fmnist
def test_top1_on_the_first_2000_test_images(model):
    from edgeprune.data.fashion_mnist import load_split

    x, y = load_split("test")
    x, y = x[:2000], y[:2000]
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 250]).argmax(-1) == y[i:i + 250]).sum()) for i in range(0, 2000, 250))
    assert correct / 2000 >= 0.85


@needs_fmnist
def test_the_spec_converts_it_and_pruning_nothing_keeps_its_logits(model):
    """Built by name, the trained model is the exact converted form; sparsity 0 reproduces its logits on real
    images (train split for calibration, test split to compare: disjoint)."""
    from edgeprune.layers.rotary_attention import RotaryAttention
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("fmnist-dinov3")
    vit = spec.create(pretrained=True)
    assert all(isinstance(b.attn, RotaryAttention) for b in vit.blocks)
    x = spec.eval_source(n=16).batches(16)
    imgs = next(iter(x))[0]
    with torch.no_grad():
        dense = model(imgs)
        assert torch.allclose(vit(imgs), dense, atol=1e-5)
    res = edgeprune.prune(vit, spec.calibration_source(32), spec=spec, target="both", sparsity=0.0)
    with torch.no_grad():
        assert torch.allclose(res.model(imgs), dense, atol=1e-5)
