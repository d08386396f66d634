"""``gram_dtype="bfloat16"`` / ``--gram-dtype bfloat16``: the MLP and V/O covariance products in
bfloat16 (edgeprune.calibration.mlp_stats.symmetric_gram_bf16; docs/prune_cost.md). An estimate:
close to the exact Gram (far closer than the calibration set's own sampling error), exactly
symmetric, the mean and the Q/K statistics unchanged, refused where bfloat16 products are not
native, and a prune whose compensation is as good as the float32 one's."""

from __future__ import annotations

import pytest
import torch

from edgeprune.calibration import mlp_stats
from edgeprune.calibration.mlp_stats import MLPStatistics, native_bf16_matmul, symmetric_gram_bf16
from tests.conftest import assert_one_line_error, run_cli, tiny_vit

needs_native_bf16 = pytest.mark.skipif(not native_bf16_matmul("cpu"),
                                       reason="this CPU has no native bfloat16 products (AVX512-BF16 / AMX)")


def activations(t: int = 2048, d: int = 96, seed: int = 0) -> torch.Tensor:
    """(t, d) correlated, non-negative-ish activations with a mean: a low-rank signal through a
    GELU, like an MLP's hidden layer."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, 12, generator=g) @ torch.randn(12, d, generator=g) + 0.3 * torch.randn(t, d, generator=g)
    return torch.nn.functional.gelu(z + 0.5)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("d,block,chunk", [(96, 32, 256), (100, 64, 300), (48, 256, 4096)])
def test_bf16_gram_is_close_to_the_exact_gram_and_exactly_symmetric(d, block, chunk):
    """Any block / chunk split (D not a multiple of the block, one chunk or many): the products of
    the bfloat16-rounded inputs are exact, so against their float64 Gram only the output rounding
    is left (<= 2^-9 relative per chunk product; averaged over several chunks it is smaller), and
    against the float64 Gram of x the input rounding adds ~1e-4."""
    x = activations(d=d) - 0.2
    exact = x.double().T @ x.double()
    got = symmetric_gram_bf16(x, block=block, chunk=chunk)
    assert got.dtype == torch.float32 and torch.equal(got, got.T)
    xb = x.bfloat16().double()
    chunks = -(-x.shape[0] // chunk)
    bound = 2 ** -9 if chunks == 1 else 2 ** -9 / 2
    assert 0 < rel(got, xb.T @ xb) < bound
    assert rel(got, exact) < bound + 3e-4
    acc = torch.zeros(d, d, dtype=torch.float64)
    symmetric_gram_bf16(x, out=acc, block=block, chunk=chunk)
    symmetric_gram_bf16(x, out=acc, block=block, chunk=chunk)
    assert torch.allclose(acc, 2 * got.double(), rtol=1e-6, atol=0)


def test_bf16_error_is_far_below_the_sampling_error():
    """What makes the estimate safe: the bfloat16 error of the covariance is < 1% of the
    difference between the covariances of two halves of the same data."""
    x = activations(t=4096)
    half = [MLPStatistics(x.shape[1], torch.float64, count_positive=False) for _ in range(2)]
    half[0].add_batch(x[:2048])
    half[1].add_batch(x[2048:])
    exact, bf = (MLPStatistics(x.shape[1], dt, count_positive=False) for dt in (torch.float64, torch.bfloat16))
    for st in (exact, bf):
        for i in range(0, 4096, 512):
            st.add_batch(x[i:i + 512])
    sampling = rel(half[0].cov, half[1].cov)
    err = rel(bf.cov, exact.cov)
    assert err < 0.01 * sampling, (err, sampling)


@pytest.mark.parametrize("flush_every", [1, 2, 100])
def test_bf16_statistics_mean_cov_and_flushes(monkeypatch, flush_every):
    """MLPStatistics with bfloat16 products: the mean is the float32 one (sums are not bfloat16),
    the covariance close to the exact one, and flushing the float32 accumulator into the float64
    sum after every batch, every 2 or never before the read gives the same covariance (a flush
    that does not reset, or a read that does not flush, fails)."""
    monkeypatch.setattr(mlp_stats, "BF16_FLUSH_BATCHES", flush_every)
    x = activations(t=3000)
    ref, bf = MLPStatistics(96, torch.float64), MLPStatistics(96, torch.bfloat16)
    for i in range(0, 3000, 500):
        ref.add_batch(x[i:i + 500].reshape(5, 100, 96))
        bf.add_batch(x[i:i + 500].reshape(5, 100, 96))
    assert bf.count == ref.count == 3000
    assert torch.allclose(bf.mean, ref.mean, rtol=0, atol=1e-6)
    assert torch.allclose(bf.active_prob, ref.active_prob, rtol=0, atol=0)
    assert 0 < rel(bf.cov, ref.cov) < 1e-3 and torch.equal(bf.cov, bf.cov.T)
    assert rel(bf.variance, ref.variance) < 1e-3
    if flush_every == 100:
        monkeypatch.setattr(mlp_stats, "BF16_FLUSH_BATCHES", 1)
        other = MLPStatistics(96, torch.bfloat16)
        for i in range(0, 3000, 500):
            other.add_batch(x[i:i + 500].reshape(5, 100, 96))
        assert torch.allclose(other.cov, bf.cov, rtol=1e-5, atol=1e-7)


def test_bf16_leaves_the_qk_statistics_and_refuses_where_not_native(monkeypatch):
    """Q/K Grams are float32 products whatever gram_dtype (bitwise those of a float32 pass); on a
    device without native bfloat16 products the pass is refused with a one-line user error."""
    from edgeprune.anatomy import find_anatomy
    from edgeprune.calibration.collect import collect_statistics
    from edgeprune.errors import UserError

    x = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    an = find_anatomy(tiny_vit())
    monkeypatch.setattr(mlp_stats, "native_bf16_matmul", lambda device="cpu": True)
    monkeypatch.setattr("edgeprune.calibration.collect.native_bf16_matmul", lambda device="cpu": True)
    f32 = collect_statistics(an, [x[:3], x[3:]], progress=False)
    b16 = collect_statistics(an, [x[:3], x[3:]], progress=False, gram_dtype=torch.bfloat16, vo=True)
    for a, b in zip(f32.qk, b16.qk):
        assert all(torch.equal(u, v) for u, v in zip(a.grams(), b.grams()))
    for a, b in zip(f32.mlp, b16.mlp):
        assert rel(b.cov, a.cov) < 2e-3 and torch.allclose(b.mean, a.mean, rtol=0, atol=1e-6)
    monkeypatch.setattr("edgeprune.calibration.collect.native_bf16_matmul", lambda device="cpu": False)
    with pytest.raises(UserError, match="native bfloat16"):
        collect_statistics(an, [x], progress=False, gram_dtype=torch.bfloat16)


def test_gram_dtype_errors_are_one_line(tmp_path, monkeypatch):
    r = run_cli(["prune", "--random-init", "--gram-dtype", "float16", "--no-eval", "--quiet", "-o", tmp_path / "a"])
    assert r.exit_code == 2 and "float16" in r.output and "Traceback" not in r.output
    r = run_cli(["prune", "--random-init", "--gram-dtype", "bfloat16", "--sequential", "--no-eval", "--quiet",
                 "-o", tmp_path / "b"])
    assert_one_line_error(r, "--sequential")
    monkeypatch.setattr("edgeprune.calibration.collect.native_bf16_matmul", lambda device="cpu": False)
    r = run_cli(["prune", "--random-init", "--gram-dtype", "bfloat16", "--no-eval", "--quiet", "-o", tmp_path / "c"])
    assert_one_line_error(r, "native bfloat16")
    assert not any((tmp_path / n).exists() for n in "abc")
    import edgeprune
    from edgeprune.errors import UserError

    with pytest.raises(UserError, match="gram dtype"):
        edgeprune.prune(tiny_vit(), torch.randn(4, 3, 16, 16), gram_dtype="half", progress=False)


@needs_native_bf16
def test_bf16_prune_compensates_as_well_as_float32():
    """A CORP prune (MLP and Q/K at 0.5) of the seeded tiny ViT with bfloat16 products: recorded,
    the same kept MLP channels for nearly all of them, and a held-out output error within 2% of
    the float32 run's (far below the uncompensated one)."""
    import edgeprune

    g = torch.Generator().manual_seed(0)
    calib, held = torch.randn(96, 3, 16, 16, generator=g), torch.randn(64, 3, 16, 16, generator=g)
    runs = {name: edgeprune.prune(tiny_vit(), calib, target="both", sparsity=0.5, progress=False, batch_size=32, **kw)
            for name, kw in {"f32": {}, "bf16": {"gram_dtype": "bfloat16"},
                             "none": {"compensation": False}}.items()}
    assert runs["bf16"].record["settings"]["gram_dtype"] == "bfloat16"
    with torch.no_grad():
        ref = tiny_vit()(held)
        err = {k: float((r.model(held) - ref).pow(2).mean()) for k, r in runs.items()}
    assert err["f32"] < 0.5 * err["none"]
    assert abs(err["bf16"] - err["f32"]) < 0.02 * err["f32"], err
    a, b = runs["f32"].model.state_dict(), runs["bf16"].model.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a if "fc2.weight" in k)  # really other products
