"""GPU profiles follow TensorRT's fused-attention rules (issue 40 item 6): the profiles' head-dim rule per
precision (fp16: multiples of 8 in [16, 256]; int8: 16, 32, 64), validated on load; the allocator's, the
latency grid's and NuWa's head dims inside it; ``edgeprune build`` saying before the build when the attention
will not be fused (no TensorRT needed: the forecast reads the ONNX graph)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from devices import load_profile, profile_from_record, pruning_rules, shipped_profile_path
from devices.fields import ProfileError
from devices.kernels import TENSORRT_HEAD_DIMS
from edgeprune.allocation import greedy
from edgeprune.allocation.rules import Grid
from edgeprune.anatomy import find_anatomy
from edgeprune.api import corp_config
from edgeprune.calibration.collect import collect_statistics
from edgeprune.errors import UserError
from edgeprune.latency.grid import make_grid
from edgeprune.nuwa.budget import attention_dims, dim_grid
from edgeprune.pruning.corp import check_prunable, statistics_request
from exporters.tensorrt_attention import AttentionShape, attention_shapes, fusion_forecast
from tests.conftest import assert_one_line_error, run_cli, write_latency_table

FP16 = set(range(16, 257, 8))
INT8 = {16, 32, 64}


# ---------------------------------------------------------------------------------------------
# the profiles


@pytest.mark.parametrize("name", ["rtx3090", "orin-nx"])
def test_gpu_profiles_carry_tensorrts_rule_per_precision(name):
    p = load_profile(name)
    assert set(p.pruning.allowed_head_dims("fp16")) == FP16 and set(p.pruning.allowed_head_dims("int8")) == INT8
    assert p.pruning.allowed_head_dims("fp32") is None
    assert set(pruning_rules(p)["head_dims"]) == FP16  # the profile's own precision (fp16)
    assert set(pruning_rules(p, "int8")["head_dims"]) == INT8
    assert profile_from_record(p.to_dict()).pruning == p.pruning  # the sidecar round trip keeps the rule


def test_cpu_profile_has_no_head_dim_rule():
    p = load_profile("cpu")
    assert pruning_rules(p) == {"mlp_round_to": 8, "head_dim_round_to": 8, "qk_equals_v": False}
    assert "head_dims" not in p.to_dict()["pruning"]


def test_a_tensorrt_profile_without_the_rule_gets_tensorrts(tmp_path):
    text = shipped_profile_path("orin-nx").read_text().split("[pruning.head_dims]")[0]
    f = tmp_path / "mine.toml"
    f.write_text(text)
    assert dict(load_profile(f).pruning.head_dims) == TENSORRT_HEAD_DIMS
    f.write_text(text + "\n[pruning.head_dims]\n")  # an empty table: no rule
    assert load_profile(f).pruning.head_dims == () and "head_dims" not in pruning_rules(load_profile(f))


BAD_RULES = [
    ("int8 = []", "pruning.head_dims.int8 must be a non-empty list of integers >= 1"),
    ("int8 = [16, 0]", "pruning.head_dims.int8 must be a non-empty list of integers >= 1"),
    ("int8 = [16, 16]", "pruning.head_dims.int8 lists a head dim twice"),
    ('int8 = ["16"]', "pruning.head_dims.int8 must be a non-empty list of integers >= 1"),
    ("int8 = 16", "pruning.head_dims.int8 must be a list of head dims or a table {min, max, step}"),
    ("int8 = [24, 40]", "pruning.head_dims.int8 allows no multiple of pruning.head_dim_round_to = 16"),
    ("fp16 = { min = 32, max = 16, step = 8 }", "pruning.head_dims.fp16 must have min <= max"),
    ("fp16 = { min = 16, max = 256 }", "pruning.head_dims.fp16 must have exactly the keys min, max, step"),
    ("fp16 = { min = 16, max = 256, step = 0 }", "pruning.head_dims.fp16.min, .max and .step must be integers"),
    ("fp8 = [16]", "unknown key pruning.head_dims.fp8"),
]


@pytest.mark.parametrize("line,message", BAD_RULES, ids=[b[0] for b in BAD_RULES])
def test_bad_rule_values_refused_in_one_line(tmp_path, line, message):
    base = shipped_profile_path("orin-nx").read_text().split("[pruning.head_dims]")[0]
    f = tmp_path / "orin-nx.toml"
    f.write_text(base + "\n[pruning.head_dims]\n" + line + "\n")
    with pytest.raises(ProfileError) as info:
        load_profile(f)
    assert str(info.value).startswith(f"orin-nx.toml: {message}") and "\n" not in str(info.value), str(info.value)
    assert_one_line_error(run_cli(["devices", str(f)]), message)


def test_head_dims_not_a_table_refused(tmp_path):
    text = shipped_profile_path("orin-nx").read_text().split("[pruning.head_dims]")[0]
    f = tmp_path / "x.toml"
    f.write_text(text.replace("qk_equals_v = true", 'qk_equals_v = true\nhead_dims = "trt"'))
    assert_one_line_error(run_cli(["devices", str(f)]), "x.toml: pruning.head_dims must be a table")


# ---------------------------------------------------------------------------------------------
# the allocator, the latency grid, NuWa


def vit64():
    """A seeded 2-block timm ViT with head dim 64: width 128, 2 heads, MLP 256, 16 px / patch 4 (17 tokens)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=128, depth=2,
                             num_heads=2, mlp_ratio=2.0).eval()


