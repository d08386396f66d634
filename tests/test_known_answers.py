"""Known-answer tests: each expected value is computed independently of the function under test
(by hand, by numpy, by torch's own FLOP counter, or directly from the definition), so a bug in the
function cannot move the expectation with it (issue 17)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeprune.errors import UserError
from edgeprune.ranking import top_k_indices


# ---- ranking: top_k_indices keeps the LARGEST scores -------------------------------------------
def test_top_k_indices_returns_the_largest_scores():
    scores = torch.tensor([0.1, 5.0, 3.0, 4.0, -1.0, 2.0], dtype=torch.float64)
    assert top_k_indices(scores, 3).tolist() == [1, 2, 3]
    assert top_k_indices(scores, 1).tolist() == [1]
    assert top_k_indices(scores, 6).tolist() == [0, 1, 2, 3, 4, 5]
    assert top_k_indices(scores, 3).dtype == torch.int64


def test_top_k_indices_per_head_and_ties():
    scores = torch.tensor([[1.0, 9.0, 3.0, 7.0],
                           [8.0, 0.0, 6.0, 2.0]])
    assert top_k_indices(scores, 2).tolist() == [[1, 3], [0, 2]]
    # ties go to the lower index, deterministically
    assert top_k_indices(torch.ones(5), 2).tolist() == [0, 1]
    assert top_k_indices(torch.tensor([2.0, 1.0, 2.0, 2.0]), 2).tolist() == [0, 2]
    # many ties (an unstable sort reorders them from ~100 elements on): the lowest indices win
    x = torch.zeros(2, 100)
    x[:, ::3] = 1.0
    ones = list(range(0, 100, 3))
    expected = sorted(ones + [1, 2, 4, 5, 7, 8])
    assert top_k_indices(x, 40).tolist() == [expected, expected]


def test_top_k_indices_matches_brute_force_on_random_scores():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 40, generator=g, dtype=torch.float64)
    got = top_k_indices(scores, 12)
    for h in range(3):
        expected = sorted(np.argsort(-scores[h].numpy(), kind="stable")[:12].tolist())
        assert got[h].tolist() == expected
        # every kept score beats every pruned score
        kept = scores[h][got[h]]
        mask = torch.ones(40, dtype=torch.bool)
        mask[got[h]] = False
        assert kept.min() > scores[h][mask].max()


# ---- Q/K logit energy = E_i[ ||q_j||^2 ||k_j||^2 ] ---------------------------------------------
def test_qk_logit_energy_known_answer():
    from edgeprune.calibration.qk_stats import QKStatistics

    g = torch.Generator().manual_seed(1)
    B, H, n, d = 5, 2, 7, 4
    # different scales per dim so that a wrong Gram (q for k, or the token Gram) changes the answer
    q = torch.randn(B, H, n, d, generator=g) * torch.tensor([1.0, 2.0, 0.5, 3.0])
    k = torch.randn(B, H, n, d, generator=g) * torch.tensor([3.0, 0.2, 1.0, 1.5])
    st = QKStatistics(H, d, gram_dtype=torch.float64)
    st.add_batch(q[:2], k[:2])
    st.add_batch(q[2:], k[2:])
    expected = torch.zeros(H, d, dtype=torch.float64)
    for i in range(B):
        for h in range(H):
            for j in range(d):
                qn = float((q[i, h, :, j].double() ** 2).sum())
                kn = float((k[i, h, :, j].double() ** 2).sum())
                expected[h, j] += qn * kn / B
    torch.testing.assert_close(st.logit_energy, expected, rtol=1e-10, atol=0)
    # the stored Grams are the per-image d x d Grams Q^T Q and K^T K
    gq, gk = st.grams()
    assert gq.shape == (B, H, d, d)
    torch.testing.assert_close(gq[3, 1].double(), q[3, 1].double().T @ q[3, 1].double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gk[3, 1].double(), k[3, 1].double().T @ k[3, 1].double(), rtol=1e-5, atol=1e-5)


def test_qk_logit_energy_from_a_real_model_matches_hooked_queries_and_keys(timm):
    """Through the calibration pass: the score equals the definition computed from the q and k
    that timm's own attention produces (hooked at ``attn.qkv``, split the timm way)."""
    from edgeprune.anatomy import find_anatomy
    from edgeprune.calibration.collect import collect_statistics
    from edgeprune.ranking import qk_scores

    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=2, img_size=64).eval()
    an = find_anatomy(model)
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    seen = {}

    def hook(i):
        def f(_m, _a, out):
            B, N, _ = out.shape
            qkv = out.reshape(B, N, 3, an.blocks[i].num_heads, -1).permute(2, 0, 3, 1, 4)  # timm's split
            seen[i] = (qkv[0].double(), qkv[1].double())
        return f

    hs = [b.qkv.register_forward_hook(hook(b.index)) for b in an.blocks]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    stats = collect_statistics(an, [x[:2], x[2:]], mlp=False, qk=True, progress=False)
    for b in an.blocks:
        q, k = seen[b.index]  # (B, H, n, d)
        expected = ((q ** 2).sum(2) * (k ** 2).sum(2)).mean(0)  # E_i[||q_j||^2 ||k_j||^2], (H, d)
        torch.testing.assert_close(qk_scores(stats.qk[b.index]), expected, rtol=1e-4, atol=0)


