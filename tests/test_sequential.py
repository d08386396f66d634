"""Sequential calibration (issue 14, METHODS.md §5): the two-stream fits and the streams themselves.

* The two-stream MLP/proj fit (``solve.cross_fit``) and Q/K system (``solve.qk_logit_cross``) reduce
  to CORP's exactly when the streams are equal, and are exact when the dense signal is exactly
  explained by the pruned stream's kept channels.
* Sequential pruning at sparsity 0 changes nothing; the dense and pruned streams entering block i
  are the dense model's and the finished pruned model's block-i inputs; block 0 (equal streams) is
  one-shot CORP's block 0; spilling the streams to disk changes nothing.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.api import prune
from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.calibration.qk_stats import QKStatistics
from edgeprune.corp import CorpConfig
from edgeprune.pruning.corp import corp_prune
from edgeprune.errors import UserError
from edgeprune.plan import pruned_indices
from edgeprune.sequential import CrossStatistics, embed_stream, sequential_prune
from edgeprune.sequential.streams import StreamStore
from edgeprune.solve import mlp_ridge, qk_logit
from edgeprune.solve.cross_fit import cross_affine_map, fold_cross_map
from edgeprune.solve.qk_logit_cross import QKCrossGrams, cross_rhs

from tests.conftest import run_cli


def _correlated(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) @ mix + 3.0).float(), g


# ---------------------------------------------------------------- the two-stream solvers


@pytest.mark.parametrize("alpha", [0.0, 1e-2])
def test_equal_streams_cross_fit_is_the_corp_fold(alpha):
    h, g = _correlated(600, 24, 0)
    own = MLPStatistics(24, torch.float64)
    cross = CrossStatistics(24, torch.float64)
    for part in h.split(200):
        own.add_batch(part)
        cross.add_batch(part, part)
    keep = torch.sort(torch.randperm(24, generator=g)[:10]).values
    prune_ = pruned_indices(keep, 24)
    w = torch.randn(7, 24, generator=g, dtype=torch.float64)
    bias = torch.randn(7, generator=g, dtype=torch.float64)
    bmat, cvec, lam_corp = mlp_ridge.ridge_affine_map(own.mean, own.cov, keep, prune_, alpha)
    w_corp, b_corp = mlp_ridge.fold_into_linear(w, bias, keep, prune_, bmat, cvec)
    t_mat, t_vec, lam = cross_affine_map(cross.mean_dense, own.mean, cross.cov, own.cov, keep, alpha)
    w_seq, b_seq = fold_cross_map(w, bias, t_mat, t_vec)
    assert lam == lam_corp
    torch.testing.assert_close(w_seq, w_corp, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(b_seq, b_corp, rtol=1e-10, atol=1e-11)


def test_cross_fit_is_exact_when_the_dense_input_is_affine_in_the_kept_pruned_channels():
    hp, g = _correlated(500, 16, 1)
    keep = torch.tensor([0, 3, 4, 9, 10, 15])
    a = torch.randn(12, len(keep), generator=g, dtype=torch.float64)
    hd = (hp.double()[:, keep] @ a.T + torch.randn(12, generator=g, dtype=torch.float64))  # dense: 12 channels
    own = MLPStatistics(16, torch.float64)
    own.add_batch(hp)
    # the cross statistic needs equal widths: pad the dense side with zeros
    hd_pad = torch.cat([hd, torch.zeros(500, 4, dtype=torch.float64)], 1)
    cross = CrossStatistics(16, torch.float64)
    cross.add_batch(hd_pad, hp)
    t_mat, t_vec, _ = cross_affine_map(cross.mean_dense, own.mean, cross.cov, own.cov, keep, 0.0)
    w = torch.randn(5, 16, generator=g, dtype=torch.float64)
    w_new, b_new = fold_cross_map(w, None, t_mat, t_vec)
    target = hd_pad @ w.T
    torch.testing.assert_close(hp.double()[:, keep] @ w_new.T + b_new, target, rtol=1e-9, atol=1e-9)


def _qk(n_img, n_tok, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_img, 2, n_tok, d, generator=g) + 0.5
    k = torch.randn(n_img, 2, n_tok, d, generator=g) - 0.3
    return q, k, g


def test_equal_streams_qk_system_is_corps():
    q, k, _ = _qk(12, 20, 8, 2)
    st = QKStatistics(2, 8, gram_dtype=torch.float64)
    st.add_batch(q, k)
    x = QKCrossGrams(2, 8)
    x.add_batch(q.double(), k.double(), q.double(), k.double())
    gq, gk = st.grams()
    xq, xk = x.grams()
    keep = torch.tensor([0, 2, 3, 6, 7])
    for h in range(2):
        _, rhs = qk_logit.kronecker_system(gq[:, h], gk[:, h], keep, pruned_indices(keep, 8))
        torch.testing.assert_close(cross_rhs(gq[:, h], gk[:, h], xq[:, h], xk[:, h], keep), rhs,
                                   rtol=1e-5, atol=1e-3)


def test_qk_cross_system_recovers_dense_logits_that_the_kept_pruned_dims_explain():
    """Dense Q_d = Q~_S A, K_d = K~_S B (any d): the logits are Q~_S (A B^T) K~_S^T, so with alpha 0
    the solve must return M = A B^T - I."""
    qp, kp, g = _qk(10, 16, 8, 3)
    qp, kp = qp.double(), kp.double()
    keep = torch.tensor([1, 2, 5, 6])
    a = torch.randn(4, 8, generator=g, dtype=torch.float64)
    bm = torch.randn(4, 8, generator=g, dtype=torch.float64)
    qd, kd = qp[..., keep] @ a, kp[..., keep] @ bm
    st = QKStatistics(2, 8, gram_dtype=torch.float64)
    st.add_batch(qp, kp)
    x = QKCrossGrams(2, 8)
    x.add_batch(qd, kd, qp, kp)
    gq, gk = st.grams()
    xq, xk = x.grams()
    h = 1
    k_sys, _ = qk_logit.kronecker_system(gq[:, h], gk[:, h], keep, pruned_indices(keep, 8))
    m, _ = qk_logit.solve_logit_compensation(k_sys, cross_rhs(gq[:, h], gk[:, h], xq[:, h], xk[:, h], keep), 0.0)
    torch.testing.assert_close(m, a @ bm.T - torch.eye(4, dtype=torch.float64), rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- end to end on fmnist-vit


def _inputs_of_blocks(model, x):
    """Every block's input for images x (forward pre-hooks)."""
    an = find_anatomy(model)
    seen = {}
    hs = [b.block.register_forward_pre_hook(lambda _m, a, i=b.index: seen.__setitem__(i, a[0].clone()))
          for b in an.blocks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hs:
            h.remove()
    return seen


def _calib(n=48, seed=0):
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


def test_sparsity_zero_changes_nothing(fmnist_model):
    x = _calib()
    res = prune(fmnist_model, x, target="all", sparsity=0.0, sequential=True)
    with torch.no_grad():
        assert torch.equal(res.model(x), fmnist_model(x))
    for p, q in zip(res.model.state_dict().values(), fmnist_model.state_dict().values()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("settings", [dict(target="both", sparsity=0.5, attn_sparsity=0.75),
                                      dict(target="all", sparsity=0.5, attn_sparsity=0.75, head_sparsity=0.5)],
                         ids=["both", "all+heads"])
def test_streams_are_the_dense_and_the_finished_pruned_models_block_inputs(fmnist_model, settings):
    x = _calib()
    model = copy.deepcopy(fmnist_model)
    an = find_anatomy(model)
    cfg = CorpConfig.from_target(**settings, sequential=True)
    seen = {}

    def record(i, dense, pruned):
        seen[i] = (torch.cat([dense.get(j) for j in range(len(dense))]),
                   torch.cat([pruned.get(j) for j in range(len(pruned))]))

    info = sequential_prune(an, lambda: x.split(16), cfg, progress=False, on_block=record)
    assert sorted(seen) == list(range(len(an.blocks)))
    dense_in, pruned_in = _inputs_of_blocks(fmnist_model, x), _inputs_of_blocks(model, x)
    for i, (d, p) in seen.items():
        torch.testing.assert_close(d, dense_in[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p, pruned_in[i], rtol=1e-5, atol=1e-5)
    assert (seen[len(seen) - 1][0] - seen[len(seen) - 1][1]).abs().max() > 1e-3  # the streams differ
    assert info["num_images"] == 48 and info["passes"] == 1
    assert 2.0 <= info["sequential"]["dense_pass_equivalents"] <= 3.0


def test_block_zero_is_one_shot_corp_and_later_blocks_are_not(fmnist_model):
    x = _calib(32, 1)
    one, seq = (prune(fmnist_model, x, target="all", sparsity=0.5, attn_sparsity=0.75, sequential=s).model
                for s in (False, True))
    a, b = find_anatomy(one).blocks, find_anatomy(seq).blocks
    for m in ("fc1", "fc2", "qkv", "proj"):
        torch.testing.assert_close(getattr(b[0], m).weight, getattr(a[0], m).weight, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(getattr(b[0], m).bias, getattr(a[0], m).bias, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(b[-1].fc2.weight, a[-1].fc2.weight, atol=1e-4)


def test_spilled_streams_give_the_same_model_and_are_removed(fmnist_model, monkeypatch):
    x = _calib(16, 2)
    made = []
    real_close = StreamStore.close

    def close(self):
        made.append(self.spill_path)
        real_close(self)

    monkeypatch.setattr(StreamStore, "close", close)
    kw = dict(target="both", sparsity=0.5, attn_sparsity=0.75, sequential=True)
    mem = prune(fmnist_model, x, **kw)
    disk = prune(fmnist_model, x, **kw, sequential_memory_gb=0)
    assert made[0] is None and made[1] is not None and not os.path.exists(made[1])
    with torch.no_grad():
        assert torch.equal(mem.model(x), disk.model(x))


def test_budget_runs_the_allocator_on_dense_statistics_then_the_sequential_pass(fmnist_model, monkeypatch):
    x = _calib(16, 3)
    calls = []

    def select_allocation(anatomy, stats, cfg, batches):
        calls.append(stats.num_images)
        return [{"mlp": 256, "qk": 24} if i % 2 else {"mlp": 128} for i in range(len(anatomy.blocks))], {"fake": True}

    monkeypatch.setattr("edgeprune.allocation.select.select_allocation", select_allocation)
    model = copy.deepcopy(fmnist_model)
    an = find_anatomy(model)
    cfg = CorpConfig.from_target("both", 0.5, attn_sparsity=0.75, sequential=True, budget={"kind": "flops", "value": 0.5})
    info = corp_prune(an, lambda: x.split(8), cfg, progress=False)
    assert calls == [16] and info["allocation"] == {"fake": True} and info["passes"] == 2
    an = find_anatomy(model)
    assert [b.mlp_hidden for b in an.blocks] == [256 if i % 2 else 128 for i in range(len(an.blocks))]
    assert [b.qk_dim for b in an.blocks] == [24 if i % 2 else 16 for i in range(len(an.blocks))]


def test_bad_calibration_data_is_a_user_error(fmnist_model):
    with pytest.raises(UserError, match="calibration set is empty"):
        prune(fmnist_model, lambda: iter([]), target="mlp", sparsity=0.5, sequential=True)
    with pytest.raises(UserError, match="the model takes"):
        prune(fmnist_model, torch.zeros(4, 3, 28, 28), target="mlp", sparsity=0.5, sequential=True)


# ---------------------------------------------------------------- other families


@pytest.mark.parametrize("name,kwargs", [
    ("vit_tiny_patch16_224", {"depth": 2, "img_size": 32}),
    ("deit_tiny_distilled_patch16_224", {"depth": 2, "img_size": 32}),
    ("vit_small_patch14_reg4_dinov2", {"depth": 2, "img_size": 28}),
], ids=["vit", "deit-distilled", "dinov2-reg"])
def test_embedding_and_streams_on_other_families(timm, name, kwargs):
    from tests.test_architectures import _build

    dense, x = _build(timm, name, kwargs)
    vit = dense
    store = StreamStore(1e9)
    emb = embed_stream(find_anatomy(dense), [x], store).get(0)
    with torch.no_grad():
        ref = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))
    torch.testing.assert_close(emb, ref)
    model = copy.deepcopy(dense)
    seen = {}
    sequential_prune(find_anatomy(model), lambda: [x], CorpConfig.from_target("all", 0.75, sequential=True),
                     progress=False, on_block=lambda i, d, p: seen.__setitem__(i, (d.get(0).clone(), p.get(0).clone())))
    torch.testing.assert_close(seen[1][0], _inputs_of_blocks(dense, x)[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen[1][1], _inputs_of_blocks(model, x)[1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- CLI


def test_cli_sequential_prunes_and_records_it(tmp_path):
    out = tmp_path / "run"
    res = run_cli(["prune", "--model", "fmnist-vit", "--target", "mlp", "--sparsity", "0.5", "--sequential",
                   "--calib-size", "16", "--batch-size", "8", "--no-eval", "--quiet", "-o", str(out)])
    assert res.exit_code == 0, res.output
    from edgeprune.artifact import load_run

    model, rec = load_run(out)
    assert rec["config"]["sequential"] is True
    assert [b.mlp_hidden for b in find_anatomy(model).blocks] == [256] * 6



def test_cross_statistics_means_of_float32_data_with_a_large_mean_are_exact():
    """float32 products over shifted data: the means add back exactly the shift that was
    subtracted (a float64 shift added back after subtracting its float32 rounding was off by
    ~5e-4 at 1e4)."""
    g = torch.Generator().manual_seed(3)
    d = (1e4 + torch.rand(2, 5, 8, generator=g)).float()
    p = (-1e4 + torch.rand(2, 5, 8, generator=g)).float()
    cross = CrossStatistics(8)  # float32 Gram
    for i in range(2):
        cross.add_batch(d[i], p[i])
    assert torch.allclose(cross.mean_dense, d.double().reshape(-1, 8).mean(0), rtol=0, atol=1e-9)
    assert torch.allclose(cross.mean_pruned, p.double().reshape(-1, 8).mean(0), rtol=0, atol=1e-9)
    ref = torch.cov(torch.cat([d.double().reshape(-1, 8), p.double().reshape(-1, 8)], 1).T, correction=0)[:8, 8:]
    assert torch.allclose(cross.cov, ref, rtol=0, atol=1e-4)
