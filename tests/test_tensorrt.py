"""TensorRT deployment: builder settings, trtexec line, GPU checks, clear errors, fusion detector, CLI.

Everything except the last section runs without TensorRT or a GPU. The ``gpu`` tests build a
tiny engine for real and need TensorRT 10 + cuda-python + an NVIDIA GPU (skipped otherwise).
"""

from __future__ import annotations

import builtins
import json
import shlex
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devices import load_profile
from edgeprune.cli.device import build_cmd, devices_cmd
from edgeprune.jobs.build import default_engine_path
from edgeprune.errors import RuntimeFault, UserError
from exporters import tensorrt as trt_exp
from exporters.tensorrt import (atomic_write_bytes, build_engine, builder_settings, onnx_input,
                                read_sidecar, sidecar_path, tensorrt_version)
from exporters.trtexec import trtexec_command
from devices import gpu as gpu_info
from devices.gpu import GpuInfo, check_compute_capability, parse_nvidia_smi, parse_tegra
from runners.tensorrt import TrtRunner, bench_engine, compare_outputs, detect_attention_fusion
from tests.conftest import run_cli

RTX3090 = GpuInfo("NVIDIA GeForce RTX 3090", (8, 6), 24576.0)
RTX3080 = GpuInfo("NVIDIA GeForce RTX 3080", (8, 6), 10240.0)
ORIN = GpuInfo("Orin (nvgpu)", (8, 7), 15656.0)


def invoke_cmd(cmd: Any, args: list[str]) -> Any:
    """Run ``edgeprune <cmd.name> ARGS`` as a user does (through the CLI's one error handler)."""
    return run_cli([cmd.name, *args])