# ---- FLOPs of a pruned block with qk_dim != v_dim ----------------------------------------------
def test_pruned_block_flops_match_torch_flop_counter(timm):
    from torch.utils.flop_counter import FlopCounterMode

    from edgeprune.anatomy import find_anatomy
    from edgeprune.flops import model_flops
    from edgeprune.surgery import apply_structure, block_dims

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=2).eval()
    an = find_anatomy(model)
    dims = block_dims(an)
    dims[0].update(qk_dim=16, v_dim=64, mlp_hidden=384)   # Q/K pruned, V dense
    dims[1].update(qk_dim=64, v_dim=24, mlp_hidden=768)   # V pruned, Q/K dense
    apply_structure(model, dims)
    an = find_anatomy(model)
    assert [(b.qk_dim, b.v_dim, b.mlp_hidden) for b in an.blocks] == [(16, 64, 384), (64, 24, 768)]
    for b in an.blocks:
        if hasattr(b.attn, "fused_attn"):
            b.attn.fused_attn = False
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    per_module = fc.get_flop_counts()
    ours = model_flops(an)
    assert ours["total"] == pytest.approx(fc.get_total_flops(), rel=0.002)
    # per block, exactly (attention + MLP matmuls are all the counter sees there)
    for i, b in enumerate(ours["blocks"]):
        counted = sum(per_module[f"VisionTransformer.blocks.{i}"].values())
        assert b["total"] == counted, (i, b, counted)
    # and the hand count of block 0: n=197, D=192, H=3, d_qk=16, d_v=64, D_mlp=384
    n, D, H = 197, 192, 3
    hand = 2 * n * D * H * (2 * 16 + 64) + 2 * n * n * H * (16 + 64) + 2 * n * H * 64 * D + 4 * n * D * 384
    assert ours["blocks"][0]["total"] == hand


# ---- NuWa retained energy uses s^2 -------------------------------------------------------------
def test_nuwa_retained_energy_uses_squared_singular_values():
    from edgeprune.nuwa.ofp_mha import energy_ratios, rank_for_energy, retained_energy

    s = torch.tensor([[2.0, 1.0]])          # one head
    assert retained_energy(s, 1) == pytest.approx(0.8)   # 4 / (4 + 1), not 2 / 3
    assert retained_energy(s, 2) == pytest.approx(1.0)
    two_heads = torch.tensor([[2.0, 1.0], [1.0, 1.0]])  # mean over heads of 0.8 and 0.5
    torch.testing.assert_close(energy_ratios(two_heads), torch.tensor([0.65, 1.0], dtype=torch.float64))
    s8 = torch.tensor([[3.0, 1.0, 1.0, 1.0]])  # 9/12 = 0.75 at rank 1, 10/12 at rank 2
    assert rank_for_energy(s8, 0.74, round_to=1) == 1
    assert rank_for_energy(s8, 0.80, round_to=1) == 2
    assert rank_for_energy(s8, 0.90, round_to=1) == 3


