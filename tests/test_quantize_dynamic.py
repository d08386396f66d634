"""``edgeprune quantize --precision int8 --mode dynamic`` (exporters/quantization/ort_int8.quantize_dynamic_int8).

ONNX Runtime dynamic quantization: MatMul/Gemm weights stored int8 (symmetric, one scale per output
channel), each quantized MatMul's input quantized at run time (DynamicQuantizeLinear, uint8).
Checked on the real fmnist-vit:
* the graph: DynamicQuantizeLinear + MatMulInteger for every linear layer and the head, no Q/DQ
  nodes, attention's activation x activation MatMuls and the patch-embedding Conv float;
* the int8 weights dequantize to the float weights within half a step of their own channel's
  scale (per-channel symmetric quantization, exactly);
* it runs in ONNX Runtime and agrees with the float model on >= 95 % of held-out test images;
* no calibration set is read (a foreign ONNX file with no edgeprune metadata quantizes);
* exclusions by node name (also a Gemm's, which ONNX Runtime rewrites as ``<name>_MatMul``) and
  ``--auto-exclude`` keep nodes float;
* TensorRT refuses the file with a one-line error naming ``--mode static``; ONNX Runtime benches it;
* bad combinations are one-line errors that leave nothing behind.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from edgeprune.errors import UserError
from exporters.onnx import read_metadata
from exporters.quantization import QuantizeConfig, quantize_onnx

from tests.conftest import assert_one_line_error, needs_fmnist, run_cli
from tests.test_quantize import N_EVAL, assert_agrees_with_float, dense_export

pytestmark = needs_fmnist

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Dense fmnist-vit fp32 export, its dynamic int8 copy, and the float outputs on 500 test images."""
    from edgeprune.zoo.registry import get_model_spec

    base = dense_export(tmp_path_factory.mktemp("dyn"), get_model_spec("fmnist-vit"))
    dyn = quantize_onnx(base["fp32"], base["dir"] / "dyn.onnx",
                        QuantizeConfig(mode="dynamic", eval_size=N_EVAL, threads=1))
    return {**base, "dyn": dyn}


def _integer_matmuls(m: onnx.ModelProto) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """MatMulInteger node name -> (int8 weight (in, out), its zero point)."""
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    return {n.name: (inits[n.input[1]], inits[n.input[3]]) for n in m.graph.node if n.op_type == "MatMulInteger"}


def test_dynamic_graph_quantizes_linear_layers_and_head_only(work):
    m = onnx.load(str(work["dyn"].path))
    ops = [n.op_type for n in m.graph.node]
    assert "QuantizeLinear" not in ops and "DequantizeLinear" not in ops
    mm = _integer_matmuls(m)
    # 6 blocks x (qkv, proj, fc1, fc2) + the head Gemm (rewritten by ONNX Runtime as /head/Gemm_MatMul)
    assert len(mm) == 6 * 4 + 1 and ops.count("DynamicQuantizeLinear") == len(mm)
    assert any(name.startswith("/head/Gemm") for name in mm)
    float_mm = [n.name for n in m.graph.node if n.op_type == "MatMul"]
    assert len(float_mm) == 12 and all(n.endswith(("/attn/MatMul", "/attn/MatMul_1")) for n in float_mm)
    assert ops.count("Conv") == 1  # patch embedding stays float
    for name, (w, zp) in mm.items():
        assert w.dtype == np.int8, name
        assert zp.shape == (w.shape[1],) and not zp.any(), f"{name}: symmetric, one zero point per output channel"
    assert work["dyn"].path.stat().st_size <= 0.35 * work["fp32"].stat().st_size


def test_dynamic_weights_dequantize_per_channel_within_half_a_step(work):
    """w_int8 * scale_j reproduces every float weight of output channel j within scale_j / 2."""
    m = onnx.load(str(work["dyn"].path))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    consumers = {}
    for n in m.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    sd = {k: v.detach().numpy() for k, v in work["model"].state_dict().items()}
    checked = 0
    for n in m.graph.node:
        if n.op_type != "MatMulInteger" or not n.name.startswith("/blocks/blocks.0/mlp/fc"):
            continue
        w_q = inits[n.input[1]].astype(np.float64)
        # the weight scale is the initializer multiplied with the input scale right after the MatMul
        mul = next(c for c in consumers[n.input[1].replace("_quantized", "_scale")] if c.op_type == "Mul")
        scale = inits[n.input[1].replace("_quantized", "_scale")].astype(np.float64)
        assert mul is not None and scale.shape == (w_q.shape[1],) and len(np.unique(scale)) > 1
        layer = "fc1" if "fc1" in n.name else "fc2"
        w = sd[f"blocks.0.mlp.{layer}.weight"].T.astype(np.float64)  # (in, out) as the MatMul reads it
        assert w.shape == w_q.shape
        err = np.abs(w_q * scale[None, :] - w)
        assert np.all(err <= scale[None, :] / 2 + 1e-7), float((err / scale).max())
        # symmetric: the largest |w| of each channel maps to +-127
        assert np.allclose(np.abs(w_q).max(0), 127)
        checked += 1
    assert checked == 2


