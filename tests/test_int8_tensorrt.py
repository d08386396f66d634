"""The default static int8 for TensorRT (exporters/quantization/: recipe_tensorrt.py, qdq.py, search.py,
smoothing.py, gemm_error.py, stats.py) on the real fmnist-vit.

* Q/DQ placement node by node: a Q -> DQ pair (int8, zero point 0, per-tensor scale) on the
  activation input of every int8 GEMM, an int8 weight behind a per-channel DequantizeLinear, and
  nothing on LayerNorm, Softmax, GELU, residual adds or attention's activation x activation
  products;
* the folds (SmoothQuant scales, searched per site) leave the float model's logits within 1e-5;
* the plan: every GEMM's precision, FLOPs and the int8 FLOP share in the metadata and the CLI;
* the searches pick what the measured error says (clipping on a heavy tail, smoothing on an
  outlier channel).
"""

from __future__ import annotations


import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from edgeprune.errors import UserError
from exporters.onnx import read_metadata
from exporters.quantization import QuantizeConfig, quantize_onnx
from exporters.quantization import gemm_error as sens
from exporters.quantization.qdq import fake_quant_weight, find_gemms, insert_qdq, quantize_weight
from exporters.quantization.recipe_tensorrt import choose_fallback
from exporters.quantization.search import choose_clip
from exporters.quantization.smoothing import apply_smoothing, choose_alpha
from exporters.quantization.stats import gemm_input_stats

from tests.conftest import export_fmnist_vit, needs_fmnist, ort_outputs, run_cli

N_CALIB = 64


_ort = ort_outputs


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("fmnist-vit")
    d = tmp_path_factory.mktemp("int8trt")
    fp32 = export_fmnist_vit(d)
    calib = spec.calibration_source(N_CALIB, seed=0).images.numpy()
    ev = spec.eval_source(n=200)
    q = quantize_onnx(fp32, d / "int8.onnx", QuantizeConfig(calib_size=N_CALIB, eval_size=200, threads=1,
                                                            sensitivity_images=16))
    return {"dir": d, "fp32": fp32, "calib": calib, "x": ev.images.numpy(), "q": q}


@needs_fmnist
def test_default_static_int8_is_the_tensorrt_recipe(work):
    md = read_metadata(work["q"].path)
    assert md["quantization"]["recipe_used"] == "tensorrt"
    assert QuantizeConfig().resolved_recipe() == "tensorrt"
    # every option only ONNX Runtime's quantizer has selects the earlier path (old commands unchanged)
    for kw in ({"activation_symmetric": False}, {"calib_method": "entropy"}, {"smooth_alpha": 0.5},
               {"auto_exclude": 2}, {"quantize_attention": True}, {"per_channel": False}):
        assert QuantizeConfig(**kw).resolved_recipe() == "ort", kw
    assert QuantizeConfig(recipe="ort").resolved_recipe() == "ort"
    assert QuantizeConfig(mode="dynamic").resolved_recipe() == ""
    with pytest.raises(UserError, match="need --recipe ort"):
        QuantizeConfig(recipe="tensorrt", activation_symmetric=False).validate()
    with pytest.raises(UserError, match="unknown int8 recipe"):
        QuantizeConfig(recipe="trt").validate()


