"""Which SDPA kernel a model runs (runners/attention_kernels.py; issue 13 "GPU benchmarks that mean
something"). On the CPU, PyTorch's dispatcher also has a flash kernel that needs qk_dim == v_dim,
so the property the GPU report is for -- the default layout's pruned model leaves FlashAttention,
``--layout fused`` keeps it -- is testable here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runners.attention_kernels import attention_kernels, describe, record_sdpa_kernels, sdpa_backend

KNOWN = sdpa_backend(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)) != "unknown"
needs_choice = pytest.mark.skipif(not KNOWN, reason="this torch does not expose torch._fused_sdp_choice")


@needs_choice
def test_flash_needs_equal_qk_and_v_head_dims():
    q = torch.randn(2, 3, 17, 32)
    assert sdpa_backend(q, q, torch.randn(2, 3, 17, 32)) == "flash_attention"
    assert sdpa_backend(q, q, torch.randn(2, 3, 17, 64)) == "math"


@needs_choice
def test_dense_pruned_and_fused_models(fmnist_model):
    """Dense: flash in every block; both@0.5 (qk_dim 32 != v_dim 64): math; --layout fused
    (qk_dim == v_dim): flash again. The outputs are those of the unwrapped call."""
    import edgeprune

    spec = edgeprune.get_model_spec("fmnist-vit")
    x = torch.randn(2, *spec.input_size, generator=torch.Generator().manual_seed(0))
    calib = torch.randn(16, *spec.input_size, generator=torch.Generator().manual_seed(1))
    blocks = len(fmnist_model.blocks)
    assert attention_kernels(fmnist_model.eval(), x) == {"flash_attention": blocks}
    pruned = edgeprune.prune(spec.create(pretrained=True), calib, spec=spec, target="both", sparsity=0.5,
                             progress=False).model.eval()
    fused = edgeprune.prune(spec.create(pretrained=True), calib, spec=spec, target="both", sparsity=0.5,
                            layout="fused", progress=False).model.eval()
    assert attention_kernels(pruned, x) == {"math": blocks}
    assert attention_kernels(fused, x) == {"flash_attention": blocks}
    with torch.no_grad():
        ref = pruned(x)
        with record_sdpa_kernels():
            assert torch.equal(pruned(x), ref)
    assert describe({"math": blocks}) == f"math x{blocks}" and describe({}) == "no SDPA call"


def test_the_wrapper_is_removed_even_after_an_error():
    original = F.scaled_dot_product_attention
    with pytest.raises(RuntimeError):
        with record_sdpa_kernels() as counts:
            assert F.scaled_dot_product_attention is not original
            q = torch.randn(1, 1, 3, 4)
            F.scaled_dot_product_attention(q, q, q)
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original
    assert sum(counts.values()) == 1


def test_explicit_attention_makes_no_sdpa_call():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert attention_kernels(model, torch.randn(2, 4)) == {}


@needs_choice
def test_torch_runner_reports_the_kernel(fmnist_model):
    import numpy as np

    from runners.torch_runner import TorchRunner

    runner = TorchRunner(fmnist_model, device="cpu", input_shape=(1, 28, 28))
    assert "attention_kernel" not in runner.settings()
    runner.prepare(np.zeros((1, 1, 28, 28), dtype=np.float32))
    assert runner.settings()["attention_kernel"] == f"flash_attention x{len(fmnist_model.blocks)}"


def test_bench_latency_torch_backend_smoke_on_cpu(capsys):
    """benchmarks/bench_latency.py --backend torch runs end to end on the CPU (fp32 eager, tiny
    settings) and prints one row per batch size with both kernels; without CUDA, --device cuda is a
    one-line error."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_latency

    code = bench_latency.main(["--backend", "torch", "--models", "deit_tiny", "--sparsities", "0.5", "--device",
                               "cpu", "--precisions", "fp32", "--graphs", "eager", "--batch-sizes", "1,2",
                               "--iterations", "2", "--warmup", "0", "--calib-size", "4"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| deit_tiny")]
    assert len(rows) == 2 and all("both@0.5" in r for r in rows)
    if KNOWN:
        assert all(r.rstrip(" |").endswith("math x12") for r in rows)
    if not torch.cuda.is_available():
        assert bench_latency.main(["--backend", "torch", "--device", "cuda"]) == 2