def test_dynamic_runs_and_agrees_with_float(work):
    assert_agrees_with_float(work["dyn"], work["x"], work["y"], work["ref"])


def test_dynamic_metadata_records_the_mode_and_no_calibration(work):
    before = read_metadata(work["fp32"])
    md = read_metadata(work["dyn"].path)
    for key, value in before.items():
        assert md[key] == value, key
    assert md["precision"] == "int8" and md["quantization"]["mode"] == "dynamic"
    assert "quantize_dynamic" in md["quantization"]["tool"]
    assert "calibration_sha256" not in md and "quant_calibration" not in md
    assert md["excluded_nodes"] == md["float_attention_nodes"] and len(md["excluded_nodes"]) == 12


def test_dynamic_needs_no_calibration_set(work, tmp_path):
    plain = onnx.load(str(work["fp32"]))
    del plain.metadata_props[:]
    onnx.save(plain, str(tmp_path / "plain.onnx"))
    # static int8 needs calibration data a foreign file cannot name; dynamic does not
    with pytest.raises(UserError, match="no calibration data"):
        quantize_onnx(tmp_path / "plain.onnx", tmp_path / "s.onnx", QuantizeConfig())
    r = quantize_onnx(tmp_path / "plain.onnx", tmp_path / "d.onnx", QuantizeConfig(mode="dynamic"),
                      eval_source=(work["x"][:100], None))
    assert r.report["calibration"] is None and r.report["agreement"] >= 0.95


def test_dynamic_exclude_by_gemm_name_and_auto_exclude(work, tmp_path):
    out = tmp_path / "x.onnx"
    quantize_onnx(work["fp32"], out, QuantizeConfig(mode="dynamic", exclude=("/head/*", "*/mlp/fc2/*"),
                                                    eval_size=50, threads=1))
    mm = _integer_matmuls(onnx.load(str(out)))
    assert len(mm) == 6 * 3 and not any("head" in n or "fc2" in n for n in mm)
    auto = tmp_path / "auto.onnx"
    r = quantize_onnx(work["fp32"], auto, QuantizeConfig(mode="dynamic", auto_exclude=2, calib_size=32,
                                                         sensitivity_images=32, eval_size=50, threads=1))
    md = read_metadata(auto)
    ranking = [s["node"] for s in md["sensitivity"]]
    assert len(ranking) == 25 and md["auto_excluded_nodes"] == ranking[:2]
    kept = _integer_matmuls(onnx.load(str(auto)))
    assert len(kept) == 23
    for name in ranking[:2]:
        assert not any(k == name or k.startswith(f"{name}_") for k in kept), name
    assert set(ranking[:2]) <= set(r.report["excluded_nodes"])


def test_tensorrt_refuses_dynamic_files_and_onnxruntime_accepts_them(work):
    from exporters.tensorrt_settings import onnx_precision

    with pytest.raises(UserError, match="dynamically quantized .*--mode static"):
        onnx_precision(work["dyn"].path)
    assert onnx_precision(work["dyn"].path, for_tensorrt=False) == "int8"
    engine = work["dir"] / "dyn.engine"
    assert_one_line_error(run_cli(["build", str(work["dyn"].path), "--device", "orin-nx", "-o", str(engine)]),
                          "--mode static")
    assert not engine.exists()
    r = run_cli(["bench", str(work["dyn"].path), "--device", "cpu", "--batch-sizes", "1",
                 "--iterations", "2", "--warmup", "1"])
    assert r.exit_code == 0, r.output


def test_bad_dynamic_settings_are_one_line_errors(work, tmp_path):
    # (issue 53: a Python caller is told the keywords, the command line the options)
    for kwargs, pattern in (({"mode": "dynamic", "calib_method": "entropy"}, "^calib_method applies to mode static"),
                            ({"mode": "dynamic", "precision": "fp16"}, "^mode dynamic applies to int8"),
                            ({"mode": "weekly"}, "unknown int8 mode")):
        with pytest.raises(UserError, match=pattern):
            QuantizeConfig(**kwargs).validate()
    out = tmp_path / "o.onnx"
    r = run_cli(["quantize", str(work["fp32"]), "--precision", "int8", "--mode", "dynamic",
                 "--calib-method", "entropy", "-o", str(out)])
    assert_one_line_error(r, "--calib-method applies to --mode static")
    r = run_cli(["quantize", str(work["fp32"]), "--precision", "int8", "--mode", "hourly", "-o", str(out)])
    assert r.exit_code == 2 and "--mode" in r.output and "Traceback" not in r.output
    assert list(tmp_path.iterdir()) == []