@needs_fmnist
def test_qdq_placement_node_by_node(work):
    m = onnx.load(str(work["q"].path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}
    plan = {g["node"]: g for g in read_metadata(work["q"].path)["int8_plan"]["gemms"]}
    gemms = {n.name: n for n in m.graph.node if n.name in plan}
    assert len(gemms) == len(plan) == 6 * 4 + 2  # qkv, proj, fc1, fc2 per block, patch embedding, head
    n_int8 = 0
    for name, node in gemms.items():
        x_src, w_src = producer.get(node.input[0]), producer.get(node.input[1])
        if plan[name]["precision"] != "int8":
            assert x_src is None or x_src.op_type != "DequantizeLinear", name
            assert node.input[1] in inits and inits[node.input[1]].dtype == np.float32, name
            continue
        n_int8 += 1
        # activation: DQ(Q(x)) with one scalar scale and an int8 zero point 0
        assert x_src.op_type == "DequantizeLinear", name
        q = producer[x_src.input[0]]
        assert q.op_type == "QuantizeLinear" and q.input[1:] == x_src.input[1:], name
        scale, zp = inits[x_src.input[1]], inits[x_src.input[2]]
        assert scale.ndim == 0 and scale > 0 and zp.dtype == np.int8 and zp == 0, name
        assert producer.get(q.input[0]) is None or producer[q.input[0]].op_type != "DequantizeLinear"
        # weight: int8 initializer, one scale per output channel, zero points 0, axis = output channels
        assert w_src.op_type == "DequantizeLinear", name
        wq, ws, wz = (inits[i] for i in w_src.input)
        axis = next(a.i for a in w_src.attribute if a.name == "axis")
        n_out = wq.shape[0] if node.op_type in ("Conv", "Gemm") else wq.shape[1]
        assert wq.dtype == np.int8 and np.abs(wq.astype(int)).max() <= 127, name
        assert ws.shape == (n_out,) == wz.shape and wq.shape[axis] == n_out and not wz.any(), name
    assert n_int8 == sum(g["precision"] == "int8" for g in plan.values()) >= len(plan) - 6
    # nothing quantized anywhere else: Q/DQ feed only GEMMs (and Q only its DQ)
    consumers: dict[str, list] = {}
    for n in m.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear":
            assert [c.op_type for c in consumers[n.output[0]]] == ["DequantizeLinear"]
        if n.op_type == "DequantizeLinear":
            assert all(c.name in plan for c in consumers[n.output[0]]), n.name
    for n in m.graph.node:
        if n.op_type in ("LayerNormalization", "Softmax", "Erf", "Add", "Mul", "Div") or (
                n.op_type == "MatMul" and n.name not in plan):
            srcs = [producer.get(i) for i in n.input]
            assert not any(s is not None and s.op_type == "DequantizeLinear" for s in srcs), n.name


@needs_fmnist
def test_folds_keep_the_float_model(work):
    base = onnx.load(str(work["fp32"]))
    x = work["calib"][:32]
    ref = _ort(base, x)
    for smooth in ("search", 0.5):
        model = sens.copy_model(base)
        gemms = find_gemms(model)
        stats = gemm_input_stats(model, work["calib"], gemms, threads=1)
        report = apply_smoothing(model, stats, smooth)
        assert sum(r["alpha"] is not None for r in report) >= 6  # folds happened
        changed = [t.name for t, u in zip(model.graph.initializer, base.graph.initializer)
                   if not np.array_equal(numpy_helper.to_array(t), numpy_helper.to_array(u))]
        assert any("norm" in c for c in changed) and len(changed) >= 12
        assert len(model.graph.node) == len(base.graph.node)  # initializers only
        np.testing.assert_allclose(_ort(model, x), ref, atol=1e-5, rtol=0)


@needs_fmnist
def test_plan_and_flop_share_in_metadata_and_report(work):
    md = read_metadata(work["q"].path)
    plan = md["int8_plan"]
    total = sum(g["flops"] for g in plan["gemms"])
    share = sum(g["flops"] for g in plan["gemms"] if g["precision"] == "int8") / total
    assert md["int8_flops_share"] == pytest.approx(share) == pytest.approx(plan["int8_flops_share"])
    assert share >= 0.9
    assert md["excluded_nodes"] == [g["node"] for g in plan["gemms"] if g["precision"] != "int8"]
    by = {g["kind"]: g for g in plan["gemms"]}
    # fmnist-vit: 28 px, patch 4 -> 49 tokens (global average pool, no class token), width 128
    assert by["patch_embed"]["flops"] == 2 * 49 * 16 * 128
    assert by["qkv"]["flops"] == 2 * 49 * 128 * 384
    assert by["head"]["flops"] == 2 * 128 * 10
    assert work["q"].report["int8_plan"]["int8_flops_share"] == pytest.approx(share)
    assert work["q"].report["agreement"] >= 0.97


@needs_fmnist
def test_cli_reports_precision_per_gemm(work, tmp_path):
    out = tmp_path / "cli.onnx"
    r = run_cli(["quantize", str(work["fp32"]), "--precision", "int8", "-o", str(out), "--calib-size", "32",
                 "--eval-size", "50", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert "of GEMM FLOPs in int8" in r.stdout and "precision per GEMM" in r.stdout
    r2 = run_cli(["quantize", str(work["fp32"]), "--precision", "int8", "-o", str(tmp_path / "x.onnx"),
                  "--recipe", "tensorrt", "--asymmetric-activations"])
    assert r2.exit_code == 2 and "need --recipe ort" in r2.output


def test_weight_quantization_is_per_channel_symmetric():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 8)).astype(np.float32) * np.linspace(0.1, 10, 8, dtype=np.float32)
    q, s = quantize_weight(w, axis=1)
    assert q.dtype == np.int8 and s.shape == (8,) and np.abs(q).max(axis=0).tolist() == [127] * 8
    np.testing.assert_allclose(fake_quant_weight(w, 1), q * s, rtol=0, atol=0)
    assert np.abs(fake_quant_weight(w, 1) - w).max(axis=0).tolist() <= (s / 2 + 1e-7).tolist()


def test_clip_search_follows_the_output_error():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 32)).astype(np.float32)
    heavy = rng.normal(size=(2048, 64)).astype(np.float32)
    heavy[0, 0] = 400.0  # one huge value: MinMax would waste the range on it
    r, errs = choose_clip(heavy, float(np.abs(heavy).max()), [w])
    assert r < 1.0 and errs[str(r)] < errs["1.0"]
    flat = rng.uniform(-1, 1, size=(2048, 64)).astype(np.float32)
    r2, _ = choose_clip(flat, float(np.abs(flat).max()), [w])
    assert r2 >= 0.9


