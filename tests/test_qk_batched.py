"""Issue 29: the Q/K compensation system is assembled for all heads of a layer in one batched op
(``qk_logit.kronecker_systems``, batch dim = heads) instead of a loop of small ops per head. It must
be the per-head system to float64 round-off, and a whole prune must not change."""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune.calibration.qk_stats import QKStatistics, QKSystemStatistics
from edgeprune.plan import pruned_indices
from edgeprune.solve import qk_logit


def _reference_system(gq: torch.Tensor, gk: torch.Tensor, keep: torch.Tensor, prune: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head assembly as it was before the batching (one head, (N, d_h, d_h) Grams): kept
    blocks widened to float64, the right side as one GEMM over (image, pruned dim), the packed
    upper triangles of the symmetrised Grams multiplied and unpacked by ``torch.take``."""
    gq_s, gk_s = gq[:, keep].double(), gk[:, :, keep].double()
    d, np_ = len(keep), gq.shape[0] * len(prune)
    rhs = gq_s[:, :, prune].permute(1, 0, 2).reshape(d, np_) @ gk_s[:, prune].reshape(np_, d)
    gq_ss, gk_ss = gq_s[:, :, keep], gk_s[:, keep]
    rows, cols = torch.triu_indices(d, d)
    p = rows.numel()
    pos = torch.empty(d, d, dtype=torch.int64)
    pos[rows, cols] = torch.arange(p)
    pos[cols, rows] = torch.arange(p)
    flat = (pos[:, None, :, None] * p + pos[None, :, None, :]).reshape(-1)
    packed = lambda g: 0.5 * (g[:, rows, cols] + g[:, cols, rows])  # noqa: E731
    k_sys = torch.take(packed(gq_ss).T @ packed(gk_ss), flat).reshape(d * d, d * d)
    return k_sys, rhs


def _grams(n: int, h: int, d_h: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, tokens, d_h, generator=g) * torch.rand(1, h, 1, d_h, generator=g) * 3
    k = torch.randn(n, h, tokens, d_h, generator=g) + 0.5
    return q.transpose(-1, -2) @ q, k.transpose(-1, -2) @ k  # float32, not bitwise symmetric


def _keep_sets(h: int, d_h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keep = torch.stack([torch.randperm(d_h, generator=g)[:d].sort().values for _ in range(h)])
    return keep, torch.stack([pruned_indices(k, d_h) for k in keep])


@pytest.mark.parametrize("n,h,d_h,d", [(7, 3, 12, 5), (1, 1, 8, 8), (20, 4, 16, 8)])
def test_batched_system_equals_the_per_head_one(n, h, d_h, d):
    gq, gk = _grams(n, h, d_h, 9, seed=n + h)
    keep, prune = _keep_sets(h, d_h, d, seed=d)
    k_all, rhs_all = qk_logit.kronecker_systems(gq, gk, keep, prune)
    assert k_all.shape == (h, d * d, d * d) and rhs_all.shape == (h, d, d)
    assert k_all.dtype == rhs_all.dtype == torch.float64
    for j in range(h):
        k_ref, rhs_ref = _reference_system(gq[:, j], gk[:, j], keep[j], prune[j])
        # float64 round-off of the sums (relative to the entries' magnitudes); in practice bitwise
        scale_k, scale_r = float(k_ref.abs().max()), float(rhs_ref.abs().max()) + 1e-300
        assert float((k_all[j] - k_ref).abs().max()) <= 64 * 2.2e-16 * n * scale_k, j
        assert float((rhs_all[j] - rhs_ref).abs().max()) <= 64 * 2.2e-16 * n * d_h * scale_r, j
        assert torch.equal(k_all[j], k_all[j].T)
        # the public per-head entry points are the batched ones with H = 1 (a batched GEMM of
        # another batch size may take another kernel for tiny matrices: equal to round-off)
        k1, rhs1 = qk_logit.kronecker_system(gq[:, j], gk[:, j], keep[j], prune[j])
        torch.testing.assert_close(k1, k_all[j], rtol=1e-13, atol=1e-13 * scale_k)
        torch.testing.assert_close(rhs1, rhs_all[j], rtol=1e-12, atol=1e-12 * scale_r)
        gq_ss, gk_ss, rhs2 = qk_logit.kept_blocks(gq[:, j], gk[:, j], keep[j], prune[j])
        assert torch.equal(gq_ss, gq[:, j].double()[:, keep[j]][:, :, keep[j]])
        assert torch.equal(gk_ss, gk[:, j].double()[:, keep[j]][:, :, keep[j]])
        assert torch.equal(rhs2, rhs1)


def test_batched_system_without_pruned_dims_has_a_zero_right_side():
    gq, gk = _grams(4, 2, 6, 7, seed=1)
    keep = torch.arange(6).repeat(2, 1)
    k_all, rhs_all = qk_logit.kronecker_systems(gq, gk, keep, torch.zeros(2, 0, dtype=torch.int64))
    assert torch.equal(rhs_all, torch.zeros(2, 6, 6, dtype=torch.float64))
    assert torch.equal(k_all[1], _reference_system(gq[:, 1], gk[:, 1], keep[1], keep[1][:0])[0])


def test_system_statistics_accumulate_all_heads_like_the_per_head_loop():
    """QKSystemStatistics.add_batch (one batched assembly per batch) == the old per-head loop."""
    g = torch.Generator().manual_seed(3)
    h, d_h = 3, 10
    keep, prune = _keep_sets(h, d_h, 6, seed=2)
    st = QKSystemStatistics(keep, d_h)
    k_ref = torch.zeros(h, 36, 36, dtype=torch.float64)
    rhs_ref = torch.zeros(h, 6, 6, dtype=torch.float64)
    for b in (5, 2):
        q, k = torch.randn(b, h, 11, d_h, generator=g), torch.randn(b, h, 11, d_h, generator=g)
        st.add_batch(q, k)
        qd, kd = q.double(), k.double()
        for j in range(h):
            ks, rhs = _reference_system((qd.transpose(-1, -2) @ qd)[:, j], (kd.transpose(-1, -2) @ kd)[:, j],
                                        keep[j], prune[j])
            k_ref[j] += ks
            rhs_ref[j] += rhs
    assert st.num_images == 7
    torch.testing.assert_close(st.k_sys, k_ref, rtol=1e-13, atol=0)
    torch.testing.assert_close(st.rhs, rhs_ref, rtol=1e-13, atol=1e-13 * float(rhs_ref.abs().max()))
    with pytest.raises(ValueError, match="expected q, k"):
        st.add_batch(torch.zeros(1, h, 11, d_h + 1), torch.zeros(1, h, 11, d_h + 1))


def test_statistics_to_moves_the_accumulators_once_and_keeps_them_equal():
    g = torch.Generator().manual_seed(0)
    st = QKStatistics(2, 4)
    for b in (3, 2):
        st.add_batch(torch.randn(b, 2, 5, 4, generator=g), torch.randn(b, 2, 5, 4, generator=g))
    gq, gk = st.grams()
    score = st.logit_energy.clone()
    assert st.to("cpu") is st and torch.equal(st.logit_energy, score)
    assert len(st._gq) == 2  # already there: no copy, no concatenation
    st.to(torch.device("meta"))  # another device: concatenated, one tensor per side, then moved
    assert len(st._gq) == len(st._gk) == 1 and st._gq[0].device.type == "meta" and st._score.device.type == "meta"
    assert st._gq[0].shape == gq.shape
    assert st.to("meta").grams_device is None  # None (= the activations' device) stays None
    st2 = QKStatistics(2, 4, grams_device="cpu")
    st2.to("meta")
    assert st2.grams_device == torch.device("meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_statistics_to_cuda_and_back_keeps_the_values():
    g = torch.Generator().manual_seed(0)
    st = QKStatistics(2, 4)
    for b in (3, 2, 4):
        st.add_batch(torch.randn(b, 2, 5, 4, generator=g), torch.randn(b, 2, 5, 4, generator=g))
    gq, gk = st.grams()
    score = st.logit_energy.clone()
    st.to("cuda").to("cpu")
    assert torch.equal(st.grams()[0], gq) and torch.equal(st.grams()[1], gk)
    assert torch.equal(st.logit_energy, score)


def test_system_statistics_to_moves_everything():
    keep, _ = _keep_sets(2, 6, 4, seed=0)
    st = QKSystemStatistics(keep, 6)
    assert st.to("meta") is st
    assert {t.device.type for t in (st.k_sys, st.rhs, st.keep, st.prune)} == {"meta"}
    with pytest.raises(ValueError, match="device"):
        st.add_batch(torch.zeros(1, 2, 3, 6), torch.zeros(1, 2, 3, 6))


def test_prune_is_unchanged_by_the_batched_assembly(monkeypatch):
    """A whole two-pass prune (the Q/K system accumulated batch by batch in QKSystemStatistics)
    with the batched assembly equals the same prune with the per-head reference loop, bitwise."""
    import edgeprune
    from tests.conftest import tiny_vit

    def per_head(gq, gk, keep, prune):
        out = [_reference_system(gq[:, j], gk[:, j], keep[j], prune[j]) for j in range(keep.shape[0])]
        return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])

    x = torch.randn(12, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    model = tiny_vit()
    kw = dict(target="both", sparsity=0.5, progress=False, batch_size=4, device="cpu", qk_memory_limit_gb=1e-9)
    new = edgeprune.prune(copy.deepcopy(model), x, **kw).model.state_dict()
    monkeypatch.setattr(qk_logit, "kronecker_systems", per_head)
    old = edgeprune.prune(copy.deepcopy(model), x, **kw).model.state_dict()
    assert new.keys() == old.keys()
    for key in new:
        assert torch.equal(new[key], old[key]), key