# ---- latency percentiles ----------------------------------------------------------------------
def _summarize_latencies():
    try:
        from runners.report import summarize_latencies  # noqa: F401
    except ImportError:
        from runners.base import summarize_latencies
    return summarize_latencies


def test_latency_percentiles_known_values():
    out = _summarize_latencies()([float(v) for v in range(1, 101)])
    assert out["p50"] == pytest.approx(50.5)
    assert out["p90"] == pytest.approx(90.1)
    assert out["p99"] == pytest.approx(99.01)
    assert out["mean"] == pytest.approx(50.5)
    assert out["min"] == 1.0 and out["max"] == 100.0
    if "p10" in out:
        assert out["p10"] == pytest.approx(10.9)
    # order does not matter
    shuffled = list(range(100, 0, -1))
    assert _summarize_latencies()(shuffled)["p90"] == pytest.approx(90.1)


def test_ratio_percentiles_known_values():
    from runners.compare import ratio_stats

    a = [float(v) for v in range(1, 101)]
    out = ratio_stats(a, [1.0] * 100)
    assert out["median"] == pytest.approx(50.5)
    assert out["p10"] == pytest.approx(10.9)
    assert out["p90"] == pytest.approx(90.1)
    assert out["mean"] == pytest.approx(50.5)


# ---- kronecker_system is float64 ---------------------------------------------------------------
def test_kronecker_system_is_float64_and_matches_the_definition():
    from edgeprune.solve.qk_logit import kronecker_system

    g = torch.Generator().manual_seed(4)
    n_img, d = 3, 5
    q = torch.randn(n_img, 9, d, generator=g)
    k = torch.randn(n_img, 9, d, generator=g)
    gq, gk = q.transpose(1, 2) @ q, k.transpose(1, 2) @ k     # float32 inputs
    keep, prune = torch.tensor([0, 2, 3]), torch.tensor([1, 4])
    k_sys, rhs = kronecker_system(gq, gk, keep, prune)
    assert k_sys.dtype == torch.float64 and rhs.dtype == torch.float64
    gq64, gk64 = gq.double(), gk.double()
    exp_k = sum(torch.kron(gq64[i][keep][:, keep], gk64[i][keep][:, keep]) for i in range(n_img))
    exp_rhs = sum(gq64[i][keep][:, prune] @ gk64[i][prune][:, keep] for i in range(n_img))
    torch.testing.assert_close(k_sys, exp_k, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(rhs, exp_rhs, rtol=1e-12, atol=1e-9)


def test_kronecker_system_uses_the_symmetrised_grams_and_is_exactly_symmetric():
    """The packed assembly (upper triangles only) equals the full-product definition on the
    symmetrised Grams, also when the inputs are not bitwise symmetric, and K == K^T bitwise."""
    from edgeprune.solve.qk_logit import kronecker_system

    g = torch.Generator().manual_seed(5)
    n_img, d_h, d = 40, 16, 10
    q = torch.randn(n_img, 30, d_h, generator=g)
    gq = q.transpose(1, 2) @ q
    gk = gq.flip(0) + 1e-3 * torch.randn(n_img, d_h, d_h, generator=g)   # not symmetric
    keep = torch.randperm(d_h, generator=g)[:d].sort().values
    prune = torch.tensor(sorted(set(range(d_h)) - set(keep.tolist())))
    k_sys, _ = kronecker_system(gq, gk, keep, prune)
    assert torch.equal(k_sys, k_sys.T)
    sym = lambda t: 0.5 * (t + t.transpose(1, 2))  # noqa: E731
    gq64, gk64 = sym(gq.double()[:, keep][:, :, keep]), sym(gk.double()[:, keep][:, :, keep])
    exp_k = sum(torch.kron(gq64[i], gk64[i]) for i in range(n_img))
    torch.testing.assert_close(k_sys, exp_k, rtol=1e-12, atol=1e-9)


# ---- verify: agreement between two models, rtol on the reference side --------------------------
def _compare_outputs():
    from exporters.verify import compare_outputs

    return compare_outputs


def test_verify_top1_agreement_compares_the_two_outputs():
    cmp = _compare_outputs()
    ref = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=np.float32)
    other = ref.copy()
    other[0] = [2.0, 1.0, 0.0]   # image 0: class 0 instead of 1
    rep = cmp(other, ref, output_kind="logits", atol=1e-4)
    assert rep["agreement"] == pytest.approx(0.75)
    assert rep["agreement_metric"] == "top1_agreement"
    assert rep["max_abs_diff"] == pytest.approx(2.0)
    assert not rep["passed"]
    assert cmp(ref, ref, output_kind="logits")["agreement"] == 1.0


