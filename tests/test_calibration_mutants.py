"""Known answers for the calibration statistics (issue 17, ``tools/mutation_check.py calibration``).

Every expected value is computed here from the definition in float64 (numpy or plain torch sums),
never through the class under test: MLP mean / centred covariance / variance / energy / active
probability, ``symmetric_gram`` = X^T X, the Q/K logit energy ``E_i[Gq_i[j,j] Gk_i[j,j]]`` and the
Q/K compensation system ``sum_i Gq_i[S,S] (x) Gk_i[S,S]``, ``sum_i Gq_i[S,P] Gk_i[P,S]``.
Fast: no model, no data.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.solve.gram import _mirror_upper, symmetric_gram
from edgeprune.calibration.qk_stats import QKStatistics, QKSystemStatistics


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _np_moments(x: np.ndarray):
    """mean, centred covariance (1/N), variance, energy, P(x > 0) of rows x (N, D), float64."""
    x = x.astype(np.float64)
    n = x.shape[0]
    mu = x.sum(0) / n
    c = (x - mu).T @ (x - mu) / n
    return mu, c, np.diag(c).copy(), (x * x).sum(0) / n, (x > 0).sum(0) / n


class _MatmulLog(TorchFunctionMode):
    """Records the operand shapes of every ``@``; optionally adds ``bump`` below each result's
    main diagonal (a GEMM whose result is not bitwise symmetric)."""

    def __init__(self, bump: float = 0.0):
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.bump = bump

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.__matmul__, torch.Tensor.matmul, torch.matmul):
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
            if self.bump:
                out = out + self.bump * torch.tril(torch.ones_like(out), -1)
        return out


# ---- _mirror_upper / symmetric_gram ------------------------------------------------------------
def test_mirror_upper_keeps_the_upper_triangle_and_mirrors_it():
    g = torch.tensor([[1.0, 2.0, 3.0], [40.0, 5.0, 6.0], [70.0, 80.0, 9.0]])
    expected = torch.tensor([[1.0, 2.0, 3.0], [2.0, 5.0, 6.0], [3.0, 6.0, 9.0]])
    assert torch.equal(_mirror_upper(g), expected)
    assert torch.equal(_mirror_upper(torch.tensor([[7.0]])), torch.tensor([[7.0]]))


@pytest.mark.parametrize("d,block", [(3, 384), (6, 6), (8, 4), (12, 4), (7, 3), (10, 4), (5, 2)])
def test_symmetric_gram_equals_x_transpose_x(d, block):
    """d < block, d == block, d a multiple of block (2 and 3 block rows), d not a multiple."""
    x = _rand(13, d, seed=d + 100 * block)
    ref = x.double().numpy().T @ x.double().numpy()
    got = symmetric_gram(x, block=block)
    assert got.dtype == torch.float32 and got.shape == (d, d)
    assert torch.equal(got, got.T)
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=1e-5, atol=1e-5)
    # float64 input: float64 product, exact to round-off
    x64 = x.double()
    got64 = symmetric_gram(x64, block=block)
    assert got64.dtype == torch.float64
    np.testing.assert_allclose(got64.numpy(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d,block", [(4, 8), (8, 4), (10, 4), (9, 3)])
def test_symmetric_gram_adds_into_a_float64_out(d, block):
    x = _rand(11, d, seed=d)
    start = torch.arange(d * d, dtype=torch.float64).reshape(d, d)  # not symmetric, not zero
    out = start.clone()
    ret = symmetric_gram(x, block=block, out=out)
    assert ret is out and out.dtype == torch.float64
    symmetric_gram(x, block=block, out=out)
    ref = start.numpy() + 2 * (x.double().numpy().T @ x.double().numpy())
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("d,block", [(5, 8), (8, 4), (10, 4), (9, 3)])
def test_symmetric_gram_uses_the_upper_triangle_of_a_non_symmetric_gemm(d, block):
    """Each GEMM result gets +1000 below its diagonal: only the upper triangle may be used."""
    x = _rand(9, d, seed=d + 1).double()
    ref = x.numpy().T @ x.numpy()
    with _MatmulLog(bump=1000.0) as log:
        got = symmetric_gram(x, block=block)
    assert log.shapes  # the mode saw the products
    assert torch.equal(got, got.T)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12, atol=1e-12)


def test_symmetric_gram_forms_one_gemm_per_block_row_with_default_block_384():
    """Documented cost: D = 1536, block 384 -> 4 GEMMs x[:, i:i+384]^T x[:, i:]."""
    x = _rand(3, 1536, seed=5)
    with _MatmulLog() as log:
        got = symmetric_gram(x)
    assert log.shapes == [((384, 3), (3, 1536 - i)) for i in (0, 384, 768, 1152)]
    with _MatmulLog() as log:
        symmetric_gram(x[:, :384])
    assert log.shapes == [((384, 3), (3, 384))]
    with _MatmulLog() as log:
        symmetric_gram(x[:, :385])
    assert log.shapes == [((384, 3), (3, 385)), ((1, 3), (3, 1))]
    ref = x.double().T @ x.double()
    assert float((got.double() - ref).abs().max()) < 1e-4


def test_symmetric_gram_output_on_the_input_device():
    x = torch.empty(4, 6, device="meta")
    assert symmetric_gram(x, block=4).device.type == "meta"
    assert symmetric_gram(x, block=8).device.type == "meta"


# ---- MLPStatistics ------------------------------------------------------------------------------
def _batches(seed=0, dims=5, mean=0.0):
    g = torch.Generator().manual_seed(seed)
    # (B, n, D) batches of different sizes, zeros and values in (0, 1) included
    out = []
    for b, n in ((2, 3), (1, 7), (3, 2)):
        x = torch.randn(b, n, dims, generator=g) * torch.linspace(0.5, 2.0, dims) + mean
        x[..., 0] = torch.relu(x[..., 0] - mean)           # exact zeros
        x[..., 1] = x[..., 1].abs() * 0.1 + mean           # values in (0, 1) when mean == 0
        out.append(x)
    return out


@pytest.mark.parametrize("gram_dtype", [torch.float64, torch.float32])
def test_mlp_statistics_known_answers_over_several_batches(gram_dtype):
    batches = _batches(1)
    st = MLPStatistics(5, gram_dtype=gram_dtype)
    for x in batches:
        st.add_batch(x)
    x = torch.cat([b.reshape(-1, 5) for b in batches]).double().numpy()
    mu, c, var, energy, active = _np_moments(x)
    tol = dict(rtol=1e-12, atol=1e-12) if gram_dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    assert st.count == x.shape[0] == 6 + 7 + 6
    for got in (st.mean, st.cov, st.variance, st.energy, st.active_prob):
        assert got.dtype == torch.float64
    np.testing.assert_allclose(st.mean.numpy(), mu, **tol)
    np.testing.assert_allclose(st.cov.numpy(), c, **tol)
    np.testing.assert_allclose(st.variance.numpy(), var, **tol)
    np.testing.assert_allclose(st.energy.numpy(), energy, **tol)
    np.testing.assert_array_equal(st.active_prob.numpy(), active)
    assert torch.equal(st.cov, st.cov.T)
    assert st.active_prob[0] < 1 and st.active_prob[1] == 1.0  # zeros are not active, 0.1 is


def test_mlp_statistics_known_answer_by_hand():
    # rows [1, -2], [3, 0], [2, 5]: mean [2, 1]; centred [-1, -3], [1, -1], [0, 4]
    st = MLPStatistics(2, gram_dtype=torch.float64)
    st.add_batch(torch.tensor([[1.0, -2.0], [3.0, 0.0]]))
    st.add_batch(torch.tensor([[2.0, 5.0]]))
    f64 = dict(dtype=torch.float64)
    assert torch.equal(st.mean, torch.tensor([2.0, 1.0], **f64))
    torch.testing.assert_close(st.cov, torch.tensor([[2.0, 2.0], [2.0, 26.0]], **f64) / 3)
    torch.testing.assert_close(st.variance, torch.tensor([2.0, 26.0], **f64) / 3)
    torch.testing.assert_close(st.energy, torch.tensor([14.0, 29.0], **f64) / 3)
    torch.testing.assert_close(st.active_prob, torch.tensor([1.0, 1.0 / 3.0], **f64))


def test_single_row_batch_and_empty_batches_are_handled():
    st = MLPStatistics(3, gram_dtype=torch.float64)
    st.add_batch(torch.empty(0, 3))               # ignored: does not set the shift
    st.add_batch(torch.empty(2, 0, 3))            # (B, 0, D): no token either
    st.add_batch(torch.tensor([[1.0, 0.0, -2.0]]))  # one token
    assert st.count == 1
    assert torch.equal(st.mean, torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64))
    assert torch.equal(st.cov, torch.zeros(3, 3, dtype=torch.float64))
    assert torch.equal(st.energy, torch.tensor([1.0, 0.0, 4.0], dtype=torch.float64))
    assert torch.equal(st.active_prob, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    st.add_batch(torch.empty(0, 3))
    st.add_batch(torch.tensor([[3.0, 2.0, 0.0]]))
    assert st.count == 2
    torch.testing.assert_close(st.mean, torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64))
    torch.testing.assert_close(st.variance, torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64))


def test_shifted_data_keeps_the_float32_covariance_accurate_with_a_large_mean():
    """Mean 1e4, spread ~1: float32 products of uncentred data would lose everything (eps * 1e8)."""
    batches = _batches(2, dims=6, mean=1.0e4)
    st = MLPStatistics(6)  # float32 Gram (the default)
    for x in batches:
        st.add_batch(x)
    x = torch.cat([b.reshape(-1, 6) for b in batches]).double().numpy()
    mu, c, var, energy, _ = _np_moments(x)
    np.testing.assert_allclose(st.cov.numpy(), c, rtol=1e-4, atol=1e-4 * np.abs(c).max())
    np.testing.assert_allclose(st.variance.numpy(), var, rtol=1e-4, atol=1e-4 * var.max())
    np.testing.assert_allclose(st.mean.numpy(), mu, rtol=1e-7)  # see the large-mean test below
    np.testing.assert_allclose(st.energy.numpy(), energy, rtol=2e-7)
    # second_order=False: per-channel sums of squares, same accuracy
    light = MLPStatistics(6, second_order=False)
    for b in batches:
        light.add_batch(b)
    np.testing.assert_allclose(light.variance.numpy(), var, rtol=1e-4, atol=1e-4 * var.max())


def test_mean_of_float32_data_with_a_large_mean_is_exact_to_float64_round_off():
    x = torch.tensor([[10000.3, 1.0], [10000.4, 3.0]], dtype=torch.float32)
    st = MLPStatistics(2)
    st.add_batch(x)
    np.testing.assert_allclose(st.mean.numpy(), x.double().mean(0).numpy(), rtol=1e-12)


def test_defaults_are_float32_second_order_and_counting():
    st = MLPStatistics(4)
    assert st.gram_dtype == torch.float32 and st.second_order and st.count_positive
    st.add_batch(torch.tensor([[1.0, -1.0, 0.5, 0.0], [2.0, 1.0, -0.5, 0.0]]))
    torch.testing.assert_close(st.active_prob, torch.tensor([1.0, 0.5, 0.5, 0.0], dtype=torch.float64))
    assert st.cov.shape == (4, 4)


def test_second_order_false_gives_the_same_first_moments_and_refuses_cov():
    batches = _batches(3)
    full = MLPStatistics(5, gram_dtype=torch.float64)
    light = MLPStatistics(5, gram_dtype=torch.float64, second_order=False)
    for x in batches:
        full.add_batch(x)
        light.add_batch(x)
    x = torch.cat([b.reshape(-1, 5) for b in batches]).double().numpy()
    mu, _, var, energy, active = _np_moments(x)
    np.testing.assert_allclose(light.mean.numpy(), mu, rtol=1e-12)
    np.testing.assert_allclose(light.variance.numpy(), var, rtol=1e-12)
    np.testing.assert_allclose(light.energy.numpy(), energy, rtol=1e-12)
    np.testing.assert_array_equal(light.active_prob.numpy(), active)
    assert light._gram.numel() == 0  # no (D, D) buffer is allocated
    assert full._gram.shape == (5, 5)
    with pytest.raises(RuntimeError, match="second_order=False"):
        light.cov


def test_count_positive_false_refuses_active_prob_only():
    st = MLPStatistics(3, gram_dtype=torch.float64, count_positive=False)
    st.add_batch(torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]))
    torch.testing.assert_close(st.mean, torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64))
    with pytest.raises(RuntimeError, match="count_positive=False"):
        st.active_prob


def test_nothing_added_raises_for_every_statistic():
    st = MLPStatistics(3)
    st.add_batch(torch.empty(0, 3))
    for name in ("mean", "cov", "variance", "energy", "active_prob"):
        with pytest.raises(RuntimeError, match="no activations were added"):
            getattr(st, name)


def test_wrong_hidden_dim_is_refused():
    st = MLPStatistics(5)
    st.add_batch(torch.ones(2, 3, 5))  # (B, n, D) with n != D is fine
    with pytest.raises(ValueError, match=r"expected hidden dim 5, got \(2, 5, 3\)"):
        st.add_batch(torch.ones(2, 5, 3))
    with pytest.raises(ValueError, match="expected hidden dim 5"):
        MLPStatistics(5).add_batch(torch.ones(5, 4))


def test_activations_on_another_device_are_refused():
    st = MLPStatistics(3)
    st.add_batch(torch.ones(2, 3))
    st.add_batch(torch.ones(2, 3))  # same device again: fine
    with pytest.raises(ValueError, match="activations on meta, statistics on cpu"):
        st.add_batch(torch.ones(2, 3, device="meta"))


def test_accumulators_live_on_the_given_device():
    st = MLPStatistics(3, device="meta")
    st.add_batch(torch.ones(4, 3, device="meta"))
    for t in (st.mean, st.variance, st.energy, st.active_prob):
        assert t.device.type == "meta" and t.dtype == torch.float64
    light = MLPStatistics(3, device="meta", second_order=False)
    light.add_batch(torch.ones(4, 3, device="meta"))
    assert light.variance.device.type == "meta"


def test_shift_fn_gets_the_first_float64_mean_and_its_result_is_the_shift():
    seen = []

    def shift_fn(first):
        seen.append(first.clone())
        return torch.full_like(first, 7.0)

    batches = _batches(4, mean=3.0)
    st = MLPStatistics(5, gram_dtype=torch.float64, shift_fn=shift_fn)
    for x in batches:
        st.add_batch(x)
    assert len(seen) == 1 and seen[0].dtype == torch.float64
    np.testing.assert_allclose(seen[0].numpy(), batches[0].reshape(-1, 5).double().mean(0).numpy(), rtol=1e-12)
    assert torch.equal(st._shift, torch.full((5,), 7.0, dtype=torch.float64))
    x = torch.cat([b.reshape(-1, 5) for b in batches]).double().numpy()
    mu, c, var, _, _ = _np_moments(x)
    np.testing.assert_allclose(st.mean.numpy(), mu, rtol=1e-12)
    np.testing.assert_allclose(st.cov.numpy(), c, rtol=1e-10, atol=1e-12)
    assert MLPStatistics(5).shift_fn is None and st.shift_fn is shift_fn


def test_a_non_symmetric_accumulated_gram_gives_the_symmetrised_covariance():
    """The fallback for a Gram that is not exactly symmetric (e.g. merged from elsewhere)."""
    st = MLPStatistics(2, gram_dtype=torch.float64)
    st.add_batch(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # shift [2, 3], centred sums 0
    st._gram = torch.tensor([[2.0, 4.0], [0.0, 6.0]], dtype=torch.float64)
    torch.testing.assert_close(st.cov, torch.tensor([[1.0, 1.0], [1.0, 3.0]], dtype=torch.float64))


def test_the_covariance_is_computed_once_until_the_sums_change():
    """``cov`` is kept between reads (issue 40 item 4) and recomputed after a new batch, an in-place change of the
    sums (an all-reduce) or a replaced Gram; every value equals the covariance of the rows seen so far."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(7, 3, generator=g, dtype=torch.float64) + i for i in range(2)]

    def ref(x):
        return torch.from_numpy(np.cov(x.numpy().T, bias=True))

    st = MLPStatistics(3, gram_dtype=torch.float64)
    st.add_batch(rows[0])
    first = st.cov
    assert st.cov is first
    torch.testing.assert_close(first, ref(rows[0]), rtol=1e-12, atol=1e-12)
    st.add_batch(rows[1])
    torch.testing.assert_close(st.cov, ref(torch.cat(rows)), rtol=1e-12, atol=1e-12)
    before = st.cov
    st._gram.mul_(2.0)
    st._sum.mul_(2.0)
    st.count *= 2  # as if a second process with the same rows were all-reduced in (same shift)
    torch.testing.assert_close(st.cov, before, rtol=1e-12, atol=1e-12)
    st._gram.add_(torch.eye(3, dtype=torch.float64))  # in place, same count: must be seen
    torch.testing.assert_close(st.cov, before + torch.eye(3, dtype=torch.float64) / st.count, rtol=1e-12, atol=1e-12)
    now = st.cov
    half = st._gram.clone() * 0.5  # a replaced Gram, its version counter brought to the old one's
    while half._version < st._gram._version:
        half.add_(0.0)
    assert half._version == st._gram._version
    st._gram = half
    m = st._sum / st.count
    torch.testing.assert_close(st.cov, 0.5 * now - 0.5 * torch.outer(m, m), rtol=1e-12, atol=1e-12)
    now = st.cov
    st.count += 1  # the count alone
    m2 = st._sum / st.count
    torch.testing.assert_close(st.cov, st._gram / st.count - torch.outer(m2, m2), rtol=1e-12, atol=1e-12)
    assert not torch.equal(st.cov, now)