def make_onnx(path: Path, batch: int | str = "batch", chw: tuple[int, int, int] = (3, 8, 8),
              n_inputs: int = 1, classes: int = 10) -> Path:
    """A tiny classifier: Flatten -> MatMul -> Add -> Softmax (no torch needed)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    feat = int(np.prod(chw))
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((feat, classes)).astype(np.float32) * 0.1, "W")
    b = numpy_helper.from_array(np.zeros(classes, np.float32), "B")
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, *chw])]
    if n_inputs == 2:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [batch, 1]))
    nodes = [
        helper.make_node("Flatten", ["input"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "B"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["output"], axis=1),
    ]
    graph = helper.make_graph(nodes, "tiny", inputs,
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, classes])],
                              initializer=[w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture
def tiny_onnx(tmp_path: Path) -> Path:
    return make_onnx(tmp_path / "tiny.onnx")


# ---------------------------------------------------------------------------------------------
# ONNX input + builder settings


def test_onnx_input_reads_name_and_shape(tiny_onnx: Path, tmp_path: Path) -> None:
    assert onnx_input(tiny_onnx) == ("input", ("batch", 3, 8, 8))
    assert onnx_input(make_onnx(tmp_path / "s.onnx", batch=4)) == ("input", (4, 3, 8, 8))


def test_onnx_input_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="ONNX file .* not found"):
        onnx_input(tmp_path / "missing.onnx")
    with pytest.raises(UserError, match="expected exactly one graph input .* found 2: input, mask"):
        onnx_input(make_onnx(tmp_path / "two.onnx", n_inputs=2))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not protobuf at all \x00\xff")
    with pytest.raises(UserError, match="cannot read ONNX file"):
        onnx_input(bad)


def test_builder_settings_dynamic_batch_rtx3090() -> None:
    p = load_profile("rtx3090")
    s = builder_settings(p, ("batch", 3, 224, 224), input_name="input")
    assert s["precision"] == "fp16" and s["fp16"] is True
    assert s["workspace_mib"] == 4096 and s["workspace_bytes"] == 4096 * 2**20
    assert s["builder_optimization_level"] == 3
    assert s["profiling_verbosity"] == "detailed"
    assert s["dynamic_batch"] is True
    assert s["shapes"] == {"min": [1, 3, 224, 224], "opt": [8, 3, 224, 224], "max": [64, 3, 224, 224]}
    assert s["timing_cache"] == str(Path("~/.cache/edgeprune/timing/rtx3090.cache").expanduser())
    assert s["notes"] == []
    json.dumps(s)


def test_builder_settings_orin_and_minus_one_batch() -> None:
    s = builder_settings(load_profile("orin-nx"), (-1, 1, 28, 28))
    assert s["shapes"]["min"] == [1, 1, 28, 28] and s["shapes"]["max"] == [16, 1, 28, 28]
    assert s["workspace_bytes"] == 1024 * 2**20


def test_builder_settings_static_batch_ignores_range_with_a_note() -> None:
    s = builder_settings(load_profile("rtx3090"), (1, 3, 224, 224))
    assert s["dynamic_batch"] is False
    assert s["shapes"] == {k: [1, 3, 224, 224] for k in ("min", "opt", "max")}
    assert "fixed at 1" in s["notes"][0]


def test_builder_settings_fp32_and_timing_cache_override(tmp_path: Path) -> None:
    f = tmp_path / "fp32.toml"
    f.write_text((Path(load_profile("rtx3090").source or "")).read_text().replace('precision = "fp16"', 'precision = "fp32"'))
    s = builder_settings(load_profile(f), ("b", 3, 32, 32), timing_cache=tmp_path / "tc.cache")
    assert s["fp16"] is False and s["precision"] == "fp32"
    assert s["timing_cache"] == str(tmp_path / "tc.cache")


def test_builder_settings_rejects_dynamic_image_dims_and_cpu_profile() -> None:
    with pytest.raises(UserError, match=r"dynamic dimension\(s\) \[2, 3\].*only the batch dimension"):
        builder_settings(load_profile("rtx3090"), ("batch", 3, "h", "w"))
    with pytest.raises(UserError, match="no TensorRT build settings"):
        builder_settings(load_profile("cpu"), ("batch", 3, 224, 224))


# ---------------------------------------------------------------------------------------------
# trtexec


def test_trtexec_command_orin(tiny_onnx: Path) -> None:
    cache = Path("~/.cache/edgeprune/timing/orin-nx.cache").expanduser()
    cmd = trtexec_command(tiny_onnx, "orin-nx", "out/model.engine")
    assert shlex.split(cmd) == [
        "trtexec", f"--onnx={tiny_onnx}", "--saveEngine=out/model.engine", "--fp16",
        "--minShapes=input:1x3x8x8", "--optShapes=input:1x3x8x8", "--maxShapes=input:16x3x8x8",
        "--memPoolSize=workspace:1024M", "--builderOptimizationLevel=3",
        f"--timingCacheFile={cache}", "--profilingVerbosity=detailed",
    ]


def test_trtexec_command_given_shape_static_batch_and_quoting(tmp_path: Path) -> None:
    cmd = trtexec_command(tmp_path / "my model.onnx", load_profile("rtx3090"), tmp_path / "m.engine",
                          input_name="input", input_shape=(1, 3, 224, 224))
    assert "'--onnx=" in cmd  # the space is quoted
    args = shlex.split(cmd)
    assert f"--onnx={tmp_path / 'my model.onnx'}" in args
    assert not any(a.startswith(("--minShapes", "--optShapes", "--maxShapes")) for a in args)
    assert "--memPoolSize=workspace:4096M" in args and "--fp16" in args


def test_trtexec_command_needs_the_onnx_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        trtexec_command(tmp_path / "nope.onnx", "rtx3090", tmp_path / "x.engine")


# ---------------------------------------------------------------------------------------------
# compute capability + GPU probes


def test_compute_capability_match() -> None:
    c = check_compute_capability(load_profile("rtx3090"), RTX3090)
    assert c.matches and c.message == ""
    assert check_compute_capability(load_profile("orin-nx"), ORIN).matches


def test_compute_capability_mismatch_refused() -> None:
    with pytest.raises(UserError) as info:
        check_compute_capability(load_profile("orin-nx"), RTX3090)
    msg = str(info.value)
    assert "targets compute capability 8.7" in msg and "is 8.6" in msg and "--force-device" in msg


def test_compute_capability_mismatch_override() -> None:
    c = check_compute_capability(load_profile("orin-nx"), RTX3090, force=True)
    assert not c.matches and c.message.startswith("warning:") and "--force-device" in c.message


def test_compute_capability_same_cc_other_model_warns() -> None:
    c = check_compute_capability(load_profile("rtx3090"), RTX3080)
    assert c.matches and "RTX 3080" in c.message


def test_compute_capability_no_gpu_and_cpu_profile() -> None:
    with pytest.raises(UserError, match="^no CUDA GPU visible"):
        check_compute_capability(load_profile("rtx3090"), None)
    with pytest.raises(UserError, match="is for onnxruntime, not TensorRT"):
        check_compute_capability(load_profile("cpu"), RTX3090)


def test_parse_nvidia_smi() -> None:
    g = parse_nvidia_smi("NVIDIA GeForce RTX 3090, 8.6, 24576 MiB\nNVIDIA RTX A4000, 8.6, 16376 MiB\n")
    assert g == GpuInfo("NVIDIA GeForce RTX 3090", (8, 6), 24576.0, source="nvidia-smi")
    g1 = parse_nvidia_smi("NVIDIA GeForce RTX 3090, 8.6, 24576 MiB\nNVIDIA RTX A4000, 8.6, 16376 MiB\n", 1)
    assert g1 is not None and g1.name == "NVIDIA RTX A4000"
    assert parse_nvidia_smi("") is None
    assert parse_nvidia_smi("Tesla K80, [N/A], 11441 MiB") is None


def test_parse_tegra_orin() -> None:
    g = parse_tegra(b"nvidia,p3767-0000\x00nvidia,tegra234\x00", "NVIDIA Jetson Orin NX Engineering Reference Developer Kit\x00",
                    "MemTotal:       15656068 kB\nMemFree: 1 kB\n")
    assert g is not None and g.compute_capability == (8, 7) and g.source == "device-tree"
    assert "Orin NX" in g.name and round(g.total_memory_mb) == 15289
    assert parse_tegra(b"raspberrypi,4-model-b\x00", "", "") is None


def test_local_gpu_uses_nvidia_smi_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_info, "_from_cuda_python", lambda i=0: None)
    monkeypatch.setattr(gpu_info, "_from_nvidia_smi", lambda i=0: RTX3090)
    assert gpu_info.local_gpu() == RTX3090
    monkeypatch.setattr(gpu_info, "_from_nvidia_smi", lambda i=0: None)
    monkeypatch.setattr(gpu_info, "_from_device_tree", lambda: None)
    assert gpu_info.local_gpu() is None


# ---------------------------------------------------------------------------------------------
# clear errors when TensorRT / the GPU is missing


def test_tensorrt_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` raise ImportError
    with pytest.raises(UserError) as info:
        tensorrt_version()
    msg = str(info.value)
    assert msg.startswith("TensorRT Python package not found: install TensorRT 10.x (JetPack 6 ships 10.3")
    assert "\n" not in msg


def test_tensorrt_stubs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # `pip install tensorrt-stubs` alone leaves an importable `tensorrt` with no API.
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    with pytest.raises(UserError, match=r"^TensorRT Python package not found \('tensorrt' is only type stubs\)"):
        tensorrt_version()


def test_tensorrt_wrong_major(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tensorrt")
    fake.__version__ = "8.6.1"  # type: ignore[attr-defined]
    fake.Builder = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(UserError, match=r"^TensorRT 8.6.1 found, but edgeprune needs TensorRT 10.x"):
        tensorrt_version()


def test_tensorrt_library_fails_to_load(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "tensorrt":
            raise OSError("libnvinfer.so.10: cannot open shared object file: No such file or directory")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(UserError, match=r"^TensorRT Python package failed to load \(OSError: libnvinfer.so.10"):
        tensorrt_version()


def _fake_trt_present(monkeypatch: pytest.MonkeyPatch, gpu: GpuInfo | None) -> None:
    monkeypatch.setattr(trt_exp, "tensorrt_version", lambda: "10.3.0")
    monkeypatch.setattr(trt_exp, "local_gpu", lambda i=0: gpu)


def test_build_engine_without_tensorrt(monkeypatch: pytest.MonkeyPatch, tiny_onnx: Path, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(RuntimeFault, match="^TensorRT Python package not found"):
        build_engine(tiny_onnx, "rtx3090", tmp_path / "m.engine")
    assert not (tmp_path / "m.engine").exists()


def test_build_engine_without_gpu(monkeypatch: pytest.MonkeyPatch, tiny_onnx: Path, tmp_path: Path) -> None:
    _fake_trt_present(monkeypatch, None)
    with pytest.raises(UserError, match="^no CUDA GPU visible"):
        build_engine(tiny_onnx, "rtx3090", tmp_path / "m.engine")


def test_build_engine_refuses_other_compute_capability(monkeypatch: pytest.MonkeyPatch, tiny_onnx: Path,
                                                       tmp_path: Path) -> None:
    _fake_trt_present(monkeypatch, RTX3090)
    with pytest.raises(UserError, match="targets compute capability 8.7.*--force-device"):
        build_engine(tiny_onnx, "orin-nx", tmp_path / "m.engine")


def test_runner_without_tensorrt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    (tmp_path / "m.engine").write_bytes(b"x")
    with pytest.raises(RuntimeFault, match="^TensorRT Python package not found"):
        TrtRunner(tmp_path / "m.engine")


def test_bench_engine_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="engine file not found"):
        bench_engine(tmp_path / "none.engine", "rtx3090")


def test_bench_engine_rejects_cpu_profile(tmp_path: Path) -> None:
    (tmp_path / "m.engine").write_bytes(b"x")
    with pytest.raises(UserError, match="is for onnxruntime"):
        bench_engine(tmp_path / "m.engine", "cpu")


# ---------------------------------------------------------------------------------------------
# sidecar + atomic writes


def test_atomic_write_and_sidecar(tmp_path: Path) -> None:
    eng = tmp_path / "sub" / "m.engine"
    atomic_write_bytes(eng, b"abc")
    atomic_write_bytes(eng, memoryview(b"abcd"))
    assert eng.read_bytes() == b"abcd"
    assert sorted(p.name for p in eng.parent.iterdir()) == ["m.engine"]  # no temp files left
    assert sidecar_path(eng) == tmp_path / "sub" / "m.engine.json"
    assert read_sidecar(eng) is None
    sidecar_path(eng).write_text(json.dumps({"tensorrt_version": "10.3.0", "engine_bytes": 4}))
    assert read_sidecar(eng) == {"tensorrt_version": "10.3.0", "engine_bytes": 4}
    atomic_write_bytes(eng, b"rebuilt by hand")  # the sidecar no longer describes it
    assert read_sidecar(eng) is None


def test_engine_gpu_mismatch_from_sidecar() -> None:
    from runners.tensorrt.engine import check_engine_matches_gpu

    side = {"gpu": {"name": "NVIDIA GeForce RTX 3090", "compute_capability": "8.6"}, "tensorrt_version": "10.3.0"}
    check_engine_matches_gpu(side, RTX3090, "10.3.0")
    with pytest.raises(UserError, match="built on NVIDIA GeForce RTX 3090 .*8.6.* but this GPU is Orin"):
        check_engine_matches_gpu(side, ORIN, "10.3.0")
    with pytest.raises(UserError, match="built with TensorRT 10.3.0 but TensorRT 10.7.0"):
        check_engine_matches_gpu(side, RTX3090, "10.7.0")


# ---------------------------------------------------------------------------------------------
# attention fusion detector (pure, on engine-inspector JSON samples)

FUSED_TRT10 = {
    "Layers": [
        {"Name": "/patch_embed/proj/Conv", "LayerType": "CaskConvolution", "TacticName": "sm86_xmma_fprop_implicit_gemm"},
        {"Name": "__myl_MulAddCastMeanSubMul_myl0_1", "LayerType": "kgen", "TacticName": "__myl_bb0_1_MulAdd",
         "Metadata": "[ONNX Layer: /blocks.0/norm1/LayerNormalization]"},
        {"Name": "__myl_Fc_myl0_2", "LayerType": "gemm", "TacticName": "sm86_xmma_gemm_f16f16_f16f32",
         "Metadata": "[ONNX Layer: /blocks.0/attn/qkv/MatMul]"},
        {"Name": "_gemm_mha_v2_myl0_3", "LayerType": "gemm", "TacticName": "_gemm_mha_v2",
         "Metadata": "[ONNX Layer: /blocks.0/attn/MatMul] [ONNX Layer: /blocks.0/attn/Softmax]"},
        {"Name": "__myl_Fc_myl0_4", "LayerType": "gemm", "TacticName": "sm86_xmma_gemm_f16f16_f16f32"},
    ],
    "Bindings": ["input", "output"],
}

UNFUSED_TRT10 = {
    "Layers": [
        {"Name": "shuffle_[x11_qk]_first_transpose", "LayerType": "kgen", "TacticName": "__myl_bb1_4_Tra",
         "Metadata": "[MATRIX_MULTIPLY]_[scaled_dot_product_attention]_[x11_qk]"},
        {"Name": "__mye6723_unroll0", "LayerType": "gemm", "TacticName": "sm86_xmma_gemm_f16f16"},
        {"Name": "__myl_ExpSumDivSoftmax_myl0_7", "LayerType": "kgen", "TacticName": "__myl_bb0_7_Softmax"},
        {"Name": "__mye6724_unroll0", "LayerType": "gemm", "TacticName": "sm86_xmma_gemm_f16f16"},
    ],
    "Bindings": ["input", "output"],
}


def test_fusion_detected_trt10_mha_v2() -> None:
    r = detect_attention_fusion(json.dumps(FUSED_TRT10))
    assert r.verdict == "fused" and r.fused and r.detailed
    assert r.fused_layers == ["_gemm_mha_v2_myl0_3"] and r.softmax_layers == []
    assert r.n_layers == 5 and r.myelin_layers == 4
    assert r.summary().startswith("attention fused: 1 fused MHA layer(s)")


def test_unfused_attention_with_sdpa_metadata_is_not_fused() -> None:
    r = detect_attention_fusion(UNFUSED_TRT10)
    assert r.verdict == "unfused" and not r.fused
    assert r.softmax_layers == ["__myl_ExpSumDivSoftmax_myl0_7"]


def test_fusion_partial_and_other_fused_forms() -> None:
    layers = FUSED_TRT10["Layers"] + [{"Name": "/blocks.1/attn/Softmax", "LayerType": "SoftMax", "TacticName": ""}]
    assert detect_attention_fusion({"Layers": layers}).verdict == "partial"
    for layer in ({"Name": "x", "LayerType": "mha", "TacticName": ""},
                  {"Name": "x", "LayerType": "CaskFlashAttention", "TacticName": ""},
                  {"Name": "x", "LayerType": "gemm", "TacticName": "sm86_fmha_v2_flash_attention_fp16_S_64"},
                  {"Name": "x", "LayerType": "PluginV2", "TacticName": "CustomQKVToContextPluginDynamic"}):
        assert detect_attention_fusion({"Layers": [layer]}).verdict == "fused", layer


def test_fusion_names_only_listing() -> None:
    r = detect_attention_fusion({"Layers": ["{ForeignNode[/blocks.0/norm1/...(Unnamed Layer* 900) [Shuffle]]}",
                                            "Reformatting CopyNode for Output Tensor 0"]})
    assert r.verdict == "opaque" and not r.detailed and "DETAILED" in r.summary()
    assert detect_attention_fusion({"Layers": ["/head/MatMul", "/blocks.0/attn/Softmax"]}).verdict == "unfused"


def test_fusion_no_layers_and_bad_input() -> None:
    assert detect_attention_fusion('{"Layers": [], "Bindings": []}').verdict == "unknown"
    with pytest.raises(ValueError):
        detect_attention_fusion('{"Bindings": []}')
    with pytest.raises(ValueError):
        detect_attention_fusion("not json")


# ---------------------------------------------------------------------------------------------
# output comparison (pure)


def test_compare_outputs() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((16, 10)).astype(np.float32) * 5
    fp16 = ref.astype(np.float16).astype(np.float32)
    a = compare_outputs(fp16, ref)
    assert a.agrees and a.top1_agreement == 1.0 and a.max_abs_diff < 1e-2 and a.n_samples == 16
    bad = compare_outputs(ref + 1.0, ref)
    assert not bad.agrees and bad.max_abs_diff == pytest.approx(1.0)
    nan = ref.copy()
    nan[0, 0] = np.nan
    assert not compare_outputs(nan, ref).agrees
    maps = compare_outputs(np.zeros((2, 1, 4, 4)), np.zeros((2, 1, 4, 4)))
    assert maps.top1_agreement is None and maps.agrees
    with pytest.raises(UserError, match="output shape mismatch: TensorRT"):
        compare_outputs(np.zeros((2, 3)), np.zeros((3, 2)))


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_devices_table() -> None:
    res = invoke_cmd(devices_cmd, [])
    assert res.exit_code == 0, res.output
    for name in ("cpu", "orin-nx", "rtx3090"):
        assert f"| {name} " in res.output
    assert "Ampere 8.7" in res.output and "8/16 GB shared" in res.output


def test_cli_devices_one_as_json_and_user_path(tmp_path: Path) -> None:
    res = invoke_cmd(devices_cmd, ["orin-nx"])
    assert res.exit_code == 0 and json.loads(res.output)["compute_capability"] == "8.7"
    bad = tmp_path / "mine.toml"
    bad.write_text((Path(load_profile("orin-nx").source or "")).read_text().replace('"fp16"', '"fp8"'))
    res = invoke_cmd(devices_cmd, [str(bad)])
    assert res.exit_code == 2
    assert res.output.strip() == "error: mine.toml: build.precision must be one of fp16, fp32, int8 (got 'fp8')"


def test_cli_devices_unknown() -> None:
    res = invoke_cmd(devices_cmd, ["tx2"])
    assert res.exit_code == 2 and res.output.startswith("error: unknown device 'tx2'")
    assert "Traceback" not in res.output


def test_cli_build_print_trtexec_only(tiny_onnx: Path) -> None:
    res = invoke_cmd(build_cmd, [str(tiny_onnx), "--device", "rtx3090", "--print-trtexec"])
    assert res.exit_code == 0, res.output
    args = shlex.split(res.output)
    assert args[0] == "trtexec" and f"--saveEngine={default_engine_path(tiny_onnx, 'rtx3090')}" in args
    assert "--maxShapes=input:64x3x8x8" in args


def test_cli_build_without_tensorrt(monkeypatch: pytest.MonkeyPatch, tiny_onnx: Path, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    out = tmp_path / "m.engine"
    res = invoke_cmd(build_cmd, [str(tiny_onnx), "--device", "orin-nx", "-o", str(out)])
    assert res.exit_code == 1  # an environment fault, not a usage error
    assert "trtexec equivalent:" in res.output and "--saveEngine=" in res.output  # always printed
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("error: TensorRT Python package not found: install TensorRT 10.x")
    assert "Traceback" not in res.output and not out.exists()


def test_cli_build_without_gpu(monkeypatch: pytest.MonkeyPatch, tiny_onnx: Path) -> None:
    _fake_trt_present(monkeypatch, None)
    res = invoke_cmd(build_cmd, [str(tiny_onnx), "--device", "rtx3090"])
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1].startswith("error: no CUDA GPU visible")


def test_cli_build_wrong_gpu(monkeypatch: pytest.MonkeyPatch, tiny_onnx: Path) -> None:
    _fake_trt_present(monkeypatch, ORIN)
    res = invoke_cmd(build_cmd, [str(tiny_onnx), "--device", "rtx3090"])
    assert res.exit_code == 2 and "--force-device" in res.output.strip().splitlines()[-1]


@pytest.mark.parametrize("args,message", [
    (["missing.onnx", "--device", "rtx3090"], "error: ONNX file 'missing.onnx' not found"),
    (["{onnx}", "--device", "cpu"], "error: device profile 'cpu' runs onnxruntime, not TensorRT"),
    (["{onnx}", "--device", "nano"], "error: unknown device 'nano'"),
])
def test_cli_build_user_errors(tiny_onnx: Path, args: list[str], message: str) -> None:
    res = invoke_cmd(build_cmd, [a.replace("{onnx}", str(tiny_onnx)) for a in args])
    assert res.exit_code == 2 and res.output.startswith(message), res.output


def test_cli_build_requires_device(tiny_onnx: Path) -> None:
    res = invoke_cmd(build_cmd, [str(tiny_onnx)])
    assert res.exit_code == 2 and "--device" in res.output


def test_commands_registered_in_edgeprune_cli() -> None:
    import click

    main = pytest.importorskip("edgeprune.cli.main")
    groups = [v for v in vars(main).values() if isinstance(v, click.Group)]
    assert groups and {"build", "devices", "bench"} <= set(groups[0].commands)
    assert groups[0].commands["bench"].callback.__module__ == "edgeprune.cli.device"


# ---------------------------------------------------------------------------------------------
# TrtRunner against a simulated TensorRT + CUDA (host memory), to exercise its bookkeeping:
# buffers for the largest batch, staging, output sizes per batch, CUDA-graph capture/replay.


class _FakeCuda:
    name = "fake-cuda"
    supports_graphs = True

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self.bufs: dict[int, Any] = {}
        self.capture: list[Any] | None = None
        self.launches = 0
        self.freed = 0

    def _alloc(self, n: int) -> int:
        buf = (self._ctypes.c_uint8 * max(n, 1))()
        addr = self._ctypes.addressof(buf)
        self.bufs[addr] = buf
        return addr

    malloc = malloc_host = _alloc

    def free(self, ptr: int) -> None:
        del self.bufs[ptr]
        self.freed += 1

    free_host = free

    def version(self) -> str:
        return "0"

    def stream(self) -> str:
        return "stream"

    def stream_handle(self, stream: Any) -> int:
        return 7

    def destroy_stream(self, stream: Any) -> None: ...

    def sync(self, stream: Any) -> None: ...

    def _op(self, fn: Any) -> None:
        if self.capture is not None:
            self.capture.append(fn)
        else:
            fn()

    def htod(self, dst: int, src: int, n: int, stream: Any) -> None:
        self._op(lambda: self._ctypes.memmove(dst, src, n))

    dtoh = htod

    def event(self) -> dict[str, Any]:
        return {}

    def record(self, event: Any, stream: Any) -> None: ...

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return 0.25

    def destroy_event(self, event: Any) -> None: ...

    def mem_used_mb(self) -> float:
        return sum(len(b) for b in self.bufs.values()) / 2**20

    def begin_capture(self, stream: Any) -> None:
        self.capture = []

    def end_capture(self, stream: Any) -> Any:
        ops, self.capture = self.capture, None
        return ("graph", ops)

    def launch_graph(self, graph_exec: Any, stream: Any) -> None:
        self.launches += 1
        for fn in graph_exec:
            fn()

    def destroy_graph(self, graph: Any, graph_exec: Any) -> None: ...


class _FakeContext:
    """output[b, j] = (j + 1) * sum(input[b]); input (B, 2, 3, 3) float32, output (B, 4) float32."""

    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda
        self.shape: tuple[int, ...] = ()
        self.addr: dict[str, int] = {}
        self.executions = 0

    def set_input_shape(self, name: str, dims: Any) -> bool:
        self.shape = tuple(dims)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shape if name == "input" else (self.shape[0], 4)

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addr[name] = ptr
        return True

    def execute_async_v3(self, stream: int) -> bool:
        shape = self.shape

        def run() -> None:
            self.executions += 1
            n = int(np.prod(shape))
            x = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_float * n).from_address(self.addr["input"]))
            y = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_float * (shape[0] * 4)).from_address(self.addr["output"]))
            sums = x.reshape(shape[0], -1).sum(axis=1)
            y[:] = (sums[:, None] * np.arange(1, 5)[None, :]).ravel()

        self.cuda._op(run)
        return True


class _FakeEngine:
    device_memory_size_v2 = 1 << 20
    num_io_tensors = 2

    def __init__(self, cuda: _FakeCuda) -> None:
        self.ctx = _FakeContext(cuda)

    def create_execution_context(self) -> _FakeContext:
        return self.ctx

    def get_tensor_name(self, i: int) -> str:
        return ["input", "output"][i]

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if name == "input" else "OUTPUT"

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (-1, 2, 3, 3) if name == "input" else (-1, 4)

    def get_tensor_profile_shape(self, name: str, i: int) -> list[tuple[int, ...]]:
        return [(1, 2, 3, 3), (2, 2, 3, 3), (6, 2, 3, 3)]

    def get_tensor_dtype(self, name: str) -> str:
        return "float32"


@pytest.fixture
def sim_runner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    import runners.tensorrt.runner as rt

    fake_trt = types.ModuleType("tensorrt")
    fake_trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")  # type: ignore[attr-defined]
    fake_trt.Dims = lambda d: tuple(d)  # type: ignore[attr-defined]
    fake_trt.nptype = lambda t: np.float32  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt)
    monkeypatch.setattr(trt_exp, "tensorrt_version", lambda: "10.3.0")
    monkeypatch.setattr(rt, "tensorrt_version", lambda: "10.3.0")
    monkeypatch.setattr(rt, "require_gpu", lambda i=0: RTX3090)
    cuda = _FakeCuda()
    engine = _FakeEngine(cuda)
    monkeypatch.setattr(rt, "cuda_api", lambda idx: cuda)
    monkeypatch.setattr(rt, "load_engine", lambda p: (None, engine, "10.3.0", None))
    path = tmp_path / "sim.engine"
    path.write_bytes(b"engine")
    sidecar_path(path).write_text(json.dumps({
        "gpu": RTX3090.to_dict(), "tensorrt_version": "10.3.0", "settings": {"precision": "fp16"},
        "profile": {"name": "rtx3090", "bench": {"batch_sizes": [1, 6], "warmup": 2, "iterations": 3,
                                                 "cuda_graphs": True}}}))
    return path, cuda, engine


def _expected(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1).sum(axis=1)[:, None] * np.arange(1, 5)[None, :]


@pytest.mark.parametrize("graphs", [False, True])
def test_simulated_runner_infer_and_time(sim_runner: Any, graphs: bool) -> None:
    path, cuda, engine = sim_runner
    rng = np.random.default_rng(0)
    with TrtRunner(path, cuda_graphs=graphs) as r:
        assert (r.min_batch, r.max_batch, r.input_shape) == (1, 6, (2, 3, 3))
        assert r.label == "sim.engine" and r.device == RTX3090.name and r.precision == "fp16"
        for b in (6, 1, 3):  # largest first, then smaller batches reuse the buffers
            x = rng.standard_normal((b, 2, 3, 3)).astype(np.float32)
            np.testing.assert_allclose(r.infer(x), _expected(x), rtol=1e-5, atol=1e-5)
            r.prepare(x)
            assert r.time_once(x) == 0.25
            assert r.graphs_used is graphs
        x = rng.standard_normal((2, 2, 3, 3)).astype(np.float32)
        r.prepare(x)
        before = engine.ctx.executions
        r.time_once(x)
        assert engine.ctx.executions == before + 1  # the graph replays the engine too
        assert cuda.launches > 0 if graphs else cuda.launches == 0
        with pytest.raises(UserError, match="outside the engine's range 1..6"):
            r.infer(np.zeros((7, 2, 3, 3), np.float32))
        with pytest.raises(UserError, match="does not match the engine's"):
            r.infer(np.zeros((1, 3, 3, 3), np.float32))
    assert cuda.freed == 4 and not cuda.bufs  # device + pinned buffers for input and output


def test_simulated_bench_engine(sim_runner: Any) -> None:
    path, cuda, _engine = sim_runner
    results = bench_engine(path)  # bench settings from the sidecar's profile
    assert [r.batch_size for r in results] == [1, 6]
    r = results[0]
    assert r.backend == "tensorrt" and r.iterations == 3 and r.warmup == 2
    assert r.latency_ms["p50"] == 0.25 and r.throughput == pytest.approx(4000.0)
    assert r.settings["cuda_graphs"] is True and r.settings["profile"] == "rtx3090"
    assert r.settings["engine_device_memory_mb"] == 1.0 and "cudaMemGetInfo" in r.settings["peak_memory_scope"]
    assert r.versions["tensorrt"] == "10.3.0" and r.peak_memory_mb is not None and r.peak_memory_mb >= 0
    res = bench_engine(path, "rtx3090", batch_sizes=[2], iterations=4, warmup=0, cuda_graphs=False)
    assert res[0].iterations == 4 and res[0].settings["cuda_graphs"] is False
    with pytest.raises(UserError, match=r"batch size\(s\) \[8\] outside sim.engine's range 1..6"):
        bench_engine(path, batch_sizes=[1, 8])


def test_simulated_bench_cli_uses_the_engines_profile(sim_runner: Any, tmp_path: Path) -> None:
    from edgeprune.cli.device import bench_cmd

    path, _cuda, _engine = sim_runner
    res = invoke_cmd(bench_cmd, [str(path), "--vs", str(path), "--json", str(tmp_path / "b.json")])
    assert res.exit_code == 0, res.output
    assert "profile: rtx3090" in res.output and "batch sizes 1,6 [profile]" in res.output
    assert "cuda graphs on [profile]" in res.output and "A on tensorrt" in res.output
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [p["batch_size"] for p in doc["results"]] == [1, 6] and doc["config"]["iterations"] == 3
    assert doc["results"][0]["a"]["settings"]["cuda_graphs"] is True
    res = invoke_cmd(bench_cmd, [str(path), "--device", "cpu"])
    assert res.exit_code == 2 and "is a TensorRT engine" in res.output


def test_simulated_runner_refuses_engine_from_other_gpu(sim_runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _cuda, _engine = sim_runner
    monkeypatch.setattr("runners.tensorrt.runner.require_gpu", lambda i=0: ORIN)
    with pytest.raises(UserError, match="rebuild it here"):
        TrtRunner(path)


# ---------------------------------------------------------------------------------------------
# real TensorRT + GPU


def _trt_gpu_skip_reason() -> str | None:
    try:
        tensorrt_version()
    except UserError as err:
        return str(err)
    if gpu_info.local_gpu() is None:
        return "no CUDA GPU visible"
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        try:
            import pycuda  # noqa: F401
        except ImportError:
            return "neither cuda-python nor pycuda installed"
    return None


_SKIP = _trt_gpu_skip_reason()
needs_trt_gpu = pytest.mark.skipif(_SKIP is not None, reason=f"needs TensorRT 10 and a GPU: {_SKIP}")


def _local_profile(tmp_path: Path) -> Path:
    """A profile for whatever GPU this is, with a small batch range."""
    gpu = gpu_info.local_gpu()
    assert gpu is not None
    f = tmp_path / "local.toml"
    f.write_text(f"""
