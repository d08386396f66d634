"""Runners (torch, ONNX Runtime), interleaved A/B comparison and reports. No timing asserts."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from edgeprune.errors import UserError
from edgeprune.zoo.fmnist_vit import create_fmnist_vit
from exporters.onnx import export_onnx
from runners.base import BenchResult, Runner, make_batch, peak_rss_mb, summarize_latencies
from runners.compare import PairResult, bench_pair, median_interval, ratio_settled, ratio_stats
from runners.onnxruntime_runner import OrtRunner, resolve_providers
from runners.report import markdown_table, pair_markdown_table, plot_latency, to_json
from runners.torch_runner import TorchRunner

SHAPE = (1, 28, 28)


def _fmnist(seed: int = 0):
    torch.manual_seed(seed)
    return create_fmnist_vit(pretrained=False)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    model = _fmnist()
    return export_onnx(model, tmp_path_factory.mktemp("r") / "fm.onnx", SHAPE, {"method": "dense"}), model


def _assert_sane(r: BenchResult, batch_size: int, iterations: int) -> None:
    lat = r.latency_ms
    assert r.batch_size == batch_size and r.iterations == iterations
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert lat["min"] <= lat["mean"] <= lat["max"] and lat["std"] >= 0
    assert r.throughput == pytest.approx(batch_size * 1000.0 / lat["mean"], rel=1e-9)
    assert r.peak_memory_mb is not None and r.peak_memory_mb > 0
    json.dumps(r.to_dict())  # serialisable


# ---------------------------------------------------------------------------------------------
# ONNX Runtime


def test_ort_runner_benchmark(onnx_file):
    path, _ = onnx_file
    runner = OrtRunner(path, threads=1)
    results = runner.benchmark([1, 4], iterations=8, warmup=2)
    assert [r.batch_size for r in results] == [1, 4]
    for r, bs in zip(results, [1, 4]):
        _assert_sane(r, bs, 8)
        assert r.backend == "onnxruntime" and r.device == "cpu" and r.model == "fm.onnx"
        assert r.settings["providers"] == ["CPUExecutionProvider"]
        assert r.settings["intra_op_threads"] == 1 and r.warmup == 2
        assert r.versions["onnxruntime"] == ort.__version__
    assert runner.input_shape == SHAPE and runner.fixed_batch is None


def test_ort_runner_infer_matches_torch(onnx_file):
    path, model = onnx_file
    runner = OrtRunner(path)
    x = make_batch(SHAPE, 3, seed=1)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    assert np.abs(runner.infer(x) - ref).max() <= 1e-4
    with pytest.raises(UserError, match="takes"):
        runner.infer(np.zeros((1, 3, 28, 28), np.float32))


def test_ort_provider_errors(onnx_file, tmp_path):
    path, _ = onnx_file
    available = ort.get_available_providers()
    for alias, full in (("cuda", "CUDAExecutionProvider"), ("tensorrt", "TensorrtExecutionProvider")):
        if full not in available:
            with pytest.raises(UserError, match="not available"):
                OrtRunner(path, providers=alias)
    with pytest.raises(UserError, match="not available"):
        resolve_providers(["NoSuchExecutionProvider"])
    assert resolve_providers("cpu") == ["CPUExecutionProvider"]
    with pytest.raises(UserError, match="not found"):
        OrtRunner(tmp_path / "missing.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_text("garbage")
    with pytest.raises(UserError, match="cannot load"):
        OrtRunner(bad)
    with pytest.raises(UserError, match="threads"):
        OrtRunner(path, threads=0)


# ---------------------------------------------------------------------------------------------
# torch


def test_torch_runner_benchmark():
    model = _fmnist()
    runner = TorchRunner(model, threads=1, label="fmnist", input_shape=SHAPE)
    results = runner.benchmark([1, 2], iterations=6, warmup=1)
    for r, bs in zip(results, [1, 2]):
        _assert_sane(r, bs, 6)
        assert r.backend == "torch" and r.device == "cpu" and r.model == "fmnist"
        assert r.settings["threads"] == 1 and r.settings["timing"] == "perf_counter"
        assert r.versions["torch"] == torch.__version__
    x = make_batch(SHAPE, 2, seed=3)
    with torch.no_grad():
        assert np.allclose(runner.infer(x), model(torch.from_numpy(x)).numpy())


def test_torch_runner_errors():
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA"):
            TorchRunner(_fmnist(), device="cuda")
    with pytest.raises(UserError, match="threads"):
        TorchRunner(_fmnist(), threads=0)
    runner = TorchRunner(_fmnist())  # no input shape known
    with pytest.raises(ValueError, match="input shape"):
        runner.benchmark([1], iterations=1, warmup=0)


def test_make_batch_and_peak_rss():
    x = make_batch(SHAPE, 5, inputs=torch.arange(2 * 28 * 28, dtype=torch.float32).reshape(2, 1, 28, 28))
    assert x.shape == (5, 1, 28, 28) and x.dtype == np.float32
    assert np.array_equal(x[0], x[2]) and np.array_equal(x[1], x[3])
    a, b = make_batch(SHAPE, 2, seed=7), make_batch(SHAPE, 2, seed=7)
    assert np.array_equal(a, b)
    assert peak_rss_mb() > 0


# ---------------------------------------------------------------------------------------------
# interleaved comparison


class FakeRunner(Runner):
    """Returns fixed latencies and records every call in a shared log."""

    backend = "fake"

    def __init__(self, name: str, latency: float, log: list, shape=SHAPE):
        self.label, self.latency, self.log, self.input_shape = name, latency, log, shape
        self.inputs: list[np.ndarray] = []

    def infer(self, x):
        return np.zeros((x.shape[0], 10), np.float32)

    def time_once(self, x):
        self.log.append(self.label)
        self.inputs.append(x)
        return self.latency

    def peak_memory_mb(self):
        return 1.0


def test_bench_pair_interleaves_on_the_same_input():
    log: list[str] = []
    a, b = FakeRunner("A", 2.0, log), FakeRunner("B", 1.0, log)
    pairs = bench_pair(a, b, [1, 3], iterations=4, warmup=2)
    # per batch size: 2 warm-up pairs + 4 timed pairs, strictly alternating
    assert log == ["A", "B"] * (6 * 2)
    for x_a, x_b in zip(a.inputs, b.inputs):
        assert x_a is x_b
    assert [x.shape[0] for x in a.inputs] == [1] * 6 + [3] * 6
    assert [p.batch_size for p in pairs] == [1, 3]
    p = pairs[1]
    assert isinstance(p, PairResult) and p.a.model == "A" and p.b.model == "B"
    assert p.a.iterations == 4 and p.a.warmup == 2 and p.a.settings["interleaved"]
    assert p.latency_ratio == {"median": 2.0, "p10": 2.0, "p90": 2.0, "mean": 2.0}
    assert p.throughput_ratio == pytest.approx(2.0)
    assert p.a.throughput == pytest.approx(3 * 1000 / 2.0)
    assert len(p.latencies_a) == len(p.latencies_b) == 4


def test_bench_pair_rejects_different_inputs():
    log: list[str] = []
    with pytest.raises(UserError, match="different inputs"):
        bench_pair(FakeRunner("A", 1, log), FakeRunner("B", 1, log, (3, 224, 224)), [1], 1, 0)


def test_ratio_stats_are_per_pair():
    # A/B per pair: 2, 2, 2, 10 -> median 2 (a ratio of medians/means would differ)
    st = ratio_stats([2, 4, 6, 50], [1, 2, 3, 5])
    assert st["median"] == pytest.approx(2.0)
    assert st["p10"] == pytest.approx(2.0) and st["p90"] > 2.0
    with pytest.raises(ValueError):
        ratio_stats([1, 2], [1])


class NoisyRunner(FakeRunner):
    """Latencies from a fixed list, one per call (warm-up included)."""

    def __init__(self, name, latencies, log):
        super().__init__(name, 0.0, log)
        self.seq = list(latencies)

    def time_once(self, x):
        super().time_once(x)
        return self.seq.pop(0)


def test_median_interval_is_the_sign_test_interval():
    """issue 40: the order statistics of the textbook table (n = 20: x_(6)..x_(15); n = 9: x_(2)..x_(8);
    below 6 values, and n = 6..8, the whole range at 95%), and the binomial rule behind them."""
    import math
    x = list(range(1, 21))[::-1]  # unsorted on purpose
    assert median_interval(x) == (6, 15)
    assert median_interval(range(1, 10)) == (2, 8)
    for n in (1, 5, 6, 8):
        assert median_interval(range(1, n + 1)) == (1, n)
    for n in range(6, 60):
        lo, hi = median_interval(range(1, n + 1))
        k = int(lo)
        assert hi == n + 1 - k
        tail = sum(math.comb(n, j) for j in range(k)) / 2 ** n  # P(B < k) <= 2.5% < P(B < k + 1)
        assert tail <= 0.025 < tail + math.comb(n, k) / 2 ** n
    assert median_interval([3.0, 1.0, 2.0], confidence=0.5) == (1.0, 3.0)
    with pytest.raises(ValueError):
        median_interval([])
    with pytest.raises(ValueError):
        median_interval([1.0], confidence=1.0)


def test_bench_pair_stops_once_the_ratio_has_settled():
    """issue 40: with a stop rule, timing ends at the first pair where it holds -- steady ratios after
    ``min_pairs``, noisy ones only at ``iterations``; the result covers the pairs timed."""
    log: list[str] = []
    pairs = bench_pair(FakeRunner("A", 2.0, log), FakeRunner("B", 1.0, log), [1], iterations=20, warmup=1,
                       stop=ratio_settled(0.02, min_pairs=6))
    assert len(pairs[0].latencies_a) == 6 and len(log) == 2 * 7 and pairs[0].a.iterations == 6
    # +-5% noise on B: never settles to 2% -> all 20 pairs
    noisy_b = [1.0] + [1.0 + (0.05 if i % 2 else -0.05) for i in range(20)]
    log = []
    pairs = bench_pair(FakeRunner("A", 2.0, log), NoisyRunner("B", noisy_b, log), [1], iterations=20, warmup=1,
                       stop=ratio_settled(0.02, min_pairs=6))
    assert len(pairs[0].latencies_b) == 20
    # noise of +-0.4% settles at min_pairs; one outlier in 7 pairs is outside the 95% interval's order statistics
    # only from n = 9 on (x_(2)..x_(8)): it settles at the 9th pair, not before
    b = [1.0] + [1.0, 1.004, 0.996, 1.5, 1.0, 1.004, 0.996, 1.002, 1.0, 1.0]
    log = []
    pairs = bench_pair(FakeRunner("A", 2.0, log), NoisyRunner("B", b, log), [1], iterations=20, warmup=1,
                       stop=ratio_settled(0.02, min_pairs=6))
    assert len(pairs[0].latencies_b) == 9
    with pytest.raises(ValueError):
        ratio_settled(0.0)
    with pytest.raises(ValueError):
        ratio_settled(0.02, min_pairs=1)


def test_bench_pair_real_runners(onnx_file):
    path, model = onnx_file
    pairs = bench_pair(OrtRunner(path, threads=1), TorchRunner(model, threads=1, input_shape=SHAPE),
                       [2], iterations=5, warmup=1)
    p = pairs[0]
    _assert_sane(p.a, 2, 5)
    _assert_sane(p.b, 2, 5)
    assert p.latency_ratio["p10"] <= p.latency_ratio["median"] <= p.latency_ratio["p90"]
    assert p.throughput_ratio == pytest.approx(p.b.throughput / p.a.throughput)


# ---------------------------------------------------------------------------------------------
# reports


def _result(model: str, bs: int, lat: list[float]) -> BenchResult:
    s = summarize_latencies(lat)
    return BenchResult(model=model, backend="onnxruntime", device="cpu", batch_size=bs,
                       iterations=len(lat), warmup=1, latency_ms=s, throughput=bs * 1000 / s["mean"],
                       peak_memory_mb=100.0)


def test_reports(tmp_path):
    log: list[str] = []
    pairs = bench_pair(FakeRunner("dense.onnx", 4.0, log), FakeRunner("pruned.onnx", 2.0, log),
                       [1, 8], iterations=3, warmup=0)
    table = pair_markdown_table(pairs)
    assert "latency A/B" in table and "dense.onnx" in table
    assert len([l for l in table.splitlines() if l.startswith("| 1 ") or l.startswith("| 8 ")]) == 2
    assert "2.000 [2.000–2.000]" in table
    singles = [_result("m.onnx", 1, [1.0, 2.0, 3.0]), _result("m.onnx", 8, [5.0, 6.0])]
    md = markdown_table(singles)
    assert md.count("\n") == 3 and "| m.onnx | onnxruntime | cpu | 8 |" in md

    out = tmp_path / "r.json"
    to_json(pairs, out, extra={"command": "test"})
    doc = json.loads(out.read_text())
    assert doc["command"] == "test" and doc["results"][1]["batch_size"] == 8
    assert doc["results"][0]["latency_ratio"]["median"] == 2.0
    assert doc["results"][0]["a"]["latency_ms"]["p50"] == 4.0

    pytest.importorskip("matplotlib")
    png = plot_latency(pairs, tmp_path / "p.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png2 = plot_latency(singles, tmp_path / "s.png")
    assert png2.stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "r.json", "s.png"]


# ---------------------------------------------------------------------------------------------
# percentiles


def test_summarize_latencies_linear_interpolation():
    # numpy's default (linear) percentile: position (n - 1) * q between sorted samples
    s = summarize_latencies([4.0, 1.0, 3.0, 2.0])
    assert s["p50"] == pytest.approx(2.5) and s["p90"] == pytest.approx(3.7) and s["p99"] == pytest.approx(3.97)
    assert (s["min"], s["max"], s["mean"]) == (1.0, 4.0, 2.5)
    assert s["std"] == pytest.approx(np.sqrt(1.25))  # population std
    lat = list(range(1, 101))  # 1..100 ms
    s = summarize_latencies(lat)
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert summarize_latencies([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0, "std": 0.0,
                                          "min": 7.0, "max": 7.0}
    with pytest.raises(ValueError, match="no latencies"):
        summarize_latencies([])


# ---------------------------------------------------------------------------------------------
# runner registry


def test_registry_maps_backend_names_to_runner_classes():
    from runners.registry import BACKENDS, backend_names, runner_class

    assert backend_names() == ["onnxruntime", "tensorrt", "torch"]
    assert runner_class("onnxruntime") is OrtRunner and runner_class("torch") is TorchRunner
    assert runner_class("tensorrt").__name__ == "TrtRunner"
    assert BACKENDS["torch"].kinds == ("run", "model") and BACKENDS["tensorrt"].kinds == ("engine",)
    with pytest.raises(UserError, match="unknown backend 'tvm'"):
        runner_class("tvm")


def test_register_backend_refuses_a_duplicate(monkeypatch):
    from runners import registry

    monkeypatch.setattr(registry, "BACKENDS", registry.BACKENDS.copy())

    @registry.register_backend("fake")
    class _Fake(registry.Backend):
        kinds = ("onnx",)

    assert "fake" in registry.backend_names() and registry.get_backend("fake").name == "fake"
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend("fake")(_Fake)
    with pytest.raises(UserError, match=r"^unknown backend 'nope', known: onnxruntime, torch, tensorrt, fake$"):
        registry.get_backend("nope")


def test_make_runner_dispatches_on_the_target(onnx_file, tmp_path):
    from runners.registry import make_runner, target_kind

    path, _model = onnx_file
    r = make_runner(str(path), threads=1)
    assert isinstance(r, OrtRunner) and r.input_shape == SHAPE and r.threads == 1
    r.close()
    t = make_runner("fmnist-vit", random_init=True, threads=1)
    assert isinstance(t, TorchRunner) and t.input_shape == SHAPE and t.label == "fmnist-vit"
    assert target_kind(str(path)) == "onnx" and target_kind("x.engine") == "engine"
    assert target_kind(str(tmp_path)) == "run" and target_kind("deit_small_patch16_224") == "model"
    with pytest.raises(UserError, match="use --backend onnxruntime"):
        make_runner(str(path), "torch")
    with pytest.raises(UserError, match="export it first"):
        make_runner(str(tmp_path), "onnxruntime")
    with pytest.raises(UserError, match="ONNX file not found"):
        make_runner(str(tmp_path / "none.onnx"))
    with pytest.raises(UserError, match="no such file or directory"):
        make_runner(str(tmp_path / "none" / "x.pt"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="not an .onnx file or a run directory"):
        make_runner(str(tmp_path / "notes.txt"))


def test_make_runner_engine_without_tensorrt_is_a_runtime_fault(tmp_path, monkeypatch):
    import sys

    from edgeprune.errors import RuntimeFault
    from runners.registry import backend_available, make_runner

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    assert "not found" in (backend_available("tensorrt") or "")
    with pytest.raises(UserError, match="TensorRT engine file not found"):
        make_runner(str(tmp_path / "m.engine"))
    (tmp_path / "m.engine").write_bytes(b"x")
    with pytest.raises(RuntimeFault, match="TensorRT Python package not found"):
        make_runner(str(tmp_path / "m.engine"))
    with pytest.raises(UserError, match="does not use TensorRT"):
        from devices import shipped_profile_path

        make_runner(str(tmp_path / "m.engine"), profile=str(shipped_profile_path("cpu")))  # runs ONNX Runtime


def test_torch_runner_precision_and_cuda_graphs_need_cuda():
    from edgeprune.errors import RuntimeFault

    with pytest.raises(UserError, match="unknown torch precision 'fp8'"):
        TorchRunner(_fmnist(), precision="fp8")
    if not torch.cuda.is_available():
        for kwargs, what in (({"precision": "fp16"}, "precision fp16"), ({"precision": "tf32"}, "precision tf32"),
                             ({"cuda_graphs": True}, "CUDA graphs")):
            with pytest.raises(RuntimeFault, match=f"^{what} needs? a CUDA GPU"):
                TorchRunner(_fmnist(), **kwargs)
        with pytest.raises(RuntimeFault, match="no usable GPU"):
            TorchRunner(_fmnist(), device="cuda", precision="bf16")
    r = TorchRunner(_fmnist(), threads=1, input_shape=SHAPE)
    s = r.settings()
    assert s["precision"] == "fp32" and s["cuda_graphs"] is False and "float32" not in s["mode"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision,graphs", [("fp16", False), ("bf16", True), ("tf32", True)])
def test_torch_runner_cuda_precisions(precision, graphs):
    model = _fmnist()
    x = make_batch(SHAPE, 4, seed=1)
    ref = model(torch.from_numpy(x)).detach().numpy()
    r = TorchRunner(_fmnist(), device="cuda", precision=precision, cuda_graphs=graphs, input_shape=SHAPE)
    out = r.infer(x)
    assert out.dtype == np.float32 and np.abs(out - ref).max() < 0.1
    res = r.benchmark([1, 4], iterations=3, warmup=1)
    assert res[0].settings["precision"] == precision and res[0].settings["cuda_graphs"] is graphs


def test_graph_input_made_in_inference_mode_is_rewritten_outside_it():
    """Issue 29 item 1: the CUDA-graph input buffer was made inside ``inference_mode`` (by infer())
    and written outside it (by prepare() with a new array): ``static_in.copy_(t)`` raised
    "Inplace update to inference tensor outside InferenceMode". Shown on CPU through the runner's
    own graph-cache path, with a cached (graph, input, output) whose input is an inference tensor."""
    runner = TorchRunner(_fmnist(), threads=1)
    with torch.inference_mode():
        static_in = torch.zeros(2, *SHAPE)
    assert static_in.is_inference()
    sentinel_graph, static_out = object(), torch.zeros(2, 10)
    runner._graphs[(2, *SHAPE)] = (sentinel_graph, static_in, static_out)
    new = torch.from_numpy(np.random.default_rng(0).standard_normal((2, *SHAPE), dtype=np.float32))
    assert not torch.is_inference_mode_enabled()
    graph, inp, out = runner._graph(new)
    assert graph is sentinel_graph and inp is static_in and out is static_out
    assert torch.equal(static_in, new)  # the replay will read the new input

