"""Issue 56 item 1: the fusible attention export (exporters/attention_pattern.py).

Tiny random-init timm ViTs (biases drawn at random: a zero bias ``Add`` is removed by the graph
clean-up, and ORT's fusion needs it). Each case checks: the export-form copy equals the model in
PyTorch, ONNX Runtime equals PyTorch, ORT's transformer optimizer fuses one attention node per
block (first block included), and the fused graph's outputs equal the unfused ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgeprune  # noqa: F401  (torchvision shim before timm)
import timm
from edgeprune.errors import UserError
from edgeprune.layers import PrunedAttention
from edgeprune.layers.class_token_block import ClassTokenBlock, to_class_token_block
from edgeprune.layers.rotary_attention import RotaryAttention
from exporters.attention_pattern import (FusibleAttention, FusibleBlock, count_fused_attention, fusible_copy,
                                         fused_attention_line)
from exporters.onnx import export_onnx

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime.transformers.optimizer")

SHAPE = (3, 32, 32)
DEPTH = 2


def _tiny(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=DEPTH, num_classes=10, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.02)
    return m.eval()


PRUNES = {
    "both": dict(target="both", sparsity=0.5),
    "all-fused-layout": dict(target="all", sparsity=0.5, layout="fused"),
    "heads": dict(target="heads", head_sparsity=0.34),
    "flops": dict(flops=0.5, last_block="full"),
}


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    dense = _tiny()
    calib = torch.randn(64, *SHAPE, generator=torch.Generator().manual_seed(1))
    out = {"dense": dense}
    for name, kw in PRUNES.items():
        out[name] = edgeprune.prune(dense, calib, **kw).model.eval()
    return out


def _x(batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, *SHAPE, generator=torch.Generator().manual_seed(2))


def _run(path, x: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x.numpy()})[0]


def test_pruned_cases_have_the_intended_shapes(models):
    dims = {k: [(b.attn.num_heads, b.attn.qk_dim, b.attn.v_dim) for b in m.blocks]
            for k, m in models.items() if k != "dense"}
    assert all(dq != dv for _, dq, dv in dims["both"])                  # uneven Q/K vs V
    assert all(dq == dv for _, dq, dv in dims["all-fused-layout"])      # fused layout
    assert all(h < 3 for h, _, _ in dims["heads"])                      # whole heads removed
    assert len(set(dims["flops"])) == DEPTH                             # per-block different dims


@pytest.mark.parametrize("case", ["dense", *PRUNES])
def test_fusible_export_fuses_every_block(models, case, tmp_path):
    model = models[case]
    x = _x()
    copy = fusible_copy(model)
    assert all(isinstance(b, FusibleBlock) and isinstance(b.attn, FusibleAttention) for b in copy.blocks)
    assert not any(isinstance(b, FusibleBlock) for b in model.blocks)  # the model itself is untouched
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(copy(x), ref, rtol=0, atol=1e-5)

    path = export_onnx(model, tmp_path / "m.onnx", SHAPE, attention="fusible")
    out = _run(path, x)
    np.testing.assert_allclose(out, ref.numpy(), rtol=0, atol=1e-5)

    counts = count_fused_attention(path, output=tmp_path / "fused.onnx")
    assert counts["attention_blocks"] == DEPTH
    assert counts["fused"] == DEPTH, counts
    np.testing.assert_allclose(_run(tmp_path / "fused.onnx", x), out, rtol=0, atol=1e-4)


def test_packed_keeps_todays_graph(models, tmp_path):
    import onnx

    path = export_onnx(models["both"], tmp_path / "p.onnx", SHAPE, attention="packed")
    names = [n.name for n in onnx.load(str(path)).graph.node]
    assert any("/attn/qkv/" in n for n in names) and not any("/attn/q/" in n for n in names)
    assert count_fused_attention(path) == {"attention": 0, "multi_head_attention": 0, "fused": 0,
                                           "attention_blocks": DEPTH}
    assert "0 of 2 attention blocks fused" in fused_attention_line(path)
    with pytest.raises(UserError, match="unknown attention form"):
        export_onnx(models["dense"], tmp_path / "bad.onnx", SHAPE, attention="split")


def test_layer_scale_is_folded_and_fuses(tmp_path):
    model = _tiny(init_values=0.1)
    copy = fusible_copy(model)
    assert all(isinstance(b.ls1, torch.nn.Identity) for b in copy.blocks)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=0, atol=1e-5)
    path = export_onnx(model, tmp_path / "ls.onnx", SHAPE, attention="fusible")
    assert count_fused_attention(path)["fused"] == DEPTH


def test_class_token_block_and_rotary_are_left_alone():
    model = _tiny()
    to_class_token_block(model, 1)
    copy = fusible_copy(model)
    assert isinstance(copy.blocks[0].attn, FusibleAttention)
    assert type(copy.blocks[-1]) is ClassTokenBlock and type(copy.blocks[-1].attn) is type(model.blocks[-1].attn)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=0, atol=1e-5)

    rot = RotaryAttention(64, 2, 16, 24, num_tokens=5).eval()
    assert type(fusible_copy(torch.nn.Sequential(rot))[0]) is RotaryAttention


@pytest.mark.parametrize("bias", [False, True])
def test_pruned_attention_uneven_dims_without_bias(bias):
    torch.manual_seed(3)
    attn = PrunedAttention(48, 3, qk_dim=8, v_dim=20, qkv_bias=bias, proj_bias=bias, scale=0.3).eval()
    copy = fusible_copy(attn)
    assert isinstance(copy, FusibleAttention) and (copy.qk_dim, copy.v_dim, copy.num_heads) == (8, 20, 3)
    x = torch.randn(2, 7, 48)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), attn(x), rtol=0, atol=1e-5)


def test_cli_export_has_the_attention_option():
    from click.testing import CliRunner

    from edgeprune.cli.deploy import export_cmd

    res = CliRunner().invoke(export_cmd, ["--help"])
    assert res.exit_code == 0 and "--attention" in res.output and "fusible" in res.output


def test_verify_line_survives_a_missing_optimizer(monkeypatch, tmp_path):
    import exporters.attention_pattern as ap

    def missing(*_a, **_k):
        raise ImportError("no module named onnxruntime.transformers")

    monkeypatch.setattr(ap, "count_fused_attention", missing)
    assert "not checked" in ap.fused_attention_line(tmp_path / "any.onnx")


@pytest.mark.parametrize("case", ["fmnist-vit", "fmnist-vit flops 0.5", "deit_small"])
def test_the_projects_default_model_and_deit_small_fuse_every_block(case, tmp_path):
    """Issue 56's done-when: ORT's transformer optimizer fuses one attention per block for fmnist-vit (dense, and
    --flops 0.5: per-block dims) and DeiT-S dense (its 12 blocks of 6 heads, D 384; at 64 px: the pattern does not
    depend on the token count), and the fused graph equals the unfused one within 1e-4."""
    if case.startswith("fmnist-vit"):
        spec = edgeprune.get_model_spec("fmnist-vit")
        model, shape = spec.create(pretrained=True).eval(), tuple(spec.input_size)
        if case.endswith("0.5"):
            calib = torch.randn(64, *shape, generator=torch.Generator().manual_seed(1))
            model = edgeprune.prune(model, calib, spec=spec, flops=0.5, progress=False).model.eval()
            dims = {(b.attn.num_heads, b.attn.qk_dim, b.attn.v_dim, b.mlp.fc1.out_features) for b in model.blocks}
            assert len(dims) > 1, dims  # the blocks keep different dims
    else:
        torch.manual_seed(0)
        model = timm.create_model("deit_small_patch16_224", pretrained=False, img_size=64, num_classes=10).eval()
        shape = (3, 64, 64)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(std=0.02)  # a zero bias Add is removed by the clean-up, and the fusion needs it
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(2))
    path = export_onnx(model, tmp_path / "m.onnx", shape, attention="fusible")
    with torch.no_grad():
        np.testing.assert_allclose(_run(path, x), model(x).numpy(), rtol=0, atol=1e-4)
    counts = count_fused_attention(path, output=tmp_path / "fused.onnx")
    assert counts["attention_blocks"] == len(model.blocks) and counts["fused"] == len(model.blocks), counts
    np.testing.assert_allclose(_run(tmp_path / "fused.onnx", x), _run(path, x), rtol=0, atol=1e-4)
