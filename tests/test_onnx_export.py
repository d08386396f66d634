"""ONNX export (exporters/onnx.py) and verification (exporters/verify.py).

Invariant (METHODS.md §4): the exported ONNX equals the PyTorch model (max abs diff <= 1e-4, fp32),
for dense timm ViTs, models holding PrunedAttention, and CORP-pruned models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

import exporters.onnx as onnx_exp
from edgeprune._compat import import_timm
from edgeprune.errors import UserError
from edgeprune.layers import PrunedAttention
from edgeprune.zoo.fmnist_vit import create_fmnist_vit
from exporters.onnx import build_metadata, export_onnx, graph_op_summary, read_metadata
from exporters.verify import verify_onnx

ATOL = 1e-4
STANDARD_DOMAINS = {"", "ai.onnx"}


def _timm(name: str, seed: int = 0, **kwargs) -> nn.Module:
    timm = import_timm()
    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False, **kwargs).eval()


def _fmnist(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return create_fmnist_vit(pretrained=False)


def _with_pruned_attention(model: nn.Module, qk_dim: int = 32, v_dim: int = 64, seed: int = 1) -> nn.Module:
    """Swap every block's attention for a random PrunedAttention (qk_dim != v_dim)."""
    torch.manual_seed(seed)
    for blk in model.blocks:
        dim = blk.attn.qkv.in_features
        blk.attn = PrunedAttention(dim, blk.attn.num_heads, qk_dim, v_dim)
    return model.eval()


def _ort_run(path: Path, x: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x.numpy()})[0]


def _assert_standard_graph(path: Path, opset: int = 17) -> None:
    m = onnx.load(str(path), load_external_data=False)
    domains = {n.domain for n in m.graph.node}
    assert domains <= STANDARD_DOMAINS, f"non-standard op domains {domains}"
    assert {imp.domain for imp in m.opset_import} <= STANDARD_DOMAINS
    assert {imp.version for imp in m.opset_import} == {opset}
    ops = {n.op_type for n in m.graph.node}
    assert "Attention" not in ops and "MultiHeadAttention" not in ops
    assert "MatMul" in ops and "Softmax" in ops
    assert [i.name for i in m.graph.input] == ["input"]
    assert [o.name for o in m.graph.output] == ["output"]


def _check_export(model: nn.Module, tmp_path: Path, input_shape, batch: int = 2,
                  name: str = "m.onnx") -> Path:
    path = export_onnx(model, tmp_path / name, input_shape, build_metadata(model=model, model_name=name))
    _assert_standard_graph(path)
    x = torch.randn(batch, *input_shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x).numpy()
    out = _ort_run(path, x)
    assert out.shape == ref.shape
    diff = float(np.abs(out - ref).max())
    assert diff <= ATOL, f"max abs diff {diff:.3e}"
    return path


# ---------------------------------------------------------------------------------------------
# dense and PrunedAttention models


#: Test time on 2 shared CPU cores: every block of a timm ViT exports to the same ops, so beyond the
#: full-depth deit_tiny, the 224 models keep 4 blocks (with their LayerScale / distillation token /
#: PrunedAttention features) and the CORP-pruned ones 2 blocks (CORP's Q/K solve, a 1024x1024
#: system per head and block, dominates their time).
REDUCED_DEPTH = 4
PRUNED_TIMM_DEPTH = 2


@pytest.mark.parametrize("name,depth", [("deit_tiny_patch16_224", None),
                                        ("deit3_small_patch16_224", REDUCED_DEPTH),
                                        ("deit_tiny_distilled_patch16_224", REDUCED_DEPTH)])
def test_timm_models_match_torch(name, depth, tmp_path):
    # Exported at batch 1, run at batch 3 / 2: the batch axis is dynamic.
    model = _timm(name) if depth is None else _timm(name, depth=depth)
    path = _check_export(model, tmp_path, (3, 224, 224), batch=3 if depth is None else 2)
    dims = onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [3, 224, 224]