def test_verify_agreement_of_two_different_models_is_below_one():
    cmp = _compare_outputs()
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    m1, m2 = torch.nn.Linear(8, 5), torch.nn.Linear(8, 5)
    with torch.no_grad():
        a, b = m1(x).numpy(), m2(x).numpy()
    expected = float(np.mean(a.argmax(1) == b.argmax(1)))
    assert expected < 0.9
    rep = cmp(a, b, output_kind="logits")
    assert rep["agreement"] == pytest.approx(expected)
    assert not rep["passed"]


def test_verify_rtol_scales_with_the_reference_side():
    """Pass iff |onnx - torch| <= atol + rtol * |torch| (torch is the reference)."""
    cmp = _compare_outputs()
    ref = np.array([[100.0, 1.0]], dtype=np.float32)
    # each case gives a different verdict with the tolerance taken from the other side
    onnx_small = np.array([[90.5, 1.0]], dtype=np.float32)   # diff 9.5 <= 0.1*100 = 10, > 0.1*90.5
    assert cmp(onnx_small, ref, output_kind="logits", atol=0.0, rtol=0.1)["passed"]
    ref2 = np.array([[90.5, 1.0]], dtype=np.float32)
    onnx_big = np.array([[100.0, 1.0]], dtype=np.float32)    # diff 9.5 > 0.1*90.5, <= 0.1*100
    assert not cmp(onnx_big, ref2, output_kind="logits", atol=0.0, rtol=0.1)["passed"]
    # atol and rtol add up
    assert cmp(onnx_big, ref2, output_kind="logits", atol=0.5, rtol=0.1)["passed"]
    assert not cmp(onnx_big, ref2, output_kind="logits", atol=0.4, rtol=0.1)["passed"]


# ---- ONNX: output batch axis named as in the metadata ------------------------------------------
def test_onnx_batch_axis_names_match_the_metadata(tmp_path):
    import onnx

    from exporters.onnx import export_onnx, read_metadata

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 4, 3)).eval()
    path = export_onnx(model, tmp_path / "m.onnx", (2, 4, 4), {"note": "x"}, fold_constants=False)
    md = read_metadata(path)
    proto = onnx.load(str(path))
    in_dims = [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    out_dims = [d.dim_param or d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim]
    assert md["input_shape"] == in_dims == ["batch", 2, 4, 4]
    assert md["output_shape"] == out_dims == ["batch", 3]
    assert md["output_shape"][0] == md["input_shape"][0]
    assert md["input_name"] == proto.graph.input[0].name and md["output_name"] == proto.graph.output[0].name


def test_user_error_is_raised_for_bad_top_k_criterion():
    from edgeprune.ranking import mlp_scores

    with pytest.raises(UserError, match="criterion"):
        mlp_scores(None, torch.zeros(2, 2), criterion="nope")  # type: ignore[arg-type]


def test_inputs_within_tolerance_counts_the_inputs_that_match_everywhere():
    """verify's per-input count (issue 55: a merged model's near-tied matches fail a few inputs, not all)."""
    from exporters.agreement import compare_outputs as agreement

    ref = np.zeros((5, 2, 3))
    out = ref.copy()
    out[1, 0, 2] = 1e-3  # one element of input 1
    out[3] = 1e-3  # every element of input 3
    rep = agreement(out, ref, output_kind="dense", atol=1e-4)
    assert rep.inputs_within_tolerance == 3 and not rep.passed
    assert agreement(ref, ref, output_kind="dense").inputs_within_tolerance == 5