# ---- QKStatistics --------------------------------------------------------------------------------
def _qk(B=4, H=2, n=5, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, d, generator=g) * torch.tensor([1.0, 2.0, 0.5])[:d]
    k = torch.randn(B, H, n, d, generator=g) * torch.tensor([3.0, 0.2, 1.0])[:d]
    return q, k


def _grams_np(q, k):
    qn, kn = q.double().numpy(), k.double().numpy()
    return np.einsum("bhti,bhtj->bhij", qn, qn), np.einsum("bhti,bhtj->bhij", kn, kn)


@pytest.mark.parametrize("gram_dtype", [torch.float64, torch.float32])
def test_qk_statistics_known_answers(gram_dtype):
    q, k = _qk()
    st = QKStatistics(2, 3, gram_dtype=gram_dtype)
    st.add_batch(q[:1], k[:1])
    st.add_batch(q[1:], k[1:])
    gq_ref, gk_ref = _grams_np(q, k)
    # s_j = E_i[Gq_i[j, j] Gk_i[j, j]], by loops over images, heads, dims and tokens
    s = np.zeros((2, 3))
    for i in range(4):
        for h in range(2):
            for j in range(3):
                s[h, j] += sum(float(q[i, h, t, j]) ** 2 for t in range(5)) * sum(float(k[i, h, t, j]) ** 2 for t in range(5))
    s /= 4
    tol = dict(rtol=1e-12) if gram_dtype == torch.float64 else dict(rtol=1e-5)
    assert st.num_images == 4
    assert st.logit_energy.dtype == torch.float64 and st.logit_energy.shape == (2, 3)
    np.testing.assert_allclose(st.logit_energy.numpy(), s, **tol)
    gq, gk = st.grams()
    assert gq.shape == gk.shape == (4, 2, 3, 3)
    assert gq.dtype == gk.dtype == torch.float32  # float32 storage whatever gram_dtype
    np.testing.assert_allclose(gq.double().numpy(), gq_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gk.double().numpy(), gk_ref, rtol=1e-5, atol=1e-5)
    assert st.memory_bytes() == 2 * 4 * 2 * 3 * 3 * 4