def test_pruned_attention_model_matches_torch(tmp_path):
    model = _with_pruned_attention(_timm("deit_tiny_patch16_224", depth=REDUCED_DEPTH))
    path = _check_export(model, tmp_path, (3, 224, 224))
    md = read_metadata(path)
    assert md["blocks"][0] == {"index": 0, "mlp_hidden": 768, "qk_dim": 32, "v_dim": 64, "num_heads": 3}


def test_fmnist_model_matches_torch_and_batch_is_dynamic(tmp_path):
    model = _fmnist()
    path = _check_export(model, tmp_path, (1, 28, 28), batch=5)
    x = torch.randn(1, 1, 28, 28)
    assert _ort_run(path, x).shape == (1, 10)


def test_static_batch_export(tmp_path):
    model = _fmnist()
    path = export_onnx(model, tmp_path / "s.onnx", (1, 28, 28), {}, dynamic_batch=False, batch_size=4)
    dims = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [4, 1, 28, 28]
    assert read_metadata(path)["input_shape"] == [4, 1, 28, 28]
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        assert np.abs(_ort_run(path, x) - model(x).numpy()).max() <= ATOL
    # verify pads the last chunk of a fixed-batch model
    rep = verify_onnx(path, model, torch.randn(6, 1, 28, 28))
    assert rep["passed"] and rep["n"] == 6


def test_export_restores_training_mode(tmp_path):
    model = _fmnist().train()
    export_onnx(model, tmp_path / "t.onnx", (1, 28, 28), {})
    assert model.training


# ---------------------------------------------------------------------------------------------
# metadata


def test_metadata_round_trips(tmp_path):
    md = {
        "edgeprune_version": "9.9.9",
        "base_model": {"name": "deit_tiny_patch16_224", "checkpoint": None},
        "method": "corp",
        "sparsity": {"mlp": 0.5, "attn": 0.25},
        "blocks": [{"index": 0, "mlp_hidden": 384, "qk_dim": 32, "v_dim": 64, "num_heads": 3}],
        "mean": [0.485, 0.456, 0.406],
        "looks_like_json": "17",  # a string stays a string
        "flag": True,
        "params": 123,
    }
    path = export_onnx(_fmnist(), tmp_path / "md.onnx", (1, 28, 28), md)
    got = read_metadata(path)
    for k, v in md.items():
        assert got[k] == v, k
    assert isinstance(got["looks_like_json"], str)
    assert got["input_name"] == "input" and got["output_name"] == "output"
    assert got["input_shape"] == ["batch", 1, 28, 28] and got["input_dtype"] == "float32"
    assert got["opset"] == 17 and got["dynamic_batch"] is True
    # stored as plain string key/values, readable without edgeprune
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert props["method"] == "corp" and props["mean"] == "[0.485, 0.456, 0.406]"
    # ONNX Runtime sees them too
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert sess.get_modelmeta().custom_metadata_map["method"] == "corp"


def test_build_metadata_from_record_and_spec():
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("fmnist-vit")
    record = {"edgeprune_version": "0.1.0", "base_model": {"name": "fmnist-vit", "checkpoint": None},
              "method": "corp", "targets": "both", "sparsity": {"mlp": 0.5, "attn": 0.5},
              "blocks": [{"index": 0, "mlp_hidden": 256, "qk_dim": 32, "v_dim": 64, "num_heads": 2}],
              "calibration": {"num_images": 8}, "params": 1, "flops": 2}
    md = build_metadata(record=record, spec=spec)
    assert md["method"] == "corp" and md["sparsity_mlp"] == 0.5 and md["sparsity_attn"] == 0.5
    assert md["blocks"] == record["blocks"] and md["flops"] == 2
    assert md["input_size"] == [1, 28, 28]
    assert md["mean"] == [pytest.approx(0.2860)] and md["std"] == [pytest.approx(0.3530)]
    assert md["resize"] == 28 and md["crop"] == 28 and md["output_kind"] == "logits"
    dense = build_metadata(spec=spec, model=_fmnist())
    assert dense["method"] == "dense" and len(dense["blocks"]) == 6 and dense["params"] > 0


# ---------------------------------------------------------------------------------------------
# atomic writes, overwrite, external data