def make_table(path, rules):
    """A table of :func:`vit64`'s shape on the head-dim grid 8..64: attention = 0.1 + heads x 0.02 x (qk + v),
    MLP = 0.1 + 0.001 x width, fixed 1 ms (the times fall with every dim: the allocator wants small dims)."""
    key = {"embed_dim": 128, "depth": 2, "num_heads": 2, "head_dim": 64, "mlp_hidden": 256, "tokens": 17,
           "batch": 8, "precision": "fp16", "backend": "onnxruntime", "backend_version": "0",
           "device_name": "hand-made", "profile": "orin-nx", "threads": 1}
    heads, dims, widths = [1, 2], [8, 16, 24, 32, 40, 48, 56, 64], [64, 128, 192, 256]
    return write_latency_table(path, key, rules, heads, dims, widths, lambda h, q, v: 0.1 + h * 0.02 * (q + v),
                               lambda w: 0.1 + 0.001 * w)


@pytest.fixture(scope="module")
def model_and_stats():
    model = vit64()
    x = torch.randn(48, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    an = find_anatomy(model)
    cfg = corp_config("all", flops=0.5, last_block="full")
    stats = collect_statistics(an, [x[:24], x[24:]], statistics_request(cfg, an, 48, qk_grams=True),
                               progress=False)
    return an, stats


def _head_dims_allocated(an, stats, table, budgets):
    out = set()
    for f in budgets:
        cfg = corp_config("all", latency=f, latency_table=table, last_block="full")
        check_prunable(an, cfg)
        dims, rep = greedy.allocate(an, stats, cfg)
        assert rep["latency"]["predicted"] <= rep["latency"]["target"] + 1e-9
        out |= {d[k] for d in dims for k in ("qk", "v")}
    return out


BUDGETS = (0.85, 0.7, 0.55, 0.45)


def test_int8_rule_every_allocated_head_dim_in_16_32_64(model_and_stats, tmp_path):
    an, stats = model_and_stats
    rules = pruning_rules(load_profile("orin-nx"), "int8")
    free = _head_dims_allocated(an, stats, make_table(tmp_path / "free.json", {**rules, "head_dims": None}), BUDGETS)
    assert free - INT8, free  # without the rule the allocator does pick other multiples of 16 (48 ...)
    got = _head_dims_allocated(an, stats, make_table(tmp_path / "int8.json", rules), BUDGETS)
    assert got <= INT8 and got != {64}, got


def test_fp16_rule_every_allocated_head_dim_a_multiple_of_8_in_16_256(model_and_stats, tmp_path):
    an, stats = model_and_stats
    rules = {**pruning_rules(load_profile("rtx3090")), "head_dim_round_to": 8}  # rounding 8: the rule cuts 8
    free = _head_dims_allocated(an, stats, make_table(tmp_path / "free.json", {**rules, "head_dims": None}),
                                BUDGETS + (0.3, 0.25))
    assert 8 in free, free
    got = _head_dims_allocated(an, stats, make_table(tmp_path / "fp16.json", rules), BUDGETS + (0.3, 0.25))
    assert got <= FP16 and got != {64}, got


def test_budget_not_met_on_the_allowed_dims_is_one_line(model_and_stats, tmp_path):
    an, stats = model_and_stats
    table = make_table(tmp_path / "int8.json", pruning_rules(load_profile("orin-nx"), "int8"))
    cfg = corp_config("all", latency=0.2, latency_table=table, last_block="full")
    with pytest.raises(UserError) as info:
        greedy.check_budget(an, cfg)
    msg = str(info.value)
    assert "below the cheapest allocation" in msg and "head dims in {16, 32, 64}" in msg and "\n" not in msg


def test_allocator_grid_keeps_round_to_and_the_dense_dim():
    rules = {"mlp_round_to": 64, "head_dim_round_to": 32, "qk_equals_v": True, "head_dims": [16, 32, 64]}
    g = Grid({"mlp": 64, "qk": 32, "v": 32, "heads": 1}, {}, rules)
    assert g.sizes("qk", 64) == [32, 64] and g.sizes("v", 64) == [32, 64]  # 16: not a multiple of 32
    assert g.sizes("qk", 80) == [32, 64, 80]  # the dense dim stays even outside the rule
    assert g.sizes("mlp", 256) == [64, 128, 192, 256]  # MLP widths are not head dims
    g = Grid({"mlp": 8, "qk": 8, "v": 8, "heads": 1}, {"qk": 24}, {**rules, "head_dims": [16, 24, 40, 48]})
    assert g.sizes("qk", 48) == [24, 40, 48]  # the table's smallest measured dim still bounds it
    with pytest.raises(UserError, match="rules.head_dims must be a non-empty list"):
        Grid({"qk": 8}, {}, {"head_dims": [0]}).sizes("qk", 64)


def test_latency_grid_times_only_the_allowed_head_dims():
    shape = {"mlp_hidden": 256, "num_heads": 2, "head_dim": 64}
    rules = {"mlp_round_to": 64, "head_dim_round_to": 16, "qk_equals_v": True}
    assert make_grid(shape, rules).qk == [16, 32, 48, 64]
    g = make_grid(shape, {**rules, "head_dims": [16, 32, 64]})
    assert g.qk == g.v == [16, 32, 64]
    assert make_grid(shape, {**rules, "head_dim_round_to": 8, "head_dims": sorted(FP16)}).qk[0] == 16
    with pytest.raises(UserError):
        make_grid(shape, {**rules, "head_dims": "all"})


@pytest.mark.parametrize("tied", [True, False])
def test_nuwa_dims_land_on_the_allowed_set(tied):
    cost = types.SimpleNamespace(rules={"mlp_round_to": 64, "head_dim_round_to": 16, "qk_equals_v": tied,
                                        "head_dims": [16, 32, 64]}, lower={"qk": 16, "v": 16, "mlp": 64})
    g = dim_grid(cost)
    assert g.head_dims == (16, 32, 64) and (g.qk_min, g.v_min) == (16, 16)
    assert [g.allowed(k, 64) for k in (16, 32, 48, 64, 80)] == [16, 32, 64, 64, 64]
    s = torch.linspace(1.0, 0.01, 64).repeat(2, 1)  # decaying spectra: rho walks through every rank
    factors = [types.SimpleNamespace(qk_s=s, vo_s=s * s, qk_dim=64, v_dim=64)] * 3
    rhos = [i / 20 for i in range(21)] + [0.98, 0.985, 0.99, 0.995, 0.999]
    free_grid = dim_grid(types.SimpleNamespace(rules={**cost.rules, "head_dims": None}, lower=cost.lower))
    assert free_grid.head_dims is None and free_grid.allowed(48, 64) == 48
    for which in (0, 1):  # Q/K, V
        free = {attention_dims(factors, rho, free_grid)[which][0] for rho in rhos}
        assert 48 in free, free  # without the rule NuWa keeps 48
        got = {attention_dims(factors, rho, g)[which][0] for rho in rhos}
        assert got <= INT8 and len(got) > 1, got


# ---------------------------------------------------------------------------------------------
# edgeprune build: the forecast before the build (no TensorRT here)


def attention_graph(path: Path, qk: int, v: int, tokens: int = 17, quantized: bool = False) -> Path:
    """One attention as an exporter writes it: (Q K^T) x scale -> Softmax -> x V, with Q/DQ before the
    matmuls when ``quantized`` (inputs: q (1, 2, T, qk), k^T (1, 2, qk, T), v (1, 2, T, v))."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def inp(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    inits = [numpy_helper.from_array(np.array(0.125, np.float32), "scale"),
             numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "z")]
    nodes: list = []

    def qdq(name: str) -> str:  # the tensor the next node reads: ``name`` itself, or its Q/DQ copy
        if not quantized:
            return name
        nodes.extend([helper.make_node("QuantizeLinear", [name, "s", "z"], [f"{name}_q"]),
                      helper.make_node("DequantizeLinear", [f"{name}_q", "s", "z"], [f"{name}_dq"])])
        return f"{name}_dq"

    q, kt, vv = qdq("q"), qdq("kt"), qdq("v")
    nodes += [helper.make_node("MatMul", [q, kt], ["logits"]),
              helper.make_node("Mul", ["logits", "scale"], ["scaled"]),
              helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1, name="attn.softmax")]
    probs = qdq("probs")
    nodes.append(helper.make_node("MatMul", [probs, vv], ["out"]))
    graph = helper.make_graph(nodes, "attn", [inp("q", [1, 2, tokens, qk]), inp("kt", [1, 2, qk, tokens]),
                                              inp("v", [1, 2, tokens, v])], [inp("out", [1, 2, tokens, v])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_forecast_reads_head_dims_tokens_and_qdq_from_the_graph(tmp_path):
    a, = attention_shapes(attention_graph(tmp_path / "a.onnx", 24, 24, tokens=197))
    assert (a.qk, a.v, a.tokens, a.quantized) == (24, 24, 197, False)
    b, = attention_shapes(attention_graph(tmp_path / "b.onnx", 48, 32, quantized=True))
    assert (b.qk, b.v, b.quantized) == (48, 32, True)


def test_forecast_follows_the_rule_of_the_precision():
    orin = load_profile("orin-nx")
    ok = [AttentionShape("a", 64, 64, 197, quantized=True)]
    assert fusion_forecast(ok, "fp16", orin) is None and fusion_forecast(ok, "int8", orin) is None
    q48 = [AttentionShape("a", 48, 48, 197, quantized=True), AttentionShape("b", 64, 64, 197, quantized=True)]
    assert fusion_forecast(q48, "fp16", orin) is None  # 48 is a multiple of 8 in [16, 256]
    line = fusion_forecast(q48, "int8", orin)
    assert line.startswith("attention will not be fused: head dims 48 in 1 of 2 attention(s) are outside "
                           "orin-nx's int8 rule {16, 32, 64}") and "#2981" in line and "\n" not in line
    # an int8 build whose attention matmuls read no Q/DQ inputs runs them in fp16: the fp16 rule
    assert fusion_forecast([AttentionShape("a", 48, 48, 197, quantized=False)], "int8", orin) is None
    assert "fp16 rule {16..256 step 8}" in fusion_forecast([AttentionShape("a", 12, 12, 197)], "fp16", orin)
    assert "Q/K head dim != V head dim" in fusion_forecast([AttentionShape("a", 32, 16, 197)], "fp16", orin)
    assert "600 tokens > 512 in int8" in fusion_forecast([AttentionShape("a", 64, 64, 600, True)], "int8", orin)
    assert "this build is fp32" in fusion_forecast(ok, "fp32", orin)
    assert fusion_forecast([], "fp32", orin) is None


def _no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)


def test_build_says_in_one_line_before_building_that_attention_will_not_be_fused(monkeypatch, tmp_path):
    from edgeprune.layers.pruned_attention import PrunedAttention
    from exporters.onnx import build_metadata, export_onnx
    from tests.conftest import tiny_vit

    _no_tensorrt(monkeypatch)
    dense = tiny_vit()  # head dim 16: fused in fp16
    path = export_onnx(dense, tmp_path / "dense.onnx", (3, 16, 16), build_metadata(model=dense, model_name="t"))
    res = run_cli(["build", path, "--device", "rtx3090", "-o", tmp_path / "d.engine"])
    assert res.exit_code == 1 and "will not be fused" not in res.output  # TensorRT is missing here, nothing else
    res = run_cli(["build", path, "--device", "rtx3090", "--precision", "fp32", "-o", tmp_path / "d.engine"])
    assert "warning: attention will not be fused: TensorRT fuses multi-head attention only in fp16" in res.stderr
    pruned = tiny_vit()
    for blk in pruned.blocks:
        blk.attn = PrunedAttention(32, 2, 12, 12)
    path = export_onnx(pruned, tmp_path / "p.onnx", (3, 16, 16), build_metadata(model=pruned, model_name="t"))
    res = run_cli(["build", path, "--device", "orin-nx", "-o", tmp_path / "p.engine"])
    lines = [ln for ln in res.stderr.splitlines() if "will not be fused" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: attention will not be fused: head dims 12 in 2 of 2")
    assert "orin-nx's fp16 rule {16..256 step 8}" in lines[0]
    assert res.stderr.index(lines[0]) < res.stderr.index("error: TensorRT Python package not found")
    assert not (tmp_path / "p.engine").exists()
