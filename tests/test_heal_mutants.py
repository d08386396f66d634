"""Known-answer tests for ``edgeprune.heal.alignment`` (issue 17: mutation check of STARFISH's loss).

Per-image / per-block losses on hand-made representations with known cosines (1, 0, -1: losses
0, 1, 2) and known squared differences; dtype handling; each input error alone; and
``BlockCapture`` on a tiny random timm ViT: it stops after the last block (the final norm is never
evaluated), resets its buffer, falls back to the whole model without ``forward_features``, reports
blocks that produced nothing, and removes its hooks. < 1 s in total.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.heal.alignment import (BlockCapture, alignment_loss, per_block_alignment,
                                      per_image_alignment)


def _vit(timm, depth=3):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=8, num_classes=5, embed_dim=16, depth=depth,
                             num_heads=2, mlp_ratio=2).eval()


def _manual(model, x):
    """The ViT's blocks run by hand (no forward_features)."""
    h = model._pos_embed(model.patch_embed(x))
    for blk in model.blocks:
        h = blk(h)
    return h


def _cos_blocks():
    """Three blocks, two images (N=2 tokens, D=2): image 0 has cos 1, 0, -1 in blocks 0, 1, 2;
    image 1 has cos 1 in every block (a positive rescaling of the target)."""
    ref = torch.tensor([[[1.0, 0.0], [0.0, 2.0]], [[3.0, 1.0], [0.0, -1.0]]])  # (B=2, N=2, D=2)
    orth = torch.tensor([[0.0, 1.0], [-2.0, 0.0]])  # orthogonal to ref[0] (flattened)
    outs = [ref.clone(), torch.stack([orth, 2 * ref[1]]), torch.stack([-ref[0], 0.5 * ref[1]])]
    return outs, [ref] * 3


def test_cosine_losses_known_values_per_image_per_block_and_mean():
    outs, refs = _cos_blocks()
    torch.testing.assert_close(per_image_alignment(outs, refs), torch.tensor([1.0, 0.0]))  # (0+1+2)/3, 0
    torch.testing.assert_close(alignment_loss(outs, refs), torch.tensor(0.5))
    assert per_block_alignment(outs, refs) == pytest.approx([0.0, 0.5, 1.0], abs=1e-7)
    # one block only: the block's own loss (no division by another block count)
    torch.testing.assert_close(per_image_alignment(outs[2:], refs[2:]), torch.tensor([2.0, 0.0]))
    # an all-zero representation: cos = 0 (guarded by eps), loss 1
    z = [torch.zeros(1, 2, 2)]
    torch.testing.assert_close(per_image_alignment(z, [torch.ones(1, 2, 2)]), torch.tensor([1.0]))


def test_mse_losses_known_values():
    ref = torch.zeros(2, 3)                                  # trailing shape (N*D,) = (3,)
    outs = [torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 3.0]]), torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])]
    # image 0: block means 1 and 4/3; image 1: 3 and 0 -> averaged over the 2 blocks
    expect = torch.tensor([(1.0 + 4 / 3) / 2, (3.0 + 0.0) / 2])
    torch.testing.assert_close(per_image_alignment(outs, [ref, ref], kind="mse"), expect)
    torch.testing.assert_close(alignment_loss(outs, [ref, ref], "mse"), expect.mean())
    assert per_block_alignment(outs, [ref, ref], "mse") == pytest.approx([2.0, 2 / 3])


def test_targets_take_the_outputs_dtype_and_the_loss_is_differentiable():
    outs, refs = _cos_blocks()
    o64 = [o.double().requires_grad_() for o in outs]
    loss = per_image_alignment(o64, refs)  # float32 targets, float64 outputs
    assert loss.dtype == torch.float64
    loss.sum().backward()
    assert all(o.grad is not None for o in o64)
    # float64 targets (a cached dense pass) with float32 outputs: float32 losses
    assert per_image_alignment(outs, [r.double() for r in refs]).dtype == torch.float32
    assert per_image_alignment(outs, [r.double() for r in refs], "mse").dtype == torch.float32


def test_each_input_error_alone():
    outs, refs = _cos_blocks()
    with pytest.raises(ValueError, match="unknown alignment loss 'l2' \\(choose from cosine, mse\\)"):
        per_image_alignment(outs, refs, "l2")
    with pytest.raises(ValueError, match="3 block outputs vs 2 targets"):
        per_image_alignment(outs, refs[:2])
    with pytest.raises(ValueError, match="0 block outputs vs 0 targets"):
        per_image_alignment([], [])
    with pytest.raises(ValueError, match=r"block output \(2, 2, 2\) vs target \(2, 4\)"):
        per_image_alignment(outs[:1], [refs[0].reshape(2, 4)])


# ---- BlockCapture --------------------------------------------------------------------------------
def test_block_capture_stops_after_the_last_block_and_resets(timm):
    model = _vit(timm)
    an = find_anatomy(model)
    calls = []
    model.norm.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        with BlockCapture(an):  # installed but not running: a plain forward is not stopped
            assert model(x).shape == (2, 5) and calls == [1]
        calls.clear()
        expected, h = [], model.patch_embed(x)
        h = model._pos_embed(h)
        for blk in model.blocks:
            h = blk(h)
            expected.append(h)
        with BlockCapture(an) as cap:
            outs = cap.run(x)
            assert calls == [] and cap.outputs == [None] * 3  # no final norm; buffer cleared
            assert len(outs) == 3 and all(torch.equal(o, e) for o, e in zip(outs, expected))
            # outside run() the hooks do not stop the model: a full forward gives the logits
            assert model(x).shape == (2, 5) and calls == [1]
            assert torch.equal(cap.run(x)[2], expected[2])  # a second run gives the same
            handles = list(cap._handles)
        assert cap._handles == [] and len(handles) == 3
        model(x)
        assert cap.outputs == [None] * 3  # hooks removed: nothing recorded


def test_block_capture_without_forward_features_and_missing_blocks(timm):
    model = _vit(timm)
    an = find_anatomy(model)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        ref = BlockCapture(an).run(x)
        # a ViT without forward_features: the anatomy's whole model is run instead
        model.forward_features = None
        cap = BlockCapture(dataclasses.replace(an, model=lambda im: _manual(model, im)))
        outs = cap.run(x)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref))
        cap.remove()
        model.forward_features = lambda im: model.blocks[0](model._pos_embed(model.patch_embed(im)))
        with BlockCapture(an) as cap:
            with pytest.raises(RuntimeError, match=r"blocks \[1, 2\] produced no output"):
                cap.run(x)


def test_block_capture_takes_the_first_element_of_a_tuple_output_and_needs_no_forward_features(timm):
    import types

    model = _vit(timm)
    an = find_anatomy(model)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        ref = _manual(model, x)
        # the last block returns (output, extra), as some block classes do
        model.blocks[-1].register_forward_hook(lambda _m, _i, out: (out, torch.zeros(1)))
        # an anatomy whose ViT object has no forward_features attribute at all: the model is run
        bare = dataclasses.replace(an, vit=types.SimpleNamespace(), model=lambda im: _manual(model, im))
        with BlockCapture(bare) as cap:
            outs = cap.run(x)
    assert torch.equal(outs[-1], ref)
