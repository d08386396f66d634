"""SmoothQuant scale migration on ONNX graphs (exporters/quantization/smoothing.py, stats.py).

* the float model is unchanged by smoothing (up to rounding), while its constants did change;
* the sites are exactly the LayerNorm -> weight-MatMul pairs (2 per ViT block), and a LayerNorm
  whose output also feeds a value-reading op is left alone;
* the scales follow SmoothQuant eq. 4;
* on a layer with an outlier channel, int8 after smoothing is more accurate than without;
* ``edgeprune quantize --smooth-alpha`` records the sites; bad alpha is a one-line error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeprune.errors import UserError
from exporters.quantization.smoothing import find_sites, smooth_onnx, smoothing_scales
from exporters.quantization.stats import collect_stats

from tests.conftest import assert_one_line_error, needs_fmnist, run_cli


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _ln_matmul(path: Path, gamma: np.ndarray, w: np.ndarray, extra_reader: bool = False) -> Path:
    """input (N, 1, T, C) -> LayerNorm(gamma, beta) -> MatMul(W (C, out)) [-> + LN output]."""
    c, o = w.shape
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(gamma.astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.normal(0, 0.1, c).astype(np.float32), "beta"),
             numpy_helper.from_array(w.astype(np.float32), "W")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], name="norm", axis=-1),
             helper.make_node("MatMul", ["ln", "W"], ["mm"], name="proj")]
    out = "mm"
    if extra_reader:  # the LN output is also read by value (a residual add): not smoothable
        assert c == o
        nodes.append(helper.make_node("Add", ["mm", "ln"], ["y"], name="res"))
        out = "y"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 16, c])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))
    return path


def _outlier_layer(tmp_path: Path, extra_reader: bool = False) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(0)
    c = 32
    gamma = rng.uniform(0.5, 1.5, c)
    gamma[[3, 17]] = 60.0  # two outlier channels, as after DINOv2's LayerNorms
    w = rng.normal(0, 0.2, (c, c))
    x = rng.normal(0, 1, (64, 1, 16, c)).astype(np.float32)
    return _ln_matmul(tmp_path / "layer.onnx", gamma, w, extra_reader), x


def test_smoothing_keeps_the_float_model_and_moves_the_range(tmp_path):
    src, x = _outlier_layer(tmp_path)
    dst = tmp_path / "smooth.onnx"
    report = smooth_onnx(src, dst, x, alpha=0.5)
    assert [r["norm"] for r in report] == ["norm"]
    ref, out = _run(src, x), _run(dst, x)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(src)).graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(dst)).graph.initializer}
    s = before["gamma"] / after["gamma"]
    np.testing.assert_allclose(after["beta"], before["beta"] / s, rtol=1e-6)
    np.testing.assert_allclose(after["W"], before["W"] * s[:, None], rtol=1e-6)
    # the outlier channels are divided by the most: the LN output's range is flatter
    assert set(np.argsort(s)[-2:]) == {3, 17}
    assert report[0]["x_range_after"] < report[0]["x_range_before"] / 3


def test_scales_follow_smoothquant_eq4():
    x = np.array([8.0, 1.0, 0.0, 4.0])
    w = np.array([0.5, 2.0, 1.0, 0.0])
    s = smoothing_scales(x, w, 0.5)
    np.testing.assert_allclose(s, [np.sqrt(8.0) / np.sqrt(0.5), 1.0 / np.sqrt(2.0), 1.0, 1.0])
    np.testing.assert_allclose(smoothing_scales(x[:2], w[:2], 1.0), x[:2])  # alpha 1: all range to weights
    np.testing.assert_allclose(smoothing_scales(x[:2], w[:2], 0.0), 1 / w[:2])
    assert smoothing_scales(np.array([1e12]), np.array([1e-12]), 0.5)[0] == 1e4  # clipped


def test_absmax_is_the_per_channel_max(tmp_path):
    src, x = _outlier_layer(tmp_path)
    amax = collect_stats(src, ["ln"], x, batch_size=10, rows=0).chan_amax["ln"]
    # the LayerNorm by hand
    mu = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(src)).graph.initializer}
    ln = (x - mu) / np.sqrt(var + 1e-5) * inits["gamma"] + inits["beta"]
    np.testing.assert_allclose(amax, np.abs(ln.reshape(-1, 32)).max(0), rtol=1e-4)


def test_a_norm_read_by_value_elsewhere_is_left_alone(tmp_path):
    src, x = _outlier_layer(tmp_path, extra_reader=True)
    assert find_sites(onnx.load(str(src))) == []
    dst = tmp_path / "same.onnx"
    assert smooth_onnx(src, dst, x) == []
    np.testing.assert_array_equal(_run(dst, x), _run(src, x))


def test_smoothing_makes_int8_more_accurate_on_an_outlier_channel(tmp_path):
    from exporters.quantization import ort_int8 as int8
    from exporters.quantization.calibration import ArrayCalibrationReader
    from exporters.quantization.config import QuantizeConfig

    src, x = _outlier_layer(tmp_path)
    calib, test = x[:32], x[32:]
    smooth = tmp_path / "smooth.onnx"
    smooth_onnx(src, smooth, calib, alpha=0.5)
    ref = _run(src, test)
    errs = {}
    for name, path in (("plain", src), ("smooth", smooth)):
        q = tmp_path / f"{name}.int8.onnx"
        reader = ArrayCalibrationReader(calib, "x", 8)
        int8.quantize_static_qdq(path, q, QuantizeConfig(), reader=reader, cache=tmp_path / f"{name}.json")
        errs[name] = float(np.sum((_run(q, test) - ref) ** 2) / np.sum(ref ** 2))
    assert errs["smooth"] < 0.5 * errs["plain"], errs


@pytest.fixture(scope="module")
def fmnist_onnx(tmp_path_factory):
    """(spec, the dense fmnist-vit exported as `edgeprune export --model fmnist-vit` does)."""
    from edgeprune.zoo.registry import get_model_spec
    from exporters.onnx import build_metadata, export_onnx

    spec = get_model_spec("fmnist-vit")
    model = spec.create()
    md = build_metadata(spec=spec, model=model, model_name=spec.name)
    md["base_model"] = spec.to_record()
    return spec, export_onnx(model, tmp_path_factory.mktemp("smooth") / "dense.onnx", spec.input_size, md)


@needs_fmnist
def test_vit_sites_and_exactness(tmp_path, fmnist_onnx):
    spec, src = fmnist_onnx
    sites = find_sites(onnx.load(str(src)))
    assert [s.norm.rsplit("/", 2)[-2] for s in sites] == ["norm1", "norm2"] * 6  # qkv and fc1 inputs
    assert all(len(s.weights) == 1 for s in sites)
    x = spec.calibration_source(32, seed=0).images.numpy()
    dst = tmp_path / "smooth.onnx"
    smooth_onnx(src, dst, x, alpha=0.5)
    test = spec.eval_source(n=64).images.numpy()
    ref, out = _run(src, test), _run(dst, test)
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()
    assert onnx.load(str(dst)).metadata_props == onnx.load(str(src)).metadata_props


@needs_fmnist
def test_cli_smooth_alpha(tmp_path, fmnist_onnx):
    from exporters.onnx import read_metadata

    _, src = fmnist_onnx
    out = tmp_path / "sq.onnx"
    r = run_cli(["quantize", str(src), "--precision", "int8", "--smooth-alpha", "0.5", "--calib-size", "16",
                 "--eval-size", "50", "--threads", "1", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "smoothing (alpha 0.5): 12 LayerNorm -> MatMul sites" in r.stdout
    meta = read_metadata(out)
    assert len(meta["smoothing"]) == 12 and meta["quantization"]["smooth_alpha"] == 0.5
    bad = run_cli(["quantize", str(src), "--precision", "int8", "--smooth-alpha", "1.5",
                   "-o", str(tmp_path / "b.onnx")])
    assert_one_line_error(bad, "--smooth-alpha must be in [0, 1]")
    assert not (tmp_path / "b.onnx").exists()
    with pytest.raises(UserError, match="applies to int8"):
        from exporters.quantization.config import QuantizeConfig

        QuantizeConfig(precision="fp16", smooth_alpha=0.5).validate()