class _Boom(RuntimeError):
    pass


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_failed_export_leaves_no_file(tmp_path, monkeypatch):
    def boom(proto):
        raise _Boom("simulated failure after the raw export")

    monkeypatch.setattr(onnx_exp, "_clean_graph", boom)
    with pytest.raises(_Boom):
        export_onnx(_fmnist(), tmp_path / "x.onnx", (1, 28, 28), {})
    assert _leftovers(tmp_path) == []


def test_failed_export_keeps_existing_file(tmp_path, monkeypatch):
    target = tmp_path / "x.onnx"
    target.write_bytes(b"previous")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt  # an interrupt mid-export

    monkeypatch.setattr(onnx.checker, "check_model", boom)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(_fmnist(), target, (1, 28, 28), {})
    assert target.read_bytes() == b"previous"
    assert _leftovers(tmp_path) == ["x.onnx"]


def test_no_overwrite_and_bad_arguments(tmp_path):
    target = tmp_path / "x.onnx"
    target.write_bytes(b"previous")
    with pytest.raises(UserError, match="exists"):
        export_onnx(_fmnist(), target, (1, 28, 28), {}, overwrite=False)
    with pytest.raises(UserError, match="does not take input"):
        export_onnx(_fmnist(), tmp_path / "y.onnx", (3, 28, 28), {})
    with pytest.raises(UserError, match="opset"):
        export_onnx(_fmnist(), tmp_path / "y.onnx", (1, 28, 28), {}, opset=23)
    with pytest.raises(UserError, match="input_shape"):
        export_onnx(_fmnist(), tmp_path / "y.onnx", (28, 28), {})
    assert _leftovers(tmp_path) == ["x.onnx"]


def test_external_data_above_protobuf_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_exp, "PROTOBUF_LIMIT", 10_000)  # pretend the weights exceed 2 GB
    model = _fmnist()
    path = export_onnx(model, tmp_path / "big.onnx", (1, 28, 28), {"method": "dense"})
    assert (tmp_path / "big.onnx.data").is_file()
    assert path.stat().st_size < 200_000  # weights are not embedded
    assert _leftovers(tmp_path) == ["big.onnx", "big.onnx.data"]
    onnx.checker.check_model(str(path))
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert np.abs(_ort_run(path, x) - model(x).numpy()).max() <= ATOL
    assert read_metadata(path)["method"] == "dense"


def test_graph_op_summary(tmp_path):
    path = export_onnx(_fmnist(), tmp_path / "g.onnx", (1, 28, 28), {})
    s = graph_op_summary(path)
    assert s["domains"] == ["ai.onnx"] and s["opsets"] == {"ai.onnx": 17}
    assert s["ops"]["Softmax"] == 6  # one per block


@pytest.mark.slow
@pytest.mark.skipif(not __import__("importlib").util.find_spec("onnxscript"), reason="needs onnxscript")
def test_dynamo_exporter(tmp_path):
    model = _fmnist()
    # the dynamo exporter emits opset >= 18 natively; its down-conversion to 17 is unreliable
    path = export_onnx(model, tmp_path / "d.onnx", (1, 28, 28), {}, exporter="dynamo", opset=18)
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        assert np.abs(_ort_run(path, x) - model(x).numpy()).max() <= ATOL


# ---------------------------------------------------------------------------------------------
# verify_onnx


@pytest.fixture(scope="module")
def fmnist_onnx(tmp_path_factory):
    model = _fmnist()
    path = export_onnx(model, tmp_path_factory.mktemp("v") / "f.onnx", (1, 28, 28),
                       build_metadata(model=model, model_name="fmnist-vit"))
    return path, model


def test_verify_passes_and_reports(fmnist_onnx):
    path, model = fmnist_onnx
    rep = verify_onnx(path, model, torch.randn(20, 1, 28, 28), batch_size=8)
    assert rep["passed"] and rep["n"] == 20 and rep["output_kind"] == "logits"
    assert rep["max_abs_diff"] <= ATOL and 0 <= rep["mean_abs_diff"] <= rep["max_abs_diff"]
    assert rep["agreement"] == 1.0 and rep["agreement_metric"] == "top1_agreement"


