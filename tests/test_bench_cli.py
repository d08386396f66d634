"""``edgeprune bench``: one bench path driven by a device profile (runners/bench.py, edgeprune/cli/device.py).

Defect 2 of issue 12: bench used to ignore ``--device`` profiles (``--device orin-nx`` silently
benched the host CPU with default settings). These tests pin that the profile's settings are
applied (in the report and in what the runner is asked), that explicit options override them,
and that a profile whose backend is missing here is a one-line error with exit status 1.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgeprune.errors import RuntimeFault, UserError
from exporters.onnx import export_onnx
from runners.base import Runner
from runners.bench import BenchConfig, resolve_config, run_bench

from tests.conftest import assert_one_line_error, run_cli

SHAPE = (1, 28, 28)


def invoke(*args: Any) -> Any:
    """``edgeprune bench ...`` (``args`` starts with ``"bench"``) as a user runs it."""
    assert str(args[0]) == "bench"
    return run_cli(list(args))


def assert_error(result: Any, pattern: str, code: int = 2) -> None:
    """Non-zero exit, exactly one line on stderr, no traceback."""
    assert_one_line_error(result, pattern, code)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Dense and pruned fmnist-vit ONNX files and the pruned run directory."""
    from edgeprune.api import prune
    from edgeprune.artifact import save_run
    from edgeprune.zoo.registry import get_model_spec

    d = tmp_path_factory.mktemp("bench")
    spec = get_model_spec("fmnist-vit", random_init=True)
    torch.manual_seed(0)
    model = spec.create(pretrained=False)
    export_onnx(model, d / "dense.onnx", SHAPE, {"method": "dense"})
    res = prune(model, torch.randn(16, *SHAPE), target="both", sparsity=0.5, spec=spec)
    save_run(d / "run", res.model, res.record)
    export_onnx(res.model, d / "pruned.onnx", SHAPE, {"method": "pruned"})
    return d


@pytest.fixture(scope="module")
def qdq_onnx(work) -> Path:
    """The dense model quantized by ONNX Runtime (QDQ, per-channel int8 weights)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.items = iter([{"input": rng.standard_normal((1, *SHAPE), dtype=np.float32)} for _ in range(4)])

        def get_next(self) -> dict | None:
            return next(self.items, None)

    out = work / "dense.int8.onnx"
    quantize_static(str(work / "dense.onnx"), str(out), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, weight_type=QuantType.QInt8, activation_type=QuantType.QInt8)
    return out


def _profile(tmp_path: Path, *, threads: int = 2, batch_sizes: str = "[2, 3]", warmup: int = 1,
             iterations: int = 7, precision: str = "fp32") -> Path:
    f = tmp_path / "box.toml"
    f.write_text(f"""
