"""The quantization package's seams: the recipe registry and the config sections (exporters/quantization/).

* a toy recipe registered inside the test runs through the public entry point
  (:func:`exporters.quantization.quantize_onnx`): it receives the calibration array, writes the file,
  and its name and tool land in the metadata; unregistered, its name is a one-line error;
* the recipe that runs for each precision / mode / ``recipe`` / ONNX-Runtime-only option;
* ``QuantizeConfig(**flat)`` routes every field to its section, reads it back, and records the same
  flat dict as the one dataclass it replaced (all fields, in :data:`RECORD_ORDER`).

A tiny hand-made ONNX model (no edgeprune metadata, so no evaluation images): seconds, no dataset.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeprune.errors import UserError
from exporters.onnx import read_metadata
from exporters.quantization import (RECIPES, Converted, QuantizeConfig, Recipe, RecipeJob, quantize_onnx,
                                    register_recipe)
from exporters.quantization.config import RECORD_ORDER, SECTION_FIELDS, TensorRTSettings
from exporters.quantization.registry import unregister_recipe


def _tiny(path):
    """x (N, 3, 4, 4) -> Flatten -> MatMul W (48, 5) -> + b: one GEMM."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 1, (48, 5)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(0, 1, 5).astype(np.float32), "b")]
    nodes = [helper.make_node("Flatten", ["x"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "W"], ["mm"], name="fc"),
             helper.make_node("Add", ["mm", "b"], ["y"], name="bias")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))
    return path


class ToyRecipe(Recipe):
    """Rounds every weight to a multiple of 1/8 (a stand-in for a real quantizer); remembers its job."""

    name = "toy"
    seen: list[RecipeJob] = []

    def run(self, job: RecipeJob) -> Converted:
        ToyRecipe.seen.append(job)
        m = onnx.load(str(job.float_path))
        for t in m.graph.initializer:
            w = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array((np.round(w * 8) / 8).astype(w.dtype), t.name))
        onnx.save_model(m, str(job.quant_path))
        job.say("toy: rounded")
        return Converted("toy rounding 1/8", excluded=[])


@pytest.fixture
def toy():
    ToyRecipe.seen.clear()
    register_recipe(ToyRecipe())
    yield ToyRecipe
    unregister_recipe("toy")


def test_a_registered_toy_recipe_runs_through_quantize_onnx(tmp_path, toy):
    src = _tiny(tmp_path / "m.onnx")
    calib = np.random.default_rng(1).normal(0, 1, (6, 3, 4, 4)).astype(np.float32)
    lines: list[str] = []
    res = quantize_onnx(src, tmp_path / "q.onnx", QuantizeConfig(recipe="toy"), calibration=calib, log=lines.append)
    assert len(toy.seen) == 1 and np.array_equal(toy.seen[0].calib, calib)
    assert "toy: rounded" in lines
    w = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(res.path)).graph.initializer}["W"]
    w0 = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(src)).graph.initializer}["W"]
    np.testing.assert_array_equal(w, np.round(w0 * 8) / 8)
    assert not np.array_equal(w, w0)
    q = read_metadata(res.path)["quantization"]
    assert q["recipe"] == q["recipe_used"] == "toy" and q["tool"] == "toy rounding 1/8"
    assert res.report["calibration"]["num_images"] == 6


def test_an_unregistered_recipe_is_a_one_line_error(tmp_path, toy):
    unregister_recipe("toy")
    with pytest.raises(UserError, match="unknown int8 recipe 'toy'"):
        quantize_onnx(_tiny(tmp_path / "m.onnx"), tmp_path / "q.onnx", QuantizeConfig(recipe="toy"))
    assert not (tmp_path / "q.onnx").exists()
    with pytest.raises(ValueError):
        register_recipe(type("Auto", (Recipe,), {"name": "auto"})())


@pytest.mark.parametrize("kw, name, recorded", [
    ({}, "tensorrt", "tensorrt"),
    ({"recipe": "ort"}, "ort", "ort"),
    ({"smooth_alpha": 0.5}, "ort", "ort"),              # an ONNX-Runtime-only option picks ort
    ({"per_channel": False}, "ort", "ort"),
    ({"smooth_alpha": 0.5, "recipe": "tensorrt"}, "tensorrt", "tensorrt"),
    ({"mode": "dynamic"}, "ort", ""),
    ({"mode": "dynamic", "recipe": "tensorrt"}, "ort", ""),  # tensorrt serves static int8 only
    ({"precision": "fp16"}, "fp16", ""),
    ({"precision": "fp16", "recipe": "ort"}, "fp16", ""),
])
def test_the_recipe_that_runs(kw, name, recorded):
    cfg = QuantizeConfig(**kw).validate()
    assert cfg.recipe_name() == name and cfg.resolved_recipe() == recorded
    assert name in RECIPES and RECIPES[name].serves(cfg.common.precision, cfg.common.mode)


def test_flat_fields_route_to_sections_and_record_as_before():
    cfg = QuantizeConfig(threads=2, weight_rounding="nearest", calib_method="entropy", recipe="ort")
    assert cfg.common.threads == 2 and cfg.tensorrt.weight_rounding == "nearest" and cfg.ort.calib_method == "entropy"
    assert cfg.threads == 2 and cfg.weight_rounding == "nearest"  # flat reads
    every = [f for fields in SECTION_FIELDS.values() for f in fields]
    assert sorted(every) == sorted(RECORD_ORDER) and len(set(every)) == len(every)
    rec = cfg.to_record()
    assert list(rec) == [*RECORD_ORDER, "recipe_used"]
    assert rec["threads"] == 2 and rec["op_types"] == ["MatMul", "Gemm", "Conv"] and rec["recipe_used"] == "ort"
    assert dataclasses.replace(cfg, threads=3).common.threads == 3
    assert QuantizeConfig(tensorrt=TensorRTSettings(max_float_flops=0.2)).max_float_flops == 0.2
    with pytest.raises(TypeError, match="bogus"):
        QuantizeConfig(bogus=1)
    with pytest.raises(AttributeError):
        cfg.bogus  # noqa: B018
    with pytest.raises(UserError, match="need --recipe ort"):
        QuantizeConfig(recipe="tensorrt", calib_method="entropy").validate()