def test_qk_statistics_by_hand_one_image():
    st = QKStatistics(1, 2)
    st.add_batch(torch.tensor([[[[1.0, 2.0], [0.0, 1.0]]]]), torch.tensor([[[[3.0, 0.0], [0.0, 1.0]]]]))
    torch.testing.assert_close(st.logit_energy, torch.tensor([[9.0, 5.0]], dtype=torch.float64))
    gq, gk = st.grams()
    assert torch.equal(gq, torch.tensor([[[[1.0, 2.0], [2.0, 5.0]]]]))
    assert torch.equal(gk, torch.tensor([[[[9.0, 0.0], [0.0, 1.0]]]]))
    assert st.memory_bytes() == 2 * 4 * 4
    assert st.keep_grams and st.gram_dtype == torch.float32 and st.grams_device is None


def test_qk_statistics_without_grams_keeps_only_the_score():
    q, k = _qk(seed=1)
    st = QKStatistics(2, 3, keep_grams=False, gram_dtype=torch.float64)
    st.add_batch(q, k)
    full = QKStatistics(2, 3, gram_dtype=torch.float64)
    full.add_batch(q, k)
    assert torch.equal(st.logit_energy, full.logit_energy)
    assert st.memory_bytes() == 0
    with pytest.raises(RuntimeError, match="keep_grams=False"):
        st.grams()