def test_verify_fails_for_other_weights(fmnist_onnx):
    path, _ = fmnist_onnx
    rep = verify_onnx(path, _fmnist(seed=5), torch.randn(8, 1, 28, 28))
    assert not rep["passed"] and rep["max_abs_diff"] > ATOL


def test_verify_user_errors(fmnist_onnx, tmp_path):
    path, model = fmnist_onnx
    x = torch.randn(2, 1, 28, 28)
    with pytest.raises(UserError, match="not found"):
        verify_onnx(tmp_path / "missing.onnx", model, x)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(UserError, match="cannot load"):
        verify_onnx(bad, model, x)
    truncated = tmp_path / "trunc.onnx"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError):
        verify_onnx(truncated, model, x)
    with pytest.raises(UserError, match="input shape mismatch"):
        verify_onnx(path, model, torch.randn(2, 3, 224, 224))
    with pytest.raises(UserError, match=r"\(N, C, H, W\)"):
        verify_onnx(path, model, torch.randn(28, 28))
    with pytest.raises(UserError):
        read_metadata(bad)
    with pytest.raises(UserError, match="not found"):
        read_metadata(tmp_path / "missing.onnx")


class _TinySaliency(nn.Module):
    """(B, 3, 16, 16) -> (B, 1, 16, 16) maps in [0, 1]."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, x):
        return torch.sigmoid(self.conv(x) * 4)


def test_verify_saliency_maps(tmp_path):
    torch.manual_seed(0)
    model = _TinySaliency().eval()
    path = export_onnx(model, tmp_path / "s.onnx", (3, 16, 16), {"output_kind": "saliency"})
    rep = verify_onnx(path, model, torch.randn(4, 3, 16, 16))
    assert rep["output_kind"] == "saliency" and rep["agreement_metric"] == "mask_agreement@0.5"
    assert rep["passed"] and rep["agreement"] == 1.0
    other = _TinySaliency().eval()
    rep2 = verify_onnx(path, other, torch.randn(4, 3, 16, 16))
    assert not rep2["passed"] and rep2["agreement"] < 1.0


# ---------------------------------------------------------------------------------------------
# CORP-pruned models (CI-style equivalence: prune, export, verify)


def _prune(model, calib, target, sparsity=0.5):
    from edgeprune.api import prune

    return prune(model, calib, target=target, sparsity=sparsity)


@pytest.mark.parametrize("target", ["mlp", "attn", "both"])
def test_pruned_fmnist_matches_torch(target, tmp_path):
    torch.manual_seed(0)
    res = _prune(_fmnist(), torch.randn(16, 1, 28, 28), target)
    path = export_onnx(res.model, tmp_path / f"p_{target}.onnx", (1, 28, 28),
                       build_metadata(record=res.record, model=res.model))
    _assert_standard_graph(path)
    rep = verify_onnx(path, res.model, torch.randn(8, 1, 28, 28))
    assert rep["passed"], rep
    md = read_metadata(path)
    assert md["blocks"] == res.record["blocks"] and md["method"] == res.record["method"]
    dims = md["blocks"][0]
    if target in ("attn", "both"):
        assert dims["qk_dim"] < 64 and dims["v_dim"] == 64
    if target in ("mlp", "both"):
        assert dims["mlp_hidden"] < 512


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit3_small_patch16_224",
                                  "deit_tiny_distilled_patch16_224"])
def test_pruned_timm_models_match_torch(name, tmp_path):
    torch.manual_seed(0)
    res = _prune(_timm(name, depth=PRUNED_TIMM_DEPTH), torch.randn(2, 3, 224, 224), "both", 0.5)
    path = export_onnx(res.model, tmp_path / "p.onnx", (3, 224, 224),
                       build_metadata(record=res.record, model=res.model))
    _assert_standard_graph(path)
    rep = verify_onnx(path, res.model, torch.randn(2, 3, 224, 224))
    assert rep["passed"], rep
    assert any(isinstance(b.attn, PrunedAttention) for b in res.model.blocks)