[device]
backend = "onnxruntime"
[onnxruntime]
threads = {threads}
precision = "{precision}"
[bench]
batch_sizes = {batch_sizes}
warmup = {warmup}
iterations = {iterations}
""")
    return f


class Recorder(Runner):
    """Stands in for OrtRunner: records what it was asked, times nothing."""

    backend = "onnxruntime"
    calls: list[dict[str, Any]] = []

    def __init__(self, path: Any, *, providers: Any = None, threads: int | None = None, label: str | None = None,
                 **_: Any) -> None:
        self.label = label or Path(path).name
        self.input_shape = SHAPE
        Recorder.calls.append({"init": {"providers": providers, "threads": threads}, "timed": {}, "warm": {}})

    def benchmark(self, batch_sizes, iterations=50, warmup=10, inputs=None, seed=0):  # type: ignore[override]
        Recorder.calls[-1]["benchmark"] = {"batch_sizes": list(batch_sizes), "iterations": iterations,
                                           "warmup": warmup}
        return super().benchmark(batch_sizes, iterations, warmup, inputs, seed)

    def infer(self, x: np.ndarray) -> np.ndarray:
        return np.zeros((x.shape[0], 10), np.float32)

    def time_once(self, x: np.ndarray) -> float:
        n = Recorder.calls[-1]["timed"]
        n[x.shape[0]] = n.get(x.shape[0], 0) + 1
        return 1.0


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch):
    import runners.onnxruntime_runner as ortr

    Recorder.calls = []
    monkeypatch.setattr(ortr, "OrtRunner", Recorder)
    return Recorder.calls


# ---------------------------------------------------------------------------------------------
# backends are a registry: a new one is one class + one registration


def test_a_backend_registered_in_the_test_is_benched_and_reported(work, monkeypatch):
    """A toy backend (one class, one registration) runs through the public bench path: bench asks
    the registry, not a chain of backend names, for the runner and for what the backend refuses."""
    from runners import registry

    monkeypatch.setattr(registry, "BACKENDS", registry.BACKENDS.copy())

    @registry.register_backend("toy")
    class ToyBackend(registry.Backend):
        kinds = ("onnx",)
        precisions = ("fp32",)

        def create(self, target, path, kind, opts):
            runner = Recorder(path, threads=opts.threads, label=f"toy:{path.name}")
            runner.backend = "toy"
            return runner

    Recorder.calls = []
    target = str(work / "dense.onnx")
    cfg, prof = resolve_config("cpu", backend="toy", batch_sizes=(2, 3), iterations=4, warmup=1, threads=1)
    report = run_bench(target, None, cfg, prof)
    assert report.targets["a"]["backend"] == "toy" and "A on toy" in report.header()
    (call,) = Recorder.calls  # built once by the toy backend, with the options bench passed
    assert call["init"] == {"providers": None, "threads": 1} and call["timed"] == {2: 5, 3: 5}  # 1 + 4
    assert call["benchmark"] == {"batch_sizes": [2, 3], "iterations": 4, "warmup": 1}
    assert [(r.model, r.backend, r.batch_size) for r in report.results] == [
        ("toy:dense.onnx", "toy", 2), ("toy:dense.onnx", "toy", 3)]
    assert "| toy:dense.onnx | toy |" in report.markdown()
    cfg16, _ = resolve_config("cpu", backend="toy", precision="fp16")
    with pytest.raises(UserError, match=r"runs on toy \(use fp32\)"):
        run_bench(target, None, cfg16, prof)
    with pytest.raises(UserError, match="the toy backend cannot run it"):
        run_bench("fmnist-vit", None, cfg, prof)


# ---------------------------------------------------------------------------------------------
# the profile drives the bench (defect 2)


def test_cpu_profile_settings_reach_the_runner(work, tmp_path, recorder):
    prof = _profile(tmp_path)
    r = invoke("bench", work / "dense.onnx", "--device", prof, "--json", tmp_path / "b.json",
               "--markdown", tmp_path / "b.md")
    assert r.exit_code == 0, r.output
    md = (tmp_path / "b.md").read_text()
    assert md.startswith("profile: box (") and "batch sizes 2,3 [profile]" in md and "| dense.onnx |" in md
    (call,) = recorder
    assert call["init"]["threads"] == 2
    assert call["benchmark"] == {"batch_sizes": [2, 3], "iterations": 7, "warmup": 1}
    assert call["timed"] == {2: 8, 3: 8}  # warm-up + timed, per batch size
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["profile"]["name"] == "box" and doc["config"]["profile"] == "box"
    assert doc["config"]["batch_sizes"] == [2, 3] and doc["config"]["threads"] == 2
    assert doc["config"]["sources"]["iterations"] == "profile"
    assert [x["batch_size"] for x in doc["results"]] == [2, 3]
    assert all(x["iterations"] == 7 and x["warmup"] == 1 for x in doc["results"])
    assert "profile: box" in r.stdout and "threads 2 [profile]" in r.stdout


def test_options_override_the_profile_and_say_so(work, tmp_path, recorder):
    prof = _profile(tmp_path)
    r = invoke("bench", work / "dense.onnx", "--device", prof, "--threads", "1", "--iterations", "3",
               "--batch-sizes", "4")
    assert r.exit_code == 0, r.output
    assert recorder[0]["init"]["threads"] == 1
    assert recorder[0]["benchmark"] == {"batch_sizes": [4], "iterations": 3, "warmup": 1}
    assert "threads 1 [option]" in r.stdout and "iterations 3 [option]" in r.stdout
    assert "warmup 1 [profile]" in r.stdout


def test_shipped_cpu_profile_is_the_default(work, recorder):
    r = invoke("bench", work / "dense.onnx")
    assert r.exit_code == 0, r.output
    from devices import load_profile

    cpu = load_profile("cpu")
    assert recorder[0]["benchmark"] == {"batch_sizes": list(cpu.bench.batch_sizes),
                                        "iterations": cpu.bench.iterations, "warmup": cpu.bench.warmup}
    assert r.stdout.startswith("profile: cpu")


def test_tensorrt_profile_without_tensorrt_is_one_line_exit_1(work, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    r = invoke("bench", work / "dense.onnx", "--device", "orin-nx")
    assert_error(r, "profile orin-nx needs TensorRT, which is not installed", code=1)
    assert "--device cpu" in r.stderr and "|" not in r.stdout  # nothing was benchmarked
    # an engine that could not be built here: the missing TensorRT is named, not the missing file
    r = invoke("bench", work / "never-built.engine", "--device", "orin-nx")
    assert_error(r, "profile orin-nx needs TensorRT, which is not installed", code=1)


def test_tensorrt_profile_with_only_the_stubs_is_refused(work, monkeypatch):
    stub = types.ModuleType("tensorrt")  # what `pip install tensorrt-stubs` leaves importable
    monkeypatch.setitem(sys.modules, "tensorrt", stub)
    with pytest.raises(RuntimeFault, match="needs TensorRT"):
        cfg, prof = resolve_config("rtx3090")
        run_bench(str(work / "dense.onnx"), None, cfg, prof)


def test_backend_choices_under_profiles(work):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        # ONNX Runtime on a GPU profile runs on its GPU, never silently on the CPU
        r = invoke("bench", work / "dense.onnx", "--device", "orin-nx", "--backend", "onnxruntime")
        assert_error(r, "provider 'cuda' is not available", code=1)
    assert_error(invoke("bench", work / "dense.onnx", "--backend", "tensorrt"),
                 "needs a TensorRT device profile")


def test_cuda_graphs_need_tensorrt(work):
    assert_error(invoke("bench", work / "dense.onnx", "--cuda-graphs"), "CUDA graphs need TensorRT")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_torch_precisions_refused_cleanly_without_cuda(work):
    r = invoke("bench", "fmnist-vit", "--random-init", "--precision", "fp16", "--iterations", "1")
    assert_error(r, "precision fp16 needs a CUDA GPU", code=1)
    r = invoke("bench", "fmnist-vit", "--random-init", "--cuda-graphs", "--iterations", "1")
    assert_error(r, "CUDA graphs need a CUDA GPU", code=1)
    assert_error(invoke("bench", work / "dense.onnx", "--precision", "tf32"), "is for the torch runner")
    assert_error(invoke("bench", "fmnist-vit", "--random-init", "--precision", "int8"), "edgeprune quantize")


# ---------------------------------------------------------------------------------------------
# quantized ONNX files


def test_bench_accepts_a_qdq_model_and_int8(qdq_onnx, work, tmp_path):
    r = invoke("bench", qdq_onnx, "--vs", work / "dense.onnx", "--precision", "int8", "--batch-sizes", "1",
               "--iterations", "2", "--warmup", "0", "--threads", "1", "--json", tmp_path / "q.json")
    # B (fp32) under --precision int8 is refused: int8 asks for Q/DQ files
    assert_error(r, "has no Q/DQ nodes")
    assert "edgeprune quantize" in r.stderr
    r = invoke("bench", qdq_onnx, "--precision", "int8", "--batch-sizes", "1", "--iterations", "2",
               "--warmup", "0", "--threads", "1", "--json", tmp_path / "q.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "q.json").read_text())
    assert doc["targets"]["a"]["model_precision"] == "int8" and doc["config"]["precision"] == "int8"
    # without --precision the cpu profile (fp32) runs the quantized file as-is
    r = invoke("bench", qdq_onnx, "--vs", work / "dense.onnx", "--batch-sizes", "1", "--iterations", "2",
               "--warmup", "0", "--threads", "1")
    assert r.exit_code == 0, r.output
    assert "(int8)" in r.stdout and "(fp32)" in r.stdout


# ---------------------------------------------------------------------------------------------
# BenchConfig


def test_bench_config_validates_once():
    cfg = BenchConfig(profile="cpu", batch_sizes=[1, 8])  # type: ignore[arg-type]
    assert cfg.batch_sizes == (1, 8)
    assert dataclasses.asdict(cfg)["batch_sizes"] == (1, 8)
    for bad, msg in ((dict(batch_sizes=()), "batch sizes"), (dict(batch_sizes=(0,)), "batch sizes"),
                     (dict(iterations=0), "iterations"), (dict(warmup=-1), "warmup"),
                     (dict(threads=0), "threads"), (dict(precision="fp8"), "precision"),
                     (dict(backend="tvm"), "unknown backend")):
        with pytest.raises(UserError, match=msg):
            BenchConfig(profile="cpu", **bad)  # type: ignore[arg-type]


def test_resolve_config_sources():
    cfg, prof = resolve_config("cpu", iterations=3, threads=None)
    assert prof.name == "cpu" and cfg.iterations == 3 and cfg.sources["iterations"] == "option"
    assert cfg.warmup == prof.bench.warmup and cfg.sources["warmup"] == "profile"
    cfg, prof = resolve_config("orin-nx")
    assert cfg.cuda_graphs is True and cfg.precision == "fp16" and cfg.batch_sizes == (1, 4, 16)
    with pytest.raises(UserError, match="unknown device 'nano'"):
        resolve_config("nano")


# ---------------------------------------------------------------------------------------------
# moved from tests/test_cli_deploy.py (real ONNX Runtime / torch runs, tiny iteration counts)


def test_bench_pair_table_json_plot(work, tmp_path):
    d = work
    r = invoke("bench", d / "dense.onnx", "--vs", d / "pruned.onnx", "--batch-sizes", "1,2",
               "--iterations", "4", "--warmup", "1", "--threads", "1",
               "--json", tmp_path / "b.json", "--plot", tmp_path / "b.png")
    assert r.exit_code == 0, r.output
    assert "latency A/B" in r.stdout and "throughput B/A" in r.stdout
    assert "| dense.onnx | onnxruntime | cpu | 2 |" in r.stdout
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [p["batch_size"] for p in doc["results"]] == [1, 2]
    assert doc["results"][0]["a"]["settings"]["intra_op_threads"] == 1
    assert doc["results"][0]["a"]["settings"]["bench_profile"] == "cpu"
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_single_and_torch_backend(work):
    d = work
    r = invoke("bench", d / "pruned.onnx", "--batch-sizes", "2", "--iterations", "3", "--warmup", "0")
    assert r.exit_code == 0, r.output
    assert "| pruned.onnx | onnxruntime | cpu | 2 |" in r.stdout
    r2 = invoke("bench", "fmnist-vit", "--vs", d / "run", "--backend", "torch", "--random-init",
                "--batch-sizes", "1", "--iterations", "3", "--warmup", "0", "--threads", "1")
    assert r2.exit_code == 0, r2.output
    assert "| run | torch | cpu | 1 |" in r2.stdout


def test_bench_user_errors(work, tmp_path):
    d = work
    assert_error(invoke("bench", tmp_path / "missing.onnx"), "not found")
    bad = tmp_path / "bad.onnx"
    bad.write_text("garbage")
    assert_error(invoke("bench", bad), "cannot")
    assert_error(invoke("bench", d / "dense.onnx", "--provider", "no_such_provider"), "not available")
    assert_error(invoke("bench", d / "dense.onnx", "--backend", "torch"), "ONNX file")
    assert_error(invoke("bench", d / "run", "--backend", "onnxruntime"), "export it first")
    assert_error(invoke("bench", tmp_path / "model.engine"), "TensorRT engine file not found")
    (tmp_path / "m.engine").write_bytes(b"x")
    assert_error(invoke("bench", tmp_path / "m.engine", "--device", "cpu"), "is a TensorRT engine")
    assert_error(invoke("bench", d / "dense.onnx", "--device", "nano"), "unknown device 'nano'")
    r = invoke("bench", d / "dense.onnx", "--batch-sizes", "1,x")
    assert r.exit_code == 2 and "comma-separated integers" in r.output


def test_each_backend_reads_an_onnx_precision_as_it_runs_it(tmp_path):
    """A dynamically quantized ONNX is int8 to ONNX Runtime, and refused by the TensorRT backend
    (TensorRT cannot build DynamicQuantizeLinear): each backend reads the file its own way."""
    import onnx
    from onnx import TensorProto, helper

    from runners.registry import get_backend

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    outs = [helper.make_tensor_value_info(n, t, s) for n, t, s in
            (("y", TensorProto.UINT8, [2, 4]), ("scale", TensorProto.FLOAT, []), ("zp", TensorProto.UINT8, []))]
    graph = helper.make_graph([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zp"])], "g", [x], outs)
    path = tmp_path / "dynamic.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert get_backend("onnxruntime").bench_model_precision(str(path), "onnx") == "int8"
    with pytest.raises(UserError, match="dynamically quantized"):
        get_backend("tensorrt").bench_model_precision(str(path), "onnx")
    assert get_backend("tensorrt").bench_model_precision(str(path), "engine") is None
