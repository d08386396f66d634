"""Reproducible and self-contained runs (issue 12, defects 4-5, 7) and --img-size (issue 14).

* a random-init dense model is a function of the spec's seed, and a run's record rebuilds it;
* the record holds the checkpoint's absolute path and sha256; a checkpoint that is gone or
  changed is refused with one line;
* model-name typos get suggestions from the names edgeprune supports;
* identical prunes give byte-identical weight files;
* ``img_size`` / ``model_kwargs`` reach ``timm.create_model``, and a checkpoint saved at one size
  loads at another (timm resamples the position embedding).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from edgeprune.errors import UserError
from edgeprune.loading import load_base_model, load_run_or_model
from edgeprune.zoo.registry import get_model_spec, spec_from_record

TINY = "deit_tiny_patch16_224"
TINY_KW = {"depth": 1}


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _record_roundtrip(spec) -> dict:
    return {"base_model": json.loads(json.dumps(spec.to_record()))}


# ---- defect 4: seeded random init ----------------------------------------------------------------


def test_random_init_is_seeded_and_leaves_the_global_rng_alone():
    spec = get_model_spec(TINY, random_init=True, img_size=32, model_kwargs=TINY_KW)
    state = torch.random.get_rng_state()
    a = spec.create(pretrained=False)
    torch.manual_seed(1234)  # whatever the caller's RNG holds
    b = spec.create(pretrained=False)
    assert _same_weights(a, b)
    torch.random.set_rng_state(state)
    spec.create(pretrained=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    other = get_model_spec(TINY, random_init=True, img_size=32, model_kwargs=TINY_KW, seed=1)
    assert not _same_weights(a, other.create(pretrained=False))


def test_a_runs_record_rebuilds_the_identical_dense_model(tmp_path):
    import edgeprune
    from edgeprune.artifact import save_run

    spec = get_model_spec(TINY, random_init=True, img_size=32, model_kwargs=TINY_KW, seed=7)
    dense = spec.create()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    res = edgeprune.prune(dense, x, target="mlp", sparsity=0.5, spec=spec)
    base = res.record["base_model"]
    assert (base["seed"], base["img_size"], base["model_kwargs"]) == (7, 32, TINY_KW)
    run = save_run(tmp_path / "run", res.model, res.record)
    torch.manual_seed(99)
    _, record, rspec = load_run_or_model(run, None)
    assert rspec.seed == 7 and rspec.input_size == (3, 32, 32)
    assert _same_weights(load_base_model(record), dense)


# ---- defect 5: self-contained runs ---------------------------------------------------------------


def _write_checkpoint(path, seed):
    from edgeprune.atomic import atomic_save_safetensors

    model = get_model_spec(TINY, random_init=True, img_size=32, model_kwargs=TINY_KW, seed=seed).create()
    atomic_save_safetensors(path, {k: v.contiguous() for k, v in model.state_dict().items()})
    return model


def test_record_holds_the_absolute_checkpoint_path_and_its_sha256(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    ckpt = work / "ckpt.safetensors"
    dense = _write_checkpoint(ckpt, seed=3)
    monkeypatch.chdir(work)
    spec = get_model_spec(TINY, checkpoint="ckpt.safetensors", img_size=32, model_kwargs=TINY_KW)
    assert _same_weights(spec.create(), dense)
    rec = _record_roundtrip(spec)
    assert rec["base_model"]["checkpoint"] == str(ckpt.resolve())
    assert rec["base_model"]["checkpoint_sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    monkeypatch.chdir(tmp_path)  # eval from another directory
    assert _same_weights(load_base_model(rec), dense)


def test_a_changed_or_missing_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt.safetensors"
    _write_checkpoint(ckpt, seed=3)
    rec = _record_roundtrip(get_model_spec(TINY, checkpoint=str(ckpt), img_size=32, model_kwargs=TINY_KW))
    _write_checkpoint(ckpt, seed=4)  # same name, other weights
    with pytest.raises(UserError, match=r"changed since the run was made \(sha256 .* != .*\); restore it or "
                                        r"re-run prune") as info:
        load_base_model(rec)
    assert "\n" not in str(info.value)
    spec_from_record(rec["base_model"]).create(pretrained=False)  # the architecture needs no weights
    ckpt.unlink()
    with pytest.raises(UserError, match="not found"):
        load_base_model(rec)


def test_model_name_typos_suggest_supported_names():
    from edgeprune.zoo.families import refused_family

    with pytest.raises(UserError, match="deit_tiny_patch16_224") as info:
        get_model_spec("deit_tiny_patch16_244")
    with pytest.raises(UserError, match="did you mean fmnist-vit"):
        get_model_spec("fmnist_vit")
    with pytest.raises(UserError, match="vit_small_patch14_dinov2"):
        get_model_spec("vit_small_patch14_dinov")
    msg = str(info.value)
    suggested = msg.split("did you mean ")[1].split("?")[0].split(", ")
    assert all(refused_family(n) is None for n in suggested)
    assert all(n.startswith(("vit_", "deit", "fmnist", "dinov2")) for n in suggested), suggested


def test_zoo_models_refuse_timm_only_options():
    with pytest.raises(UserError, match="fixed input size"):
        get_model_spec("fmnist-vit", img_size=56)
    with pytest.raises(UserError, match="model_kwargs is for timm models"):
        get_model_spec("fmnist-vit", model_kwargs={"depth": 2})
    with pytest.raises(UserError, match="may not set 'img_size'"):
        get_model_spec(TINY, random_init=True, model_kwargs={"img_size": 32})
    spec = get_model_spec(TINY, random_init=True, model_kwargs={"no_such_option": 1})
    with pytest.raises(UserError, match="does not accept"):
        spec.create(pretrained=False)


# ---- defect 7: byte-identical weight files -------------------------------------------------------


def test_two_identical_prunes_write_byte_identical_weight_files(tmp_path):
    import edgeprune
    from edgeprune.artifact import WEIGHTS, save_run

    spec = get_model_spec(TINY, random_init=True, img_size=64, model_kwargs={"depth": 2})
    x = torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    blobs = []
    for i in range(2):
        res = edgeprune.prune(spec.create(), x, target="both", sparsity=0.5, spec=spec)
        for j in range(2):  # the old writer's metadata order changed between saves
            blobs.append((save_run(tmp_path / f"run{i}{j}", res.model, res.record) / WEIGHTS).read_bytes())
    assert all(b == blobs[0] for b in blobs), (
        "weight files differ: artifact.save_run must write with edgeprune.atomic.write_safetensors "
        "(sorted metadata and tensor names), not safetensors.torch.save_file")


# ---- issue 14: --img-size / --model-kwargs -------------------------------------------------------


def test_dinov2_random_init_at_img_size_56_creates_and_runs():
    spec = get_model_spec("vit_small_patch14_dinov2", random_init=True, img_size=56, model_kwargs={"depth": 1})
    assert spec.input_size == (3, 56, 56) and spec.preprocessing["crop"] == 56
    model = spec.create()
    assert model.patch_embed.grid_size == (4, 4)
    with torch.no_grad():
        out = model(torch.randn(2, 3, 56, 56))
    assert out.shape[0] == 2 and torch.isfinite(out).all()
    rec = spec.to_record()
    assert rec["img_size"] == 56 and rec["model_kwargs"] == {"depth": 1}


def test_a_checkpoint_saved_at_one_size_loads_at_another(tmp_path):
    from timm.layers import resample_abs_pos_embed

    from edgeprune.atomic import atomic_save_safetensors

    name, kw = "vit_small_patch14_dinov2", {"depth": 1}
    small = get_model_spec(name, random_init=True, img_size=28, model_kwargs=kw).create()
    ckpt = tmp_path / "dinov2_28.safetensors"
    atomic_save_safetensors(ckpt, {k: v.contiguous() for k, v in small.state_dict().items()})
    big = get_model_spec(name, checkpoint=str(ckpt), img_size=56, model_kwargs=kw).create()
    want = resample_abs_pos_embed(small.pos_embed.detach(), new_size=(4, 4), old_size=(2, 2),
                                  num_prefix_tokens=1)
    assert big.pos_embed.shape == want.shape and torch.allclose(big.pos_embed, want)
    assert torch.equal(big.blocks[0].attn.qkv.weight, small.blocks[0].attn.qkv.weight)
    with torch.no_grad():
        assert torch.isfinite(big(torch.randn(1, 3, 56, 56))).all()
    # the same file at its own size loads unchanged
    same = get_model_spec(name, checkpoint=str(ckpt), img_size=28, model_kwargs=kw).create()
    assert _same_weights(same, small)


# ---- defect 6: images ----------------------------------------------------------------------------


def _png16(path, values):
    import numpy as np
    from PIL import Image

    Image.fromarray(np.asarray(values, dtype=np.uint16)).save(path)
    return path


def test_16bit_png_is_scaled_to_8_bits_not_clipped(tmp_path):
    import numpy as np
    from torchvision.transforms import functional as TF

    from edgeprune.data.sources import FolderSource, open_image

    vals = [[0, 257 * 10, 65535], [128 * 256 + 5, 255, 40000]]
    f = _png16(tmp_path / "deep.png", vals)
    img = open_image(f)
    assert img.mode == "RGB"
    got = np.asarray(img)
    want = np.asarray(vals, dtype=np.uint32) >> 8
    assert (got == want[..., None]).all(), got[..., 0]
    x, _ = next(FolderSource([f], [-1], TF.to_tensor).batches(1))
    assert torch.allclose(x[0, 0], torch.tensor(want, dtype=torch.float32) / 255)


@pytest.mark.parametrize("side", [12, 40])  # above the limit (warning) and above twice it (error)
def test_decompression_bomb_is_a_one_line_user_error(tmp_path, monkeypatch, side):
    from PIL import Image

    from edgeprune.data.sources import FolderSource, open_image

    f = tmp_path / "bomb.png"
    Image.new("RGB", (side, side)).save(f)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(UserError, match="bomb.png is too large") as info:
        open_image(f)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="bomb.png"):
        next(FolderSource([f], [-1], lambda im: torch.zeros(1)).batches(1))


def test_the_same_image_under_two_names_in_calibration_and_evaluation_is_refused(tmp_path):
    from PIL import Image

    calib, ev = tmp_path / "calib" / "a", tmp_path / "eval" / "b"
    calib.mkdir(parents=True)
    ev.mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(calib / f"c{i}.png")
        Image.new("RGB", (8, 8), (0, i * 40 + 1, 0)).save(ev / f"e{i}.png")
    spec = get_model_spec(TINY, random_init=True, img_size=32)
    src = spec.calibration_source(3, data=str(calib.parent), eval_data=str(ev.parent))  # disjoint: fine
    assert len(src) == 3
    (ev / "renamed_copy.png").write_bytes((calib / "c1.png").read_bytes())
    with pytest.raises(UserError, match=r"overlap \(1 images, e.g. .*c1.png is identical to .*renamed_copy.png"):
        spec.calibration_source(3, data=str(calib.parent), eval_data=str(ev.parent))