def test_alpha_search_smooths_an_outlier_channel():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1024, 32)).astype(np.float32)
    x[:, 3] *= 60.0
    w = rng.normal(size=(32, 16)).astype(np.float32)
    alpha, s, errs = choose_alpha(x, np.abs(x).max(axis=0).astype(np.float64), [w])
    assert alpha is not None and errs[str(alpha)] < 0.5 * errs["None"] and s[3] == s.max()


def test_fallback_takes_the_most_error_per_flop_within_the_flop_cap():
    rows = [{"node": "big", "rel_err": 8.0, "flops": 40}, {"node": "head", "rel_err": 2.0, "flops": 1},
            {"node": "mid", "rel_err": 3.0, "flops": 9}, {"node": "tiny_err", "rel_err": 0.1, "flops": 1},
            {"node": "rest", "rel_err": 0.9, "flops": 49}]  # summed error 14, FLOPs 100
    # candidates: >= 10% of 14 = 1.4 -> big, head, mid; by error per FLOP: head (2), mid (0.33), big (0.2)
    assert choose_fallback(rows, 0.10, 0.10) == ["head", "mid"]        # 10 FLOPs: big does not fit
    assert choose_fallback(rows, 0.10, 0.50) == ["head", "mid", "big"]  # 50 FLOPs
    assert choose_fallback(rows, 0.10, 0.05) == ["head"]               # mid skipped, nothing else fits
    assert choose_fallback(rows, 0.50, 0.50) == ["big"]                # only big carries >= 7
    assert choose_fallback(rows, 1.0, 1.0) == []
    assert choose_fallback(rows, 0.001, 0.02) == ["head", "tiny_err"]  # a skipped one does not stop the rest
    # the default (None): candidates carry at least the mean error 14 / 5 = 2.8 -> big, mid (not head)
    assert choose_fallback(rows, None, 0.10) == ["mid"]
    assert choose_fallback(rows, None, 0.50) == ["mid", "big"]


@needs_fmnist
def test_tensorrt_build_settings_of_the_new_file(work):
    """The new file is explicitly quantized to TensorRT: it builds with INT8 + FP16 (the engine
    itself is built only where TensorRT and a GPU are, below)."""
    from devices import load_profile
    from exporters.tensorrt_settings import builder_settings, onnx_input, onnx_precision

    prec = onnx_precision(work["q"].path)
    assert prec == "int8"
    name, shape = onnx_input(work["q"].path)
    for asked in ("int8", None):  # Q/DQ nodes build INT8 + FP16 whatever the profile says
        s = builder_settings(load_profile("orin-nx"), shape, input_name=name, precision=asked, model_precision=prec)
        assert s["int8"] and s["fp16"] and s["explicit_quantization"] and s["precision"] == "int8"


@needs_fmnist
def test_tensorrt_engine_of_the_new_file(work, tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed here: the int8 engine is not built")
    from edgeprune.errors import RuntimeFault
    from exporters.tensorrt import build_engine

    try:
        engine = build_engine(work["q"].path, "orin-nx", tmp_path / "int8.engine", force_device=True,
                              precision="int8")
    except RuntimeFault as err:  # TensorRT without a GPU
        pytest.skip(f"no GPU: {err}")
    assert engine.stat().st_size > 0


@needs_fmnist
def test_sensitivity_from_block_cuts_matches_whole_runs(work):
    """Running a variant from a cached block input gives the whole model's outputs, so the
    per-GEMM pass may skip the blocks before the quantized GEMM."""
    model = onnx.load(str(work["fp32"]))
    gemms = find_gemms(model)
    cuts = sens.block_cuts(model, gemms)
    assert sorted(cuts) == list(range(6))
    x = work["x"][:32]
    ev = sens.prepare_eval(model, x, None, list(cuts.values()), threads=1)
    for b in (0, 3, 5):
        np.testing.assert_allclose(sens.run_variant(model, ev, cuts[b], threads=1), ev.float_out, atol=1e-5)
    stats = gemm_input_stats(model, work["calib"][:16], gemms, threads=1)
    rows = sens.gemm_sensitivity(model, stats, ev, [g for g in gemms if g.block == 4], threads=1)
    for r in rows:  # from the cut == from the images, GEMM by GEMM
        variant = sens.copy_model(model)
        insert_qdq(variant, [g for g in gemms if g.name == r["node"]], stats.amax)
        whole = sens.cost(sens.run_variant(variant, ev, None, threads=1), ev)
        assert r["rel_err"] == pytest.approx(whole["rel_err"], rel=1e-3) and r["rel_err"] > 0