def test_qk_statistics_errors_before_any_image():
    st = QKStatistics(2, 3)
    with pytest.raises(RuntimeError, match="no images were added"):
        st.logit_energy
    with pytest.raises(RuntimeError, match="no images were added"):
        st.grams()
    assert st.memory_bytes() == 0


@pytest.mark.parametrize("bad_q,bad_k", [
    ((4, 2, 5, 3), (4, 2, 6, 3)),   # q, k differ
    ((2, 5, 3), (2, 5, 3)),         # 3-D
    ((1, 4, 2, 5, 3), (1, 4, 2, 5, 3)),  # 5-D
    ((4, 3, 5, 3), (4, 3, 5, 3)),   # wrong H
    ((4, 2, 5, 4), (4, 2, 5, 4)),   # wrong d
])
def test_qk_statistics_refuses_wrong_shapes(bad_q, bad_k):
    st = QKStatistics(2, 3)
    with pytest.raises(ValueError, match=r"expected q, k of shape \(B, 2, n, 3\)"):
        st.add_batch(torch.ones(bad_q), torch.ones(bad_k))
    st.add_batch(torch.ones(4, 2, 5, 3), torch.ones(4, 2, 5, 3))  # the right shape is accepted
    assert st.num_images == 4


def test_qk_statistics_devices():
    st = QKStatistics(2, 3, device="meta")
    st.add_batch(torch.ones(1, 2, 5, 3, device="meta"), torch.ones(1, 2, 5, 3, device="meta"))
    assert st.logit_energy.device.type == "meta" and st.logit_energy.dtype == torch.float64
    assert st.grams()[0].device.type == "meta"  # default: the activations' device
    # Grams stored elsewhere than the activations (host memory during a GPU pass)
    st2 = QKStatistics(2, 3, grams_device="meta", gram_dtype=torch.float64)
    q, k = _qk(B=2)
    st2.add_batch(q, k)
    gq, gk = st2.grams()
    assert gq.device.type == gk.device.type == "meta" and gq.dtype == gk.dtype == torch.float32
    assert gq.shape == gk.shape == (2, 2, 3, 3)
    assert st2.logit_energy.device.type == "cpu"
    assert st2.memory_bytes() == 2 * 2 * 2 * 3 * 3 * 4


