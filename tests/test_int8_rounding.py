"""GPTQ weight rounding (exporters/quantization/weight_rounding.py) and explicit SmoothQuant scales
before fc2 (exporters/quantization/smoothing_explicit.py), the two steps the TensorRT int8 recipe added for DINOv2.

* GPTQ equals round-to-nearest exactly when the inputs are white (H ~ I: no error to move), keeps
  nearest's per-channel scales and the int8 range, and lowers the GEMM output error
  ``||X (Q - W)||`` on correlated inputs (its whole point);
* an explicit ``Mul(x, 1/s)`` before ``fc2`` with ``s W`` leaves the float model's logits within
  1e-5, and the statistics it records for the new tensor are those of ``x / s``;
* the default recipe writes GPTQ-rounded weights (scales of nearest, integers not all nearest's)
  and says so in the plan.
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
from exporters.quantization.qdq import find_gemms, quantize_weight
from exporters.quantization.smoothing_explicit import explicit_sites, smooth_explicit
from exporters.quantization.stats import gemm_input_stats
from exporters.quantization.weight_rounding import get_weight_rounding, round_gptq, round_nearest

from tests.conftest import export_fmnist_vit, needs_fmnist, ort_outputs


_ort = ort_outputs


def _out_err(x: np.ndarray, w: np.ndarray, q: np.ndarray, s: np.ndarray) -> float:
    return float(np.sum((x @ (q.astype(np.float64) * s) - x @ w) ** 2))


def test_gptq_equals_nearest_for_white_inputs():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 24)).astype(np.float32)
    qn, sn = round_nearest(w)
    qg, sg = round_gptq(w, 5.0 * np.eye(48))
    assert np.array_equal(qn, qg) and np.array_equal(sn, sg)
    # nearest is exactly the Q/DQ writer's weight quantization
    q0, s0 = quantize_weight(w, 1)
    assert np.array_equal(qn, q0) and np.array_equal(sn, s0)


def test_gptq_lowers_the_output_error_on_correlated_inputs():
    rng = np.random.default_rng(1)
    k, o, n = 64, 32, 4000
    mix = rng.normal(size=(k, k)) * np.linspace(3.0, 0.05, k)[:, None]  # correlated, uneven channels
    x = rng.normal(size=(n, k)) @ mix
    w = rng.normal(size=(k, o)).astype(np.float32)
    qn, sn = round_nearest(w)
    qg, sg = round_gptq(w, x.T @ x)
    assert np.array_equal(sn, sg)  # same grid: only the integers differ
    assert qg.dtype == np.int8 and np.abs(qg.astype(int)).max() <= 127
    assert (qg != qn).mean() > 0.05
    e_near, e_gptq = _out_err(x, w, qn, sn), _out_err(x, w, qg, sg)
    assert e_gptq < 0.5 * e_near, (e_gptq, e_near)
    # no gram: nearest
    assert np.array_equal(round_gptq(w, None)[0], qn)
    with pytest.raises(ValueError, match="does not match"):
        round_gptq(w, np.eye(3))


def test_unknown_weight_rounding_is_one_line():
    with pytest.raises(UserError, match="^unknown weight rounding 'adaround', known: nearest, gptq$"):
        get_weight_rounding("adaround")
    with pytest.raises(UserError, match="unknown weight rounding"):
        QuantizeConfig(weight_rounding="adaround").validate()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("fmnist-vit")
    d = tmp_path_factory.mktemp("int8round")
    fp32 = export_fmnist_vit(d)
    calib = spec.calibration_source(32, seed=0).images.numpy()
    return {"dir": d, "fp32": fp32, "calib": calib}


@needs_fmnist
def test_explicit_fc2_scales_keep_the_float_model(work):
    base = onnx.load(str(work["fp32"]))
    x = work["calib"][:16]
    ref = _ort(base, x)
    model = sens.copy_model(base)
    gemms = find_gemms(model)
    stats = gemm_input_stats(model, work["calib"], gemms, threads=1, gram=True)
    fc2 = explicit_sites(model, gemms, ("fc2",))
    assert len(fc2) == 6 and all(g.kind == "fc2" for g in fc2)
    report = smooth_explicit(model, stats, gemms, ("fc2",), alphas=(0.5,))
    assert [r["alpha"] for r in report] == [0.5] * 6
    muls = [n for n in model.graph.node if n.op_type == "Mul" and n.name.endswith("_smooth_Mul")]
    assert len(muls) == 6
    after = {g.name: g for g in find_gemms(model)}
    for g, mul in zip(fc2, muls):
        assert after[g.name].x == mul.output[0] and mul.input[0] == g.x  # GELU -> Mul -> fc2
        new = mul.output[0]
        inv = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == mul.input[1]))
        s = 1.0 / inv.astype(np.float64)
        np.testing.assert_allclose(stats.chan_amax[new], stats.chan_amax[g.x] / s, rtol=1e-6)
        np.testing.assert_allclose(stats.gram[new], stats.gram[g.x] / np.outer(s, s), rtol=1e-6)
    np.testing.assert_allclose(_ort(model, x), ref, atol=1e-5, rtol=0)


@needs_fmnist
def test_recipe_rounds_weights_by_gptq_and_records_it(work):
    from exporters.quantization.recipe_tensorrt import prepare_int8

    got = {}
    for rounding in ("gptq", "nearest"):
        cfg = QuantizeConfig(threads=1, weight_rounding=rounding)
        got[rounding] = prepare_int8(onnx.load(str(work["fp32"])), work["calib"], cfg)
    g, n = got["gptq"], got["nearest"]
    inits = {t.name: numpy_helper.to_array(t) for t in g.model.graph.initializer}
    e_g = e_n = 0.0
    changed = 0
    for gem in g.gemms:
        if gem.name not in g.weights or gem.x not in g.stats.gram:
            continue
        (qg, sg), (qn, sn) = g.weights[gem.name], n.weights[gem.name]
        np.testing.assert_array_equal(sg, sn)  # the same per-channel grid
        w = inits[gem.w].astype(np.float64)
        w, qg, qn = (w, qg, qn) if gem.axis == 1 else (w.T, qg.T, qn.T)
        h = g.stats.gram[gem.x]
        for q, acc in ((qg, "g"), (qn, "n")):
            d = q.astype(np.float64) * sg - w
            err = float(np.sum(d * (h @ d)))  # ||X (Q - W)||^2 over every calibration token
            if acc == "g":
                e_g += err
            else:
                e_n += err
        changed += int((qg != qn).any())
    assert changed >= 20
    assert e_g < 0.8 * e_n, (e_g, e_n)
    q = quantize_onnx(work["fp32"], work["dir"] / "int8.onnx",
                      QuantizeConfig(calib_size=32, eval_size=50, threads=1, sensitivity_images=8))
    md = read_metadata(q.path)
    assert md["int8_plan"]["weight_rounding"] == "gptq" == md["quantization"]["weight_rounding"]


@needs_fmnist
def test_weight_rounding_outside_the_tensorrt_recipe_is_refused(work, tmp_path):
    from tests.conftest import assert_one_line_error, run_cli

    for extra in (["--recipe", "ort"], ["--mode", "dynamic"], ["--calib-method", "entropy"]):
        r = run_cli(["quantize", str(work["fp32"]), "--precision", "int8", "-o", str(tmp_path / "x.onnx"),
                     "--weight-rounding", "nearest", *extra])
        assert_one_line_error(r, "--weight-rounding applies to static int8 with the tensorrt recipe")
        assert not (tmp_path / "x.onnx").exists()
