"""Issue 56, item 1: ``attention="standard"`` writes ONNX's own ``Attention`` op (opset 23), one per attention block,
for dense, pruned (uneven Q/K and V dims, whole heads removed), token-merged, rotary and dense-head networks; the
graph equals PyTorch, keeps its dynamic batch and has no control flow."""

from __future__ import annotations

import collections
import importlib.util

import onnx
import pytest
import torch

import edgeprune
from conftest import assert_one_line_error, run_cli
from edgeprune.errors import UserError
from edgeprune.jobs.models import load_model
from edgeprune.zoo.fmnist_vit import create_fmnist_vit
from exporters.attention_pattern import fused_attention_line
from exporters.onnx import export_onnx
from exporters.verify import verify_onnx
from nets import dense_nets

pytestmark = pytest.mark.skipif(not importlib.util.find_spec("onnxscript"), reason="needs onnxscript (the dev extra)")

CALIB = torch.randn(48, 1, 28, 28, generator=torch.Generator().manual_seed(3))


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _fmnist():
    return create_fmnist_vit(pretrained=True).eval()


CASES = {
    "dense": lambda: _fmnist(),
    "both 0.5 (qk_dim != v_dim)": lambda: edgeprune.prune(_fmnist(), CALIB, target="both", sparsity=0.5).model,
    "heads 0.5": lambda: edgeprune.prune(_fmnist(), CALIB, target="heads", sparsity=0.5).model,
    "flops 0.5 (uneven dims per block)": lambda: edgeprune.prune(_fmnist(), CALIB, flops=0.5).model,
    "tokens merged r=4": lambda: edgeprune.prune(_fmnist(), CALIB, target="mlp", sparsity=0.0, tokens_merge=4).model,
    "rotary (fmnist-dinov3), all 0.5": lambda: edgeprune.prune(
        load_model(None, "fmnist-dinov3", None, False, None, None, None)[0], CALIB, target="all", sparsity=0.5).model,
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_standard_attention_per_block_and_the_graph_equals_pytorch(case, tmp_path):
    model = CASES[case]()
    path = export_onnx(model, tmp_path / "m.onnx", (1, 28, 28), {}, opset=23, attention="standard")
    ops = _ops(path)
    blocks = len(model.blocks)
    assert ops["Attention"] == blocks and ops["Softmax"] == 0, ops
    assert not set(ops) & {"If", "Loop", "Tile", "NonZero", "ScatterND", "ScatterElements"}, ops
    proto = onnx.load(str(path))
    assert [i.version for i in proto.opset_import if i.domain in ("", "ai.onnx")] == [23]
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # the batch stays dynamic
    rep = verify_onnx(path, model, torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(0)), atol=1e-4)
    assert rep["passed"], rep["max_abs_diff"]
    assert f"attention: {blocks} ONNX Attention ops" in fused_attention_line(path)


def test_a_dense_network_with_taps_exports_standard_attention(tmp_path):
    net = edgeprune.prune(dense_nets.dpt_net(), torch.randn(32, 3, 32, 32), target="both", sparsity=0.5,
                          tokens_merge=4).model
    path = export_onnx(net, tmp_path / "n.onnx", (3, 32, 32), {}, opset=23, attention="standard")
    assert _ops(path)["Attention"] == 4
    assert verify_onnx(path, net, torch.randn(2, 3, 32, 32), atol=1e-4)["passed"]


def test_standard_attention_below_opset_23_is_one_line_naming_both_settings(tmp_path):
    with pytest.raises(UserError, match=r"attention.*standard.*opset >= 23.*opset.* 23"):
        export_onnx(_fmnist(), tmp_path / "m.onnx", (1, 28, 28), {}, opset=17, attention="standard")
    assert not (tmp_path / "m.onnx").exists()


def test_the_cli_writes_it_and_refuses_the_default_opset(tmp_path):
    res = run_cli(["export", "--model", "fmnist-vit", "--attention", "standard", "--opset", "23",
                   "-o", tmp_path / "m.onnx"])
    assert res.exit_code == 0, res.output
    assert _ops(tmp_path / "m.onnx")["Attention"] == 6 and "opset 23" in res.output
    res = run_cli(["export", "--model", "fmnist-vit", "--attention", "standard", "-o", tmp_path / "n.onnx"])
    assert_one_line_error(res, "--attention standard writes ONNX's Attention op, which needs opset >= 23 (give "
                               "--opset 23")