# ---- QKSystemStatistics -----------------------------------------------------------------------
def test_qk_system_statistics_is_the_kronecker_system_summed_over_images():
    q, k = _rand(3, 2, 6, 5, seed=2), _rand(3, 2, 6, 5, seed=3)
    keep = torch.tensor([[0, 2, 4], [1, 3, 4]])
    prune = [torch.tensor([1, 3]), torch.tensor([0, 2])]
    st = QKSystemStatistics(keep, 5)
    assert st.num_heads == 2 and st.kept == 3 and st.qk_dim == 5 and st.num_images == 0
    assert torch.equal(st.prune, torch.stack(prune))
    st.add_batch(q[:2], k[:2])
    st.add_batch(q[2:], k[2:])
    assert st.num_images == 3
    assert st.k_sys.shape == (2, 9, 9) and st.rhs.shape == (2, 3, 3)
    assert st.k_sys.dtype == st.rhs.dtype == torch.float64
    for h in range(2):
        s, p = keep[h], prune[h]
        k_ref = torch.zeros(9, 9, dtype=torch.float64)
        r_ref = torch.zeros(3, 3, dtype=torch.float64)
        for i in range(3):
            gq = q[i, h].double().T @ q[i, h].double()
            gk = k[i, h].double().T @ k[i, h].double()
            k_ref += torch.kron(gq[s][:, s], gk[s][:, s])
            r_ref += gq[s][:, p] @ gk[p][:, s]
        torch.testing.assert_close(st.k_sys[h], k_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(st.rhs[h], r_ref, rtol=1e-12, atol=1e-12)


def test_qk_system_statistics_device_follows_the_activations():
    keep = torch.tensor([[0, 2]])
    st = QKSystemStatistics(keep, 3, device="meta")
    assert st.k_sys.device.type == "meta" and st.rhs.device.type == "meta"
    assert st.k_sys.shape == (1, 4, 4) and st.rhs.shape == (1, 2, 2)
    st.add_batch(torch.ones(2, 1, 4, 3, device="meta"), torch.ones(2, 1, 4, 3, device="meta"))
    assert st.keep.device.type == "meta" and st.prune.device.type == "meta"
    assert st.num_images == 2
