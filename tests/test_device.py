"""``--device`` / ``device=`` for pruning (issue 13 "GPU everywhere"): CPU always; CUDA where present."""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune.errors import UserError
from tests.conftest import assert_one_line_error, run_cli

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


def _images(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


@no_cuda
def test_prune_cli_cuda_without_cuda_is_a_one_line_error(tmp_path):
    r = run_cli(["prune", "--model", "fmnist-vit", "--device", "cuda", "--no-eval", "-o", tmp_path / "r"])
    assert_one_line_error(r, "CUDA is not available")
    assert not (tmp_path / "r").exists()


def test_prune_cli_unknown_device_is_a_one_line_error(tmp_path):
    r = run_cli(["prune", "--model", "fmnist-vit", "--device", "tpu", "--no-eval", "-o", tmp_path / "r"])
    assert_one_line_error(r, "unknown device")


@no_cuda
def test_prune_api_cuda_without_cuda_raises_before_work():
    from edgeprune.api import prune

    with pytest.raises(UserError, match="CUDA is not available"):
        prune(torch.nn.Linear(2, 2), torch.zeros(1), device="cuda")


def test_auto_device_resolves_and_is_recorded(fmnist_model):
    from edgeprune.api import prune

    res = prune(fmnist_model, _images(), target="both", sparsity=0.5, device="auto")
    assert res.record["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert next(res.model.parameters()).device.type == "cpu"


def test_statistics_pass_returns_the_model_where_it_was(fmnist_model):
    from edgeprune.anatomy import find_anatomy
    from edgeprune.calibration.collect import calibration_device, collect_statistics

    model = copy.deepcopy(fmnist_model)
    with calibration_device("cpu"):
        st = collect_statistics(find_anatomy(model), [_images(8)], progress=False)
    assert st.mlp[0].cov.device.type == "cpu" and next(model.parameters()).device.type == "cpu"


def _folded(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().cpu() for k, v in model.state_dict().items()}


@needs_cuda
def test_prune_on_cuda_matches_cpu(fmnist_model):
    """Statistics on the GPU (float32 products into float64 sums, TF32 off), solves in float64:
    the folded weights agree with the CPU run to 1e-4 relative, with the same kept indices."""
    from edgeprune.api import prune

    x = _images(48)
    cpu = prune(fmnist_model, x, target="both", sparsity=0.5, device="cpu")
    gpu = prune(fmnist_model, x, target="both", sparsity=0.5, device="cuda")
    assert gpu.record["device"] == "cuda"
    a, b = _folded(cpu.model), _folded(gpu.model)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert float((a[k] - b[k]).norm()) <= 1e-4 * max(float(a[k].norm()), 1e-12), k


@needs_cuda
def test_statistics_accumulate_on_the_device_and_come_back_on_cpu(fmnist_model):
    from edgeprune.anatomy import find_anatomy
    from edgeprune.calibration.collect import collect_statistics

    model = copy.deepcopy(fmnist_model)
    st = collect_statistics(find_anatomy(model), [_images(8)], progress=False, device="cuda")
    ref = collect_statistics(find_anatomy(model), [_images(8)], progress=False, device="cpu")
    assert st.mlp[0]._gram.device.type == "cpu" and st.mlp[0]._gram.dtype == torch.float64
    assert float((st.mlp[0].cov - ref.mlp[0].cov).norm() / ref.mlp[0].cov.norm()) < 1e-5
    assert next(model.parameters()).device.type == "cpu"


@needs_cuda
def test_evaluate_on_cuda_leaves_the_model_on_cpu(fmnist_model):
    from edgeprune.data.sources import TensorSource
    from edgeprune.evaluate import evaluate_classifier, _on_device

    model = copy.deepcopy(fmnist_model)
    with _on_device(model):
        evaluate_classifier(model, TensorSource(_images(8), torch.zeros(8, dtype=torch.long), "t"), device="cuda")
    assert next(model.parameters()).device.type == "cpu"


def test_verify_takes_a_device(tmp_path):
    """``edgeprune verify --device cpu`` runs (the PyTorch side on the device); --device cuda
    without CUDA and an unknown device are one-line errors before any work."""
    onnx = tmp_path / "m.onnx"
    r = run_cli(["export", "--model", "deit_tiny_patch16_224", "--random-init", "--model-kwargs", "depth=1",
                 "-o", onnx])
    assert r.exit_code == 0, r.output
    common = ["verify", onnx, "--model", "deit_tiny_patch16_224", "--random-init", "--model-kwargs", "depth=1",
              "--n", "2"]
    r = run_cli([*common, "--device", "cpu", "--json", tmp_path / "rep.json"])
    assert r.exit_code == 0, r.output
    import json

    assert json.loads((tmp_path / "rep.json").read_text())["torch_device"] == "cpu"
    r = run_cli([*common, "--device", "tpu"])
    assert_one_line_error(r, "unknown device")
    if not torch.cuda.is_available():
        r = run_cli([*common, "--device", "cuda"])
        assert_one_line_error(r, "CUDA is not available")


def test_sequential_calibration_runs_on_the_cpu_and_is_recorded_so(monkeypatch):
    """Sequential calibration keeps its token streams in host memory and runs on the CPU: with a
    GPU device asked (here a stand-in for an available CUDA device) the record says "cpu", where
    the work ran, not the device that was asked."""
    import edgeprune
    from tests.conftest import tiny_vit

    monkeypatch.setattr("edgeprune.api.resolve_device", lambda device: "cuda:0")
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    res = edgeprune.prune(tiny_vit(), x, target="mlp", sparsity=0.5, sequential=True, device="cuda",
                          progress=False, batch_size=4)
    assert res.record["device"] == "cpu"
    assert next(res.model.parameters()).device.type == "cpu"