[device]
backend = "tensorrt"
compute_capability = "{gpu.compute_capability_str}"
memory_gb = [{max(1, int(gpu.total_memory_mb // 1024))}]
[build]
precision = "fp16"
workspace_mib = 256
builder_optimization_level = 1
timing_cache = "{tmp_path / 'timing.cache'}"
batch = {{ min = 1, opt = 2, max = 4 }}
[bench]
batch_sizes = [1, 4]
warmup = 3
iterations = 10
cuda_graphs = true
""")
    return f


@pytest.mark.gpu
@needs_trt_gpu
def test_real_build_run_compare_and_bench(tmp_path: Path) -> None:
    from runners.tensorrt import attention_fusion_report, check_against_onnxruntime

    onnx_path = make_onnx(tmp_path / "tiny.onnx")
    profile = _local_profile(tmp_path)
    engine = build_engine(onnx_path, profile, tmp_path / "tiny.engine")
    assert engine.stat().st_size > 0
    side = read_sidecar(engine)
    assert side is not None and side["onnx"]["sha256"] and side["build_time_s"] > 0
    assert side["profile"]["name"] == "local" and (tmp_path / "timing.cache").stat().st_size > 0
    # second build reuses the timing cache
    build_engine(onnx_path, profile, tmp_path / "tiny2.engine")
    assert read_sidecar(tmp_path / "tiny2.engine")["timing_cache_state"] == "reused"  # type: ignore[index]

    x = np.random.default_rng(0).standard_normal((6, 3, 8, 8)).astype(np.float32)
    agreement = check_against_onnxruntime(engine, onnx_path, x)
    assert agreement.agrees and agreement.top1_agreement == 1.0, agreement

    report = attention_fusion_report(engine)
    assert report.detailed and report.n_layers > 0

    results = bench_engine(engine, profile)
    assert [r.batch_size for r in results] == [1, 4]
    for r in results:
        assert r.backend == "tensorrt" and r.latency_ms["p50"] > 0 and r.iterations == 10
        assert r.settings["cuda_graphs"] in (True, False) and r.peak_memory_mb is not None
    with pytest.raises(UserError, match="outside"):
        bench_engine(engine, profile, batch_sizes=[8])


# ---------------------------------------------------------------------------------------------
# INT8: explicit quantization (Q/DQ ONNX -> INT8 + FP16 builder flags), issue 16


def make_qdq_onnx(src: Path, out: Path) -> Path:
    """``src`` quantized by ONNX Runtime's static quantizer (QDQ format, per-channel int8 weights)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.items = iter([{"input": rng.standard_normal((1, 3, 8, 8), dtype=np.float32)} for _ in range(4)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    weight_type=QuantType.QInt8, activation_type=QuantType.QInt8)
    return out


@pytest.fixture
def qdq_onnx(tiny_onnx: Path, tmp_path: Path) -> Path:
    return make_qdq_onnx(tiny_onnx, tmp_path / "tiny.int8.onnx")


def test_onnx_precision_detects_qdq_fp16_and_qoperator(tiny_onnx: Path, qdq_onnx: Path, tmp_path: Path) -> None:
    import onnx
    from onnx import helper, numpy_helper

    from exporters.tensorrt_settings import onnx_precision

    assert onnx_precision(tiny_onnx) == "fp32"
    assert onnx_precision(qdq_onnx) == "int8"
    m = onnx.load(str(tiny_onnx))
    w = numpy_helper.to_array(m.graph.initializer[0]).astype(np.float16)
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, m.graph.initializer[0].name))
    onnx.save(m, str(tmp_path / "half.onnx"))
    assert onnx_precision(tmp_path / "half.onnx") == "fp16"
    m = onnx.load(str(tiny_onnx))
    m.graph.node.append(helper.make_node("MatMulInteger", ["a", "b"], ["c"]))
    onnx.save(m, str(tmp_path / "qop.onnx"))
    with pytest.raises(UserError, match="QOperator format .*MatMulInteger.*QDQ"):
        onnx_precision(tmp_path / "qop.onnx")


def test_builder_settings_int8_needs_qdq_and_sets_both_flags() -> None:
    p = load_profile("rtx3090")
    s = builder_settings(p, ("batch", 3, 8, 8), precision="int8", model_precision="int8")
    assert s["precision"] == "int8" and s["int8"] is True and s["fp16"] is True and s["explicit_quantization"]
    with pytest.raises(UserError, match=r"no Q/DQ nodes .*edgeprune quantize .*--precision int8"):
        builder_settings(p, ("batch", 3, 8, 8), precision="int8", model_precision="fp32")
    # a Q/DQ model under the fp16 profile still builds INT8 (explicit quantization), with a note
    s = builder_settings(p, ("batch", 3, 8, 8), model_precision="int8")
    assert s["int8"] and s["fp16"] and any("Q/DQ" in n for n in s["notes"])
    s = builder_settings(p, ("batch", 3, 8, 8))
    assert s["int8"] is False and s["explicit_quantization"] is False
    with pytest.raises(UserError, match="unknown precision 'int4'"):
        builder_settings(p, ("batch", 3, 8, 8), precision="int4")


def test_trtexec_and_build_cli_for_a_qdq_model(tiny_onnx: Path, qdq_onnx: Path) -> None:
    args = shlex.split(trtexec_command(qdq_onnx, "orin-nx", "m.engine"))
    assert "--int8" in args and "--fp16" in args
    assert "--int8" not in shlex.split(trtexec_command(tiny_onnx, "orin-nx", "m.engine"))
    res = invoke_cmd(build_cmd, [str(qdq_onnx), "--device", "orin-nx", "--precision", "int8", "--print-trtexec"])
    assert res.exit_code == 0 and "--int8" in shlex.split(res.output), res.output
    res = invoke_cmd(build_cmd, [str(tiny_onnx), "--device", "orin-nx", "--precision", "int8", "--print-trtexec"])
    assert res.exit_code == 2 and "edgeprune quantize" in res.output and "Traceback" not in res.output


def test_apply_settings_sets_the_int8_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tensorrt")
    fake.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")  # type: ignore[attr-defined]
    fake.BuilderFlag = types.SimpleNamespace(FP16="FP16", INT8="INT8")  # type: ignore[attr-defined]
    fake.ProfilingVerbosity = types.SimpleNamespace(DETAILED="DETAILED")  # type: ignore[attr-defined]
    fake.Dims = lambda d: tuple(d)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", fake)

    class Config:
        def __init__(self) -> None:
            self.flags: list[str] = []
            self.profiles: list[Any] = []

        def set_memory_pool_limit(self, pool: str, size: int) -> None: ...

        def set_flag(self, flag: str) -> None:
            self.flags.append(flag)

        def add_optimization_profile(self, p: Any) -> None:
            self.profiles.append(p)

    class Profile:
        def set_shape(self, *a: Any) -> None:
            self.shapes = a

    builder = types.SimpleNamespace(create_optimization_profile=Profile)
    network = types.SimpleNamespace(num_inputs=1, get_input=lambda i: types.SimpleNamespace(name="input", shape=(-1, 3, 8, 8)))
    p = load_profile("rtx3090")
    for model_precision, flags in (("int8", ["FP16", "INT8"]), ("fp32", ["FP16"])):
        cfg = Config()
        trt_exp.apply_settings(cfg, builder, network,  # type: ignore[arg-type]
                               builder_settings(p, ("batch", 3, 8, 8), model_precision=model_precision))
        assert cfg.flags == flags and len(cfg.profiles) == 1
