"""Known-answer tests of the embed slicing and the quantization code, added for the mutation check
of issue 43 (tools/mutation_check.py modules ``embed``, ``smoothquant``, ``gptq``, ``quant_fallback``).

Every expected value is computed independently here (float64 products written out, GPTQ in its
inverse-Hessian form of Frantar & Alistarh 2022 instead of the Cholesky form of the library,
SmoothQuant's eq. 4 by hand), never read back from the code under test.
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from onnx import TensorProto, helper, numpy_helper

from edgeprune._compat import import_timm
from edgeprune.errors import UserError

import_timm()  # at import: mutmut's fork server collects this file once, so its workers inherit timm

from tests.test_embed import _vit as embed_vit  # noqa: E402

# ----------------------------------------------------------------------------------------- helpers


def _vit(**kw) -> nn.Module:
    """test_embed's seeded 2-block ViT (random LayerNorm affines, prefix tokens), at width 16 with one register."""
    return embed_vit(**{**dict(img_size=8, num_classes=3, embed_dim=16, mlp_ratio=2.0, reg_tokens=1), **kw})


def _images(n: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _u_moment(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, int]:
    """sum u u^T and the row count of LayerNorm inputs x (..., D), by hand in float64."""
    r = x.reshape(-1, x.shape[-1]).double()
    r = r - r.mean(1, keepdim=True)
    u = r / torch.sqrt((r * r).mean(1, keepdim=True) + eps)
    return u.T @ u, r.shape[0]


# ------------------------------------------------------------------------------------------- embed


class TestEmbed:
    def test_embed_centring_is_identity_minus_ones_over_d(self):
        from edgeprune.embed.fold import centring

        for d in (2, 5):
            c = centring(d)
            want = np.eye(d) - np.ones((d, d)) / d
            assert c.dtype == torch.float64 and c.shape == (d, d)
            np.testing.assert_allclose(c.numpy(), want, atol=1e-15)

    def test_embed_affine_fold_is_the_explicit_product(self):
        from edgeprune.embed.fold import _fold_affine

        torch.manual_seed(0)
        norm = nn.LayerNorm(6).double()
        lin = nn.Linear(6, 4).double()
        with torch.no_grad():
            norm.weight.uniform_(0.5, 2.0)
            norm.bias.normal_()
        g, beta = norm.weight.detach().clone(), norm.bias.detach().clone()
        w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
        x = torch.randn(5, 6, dtype=torch.float64)
        ref = lin(norm(x)).detach()
        _fold_affine(norm, [lin])
        np.testing.assert_allclose(lin.weight.detach().numpy(), (w @ torch.diag(g)).float().numpy(), rtol=1e-6)
        np.testing.assert_allclose(lin.bias.detach().numpy(), (b + w @ beta).float().numpy(), rtol=1e-6)
        assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0)
        assert torch.allclose(lin(norm(x)), ref, atol=1e-5)

    def test_embed_affine_fold_without_bias_or_gamma(self):
        from edgeprune.embed.fold import _fold_affine

        norm = nn.LayerNorm(4, bias=False).double()
        with torch.no_grad():
            norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        lin = nn.Linear(4, 2, bias=False).double()
        w = lin.weight.detach().clone()
        _fold_affine(norm, [lin])  # no beta: a reader without bias is fine
        np.testing.assert_allclose(lin.weight.detach().numpy(), (w * torch.tensor([1.0, 2, 3, 4])).numpy(),
                                   rtol=1e-6)
        assert lin.bias is None and torch.all(norm.weight == 1)
        biased = nn.LayerNorm(4).double()
        with torch.no_grad():
            biased.bias.fill_(0.5)
        with pytest.raises(UserError, match="no bias"):
            _fold_affine(biased, [nn.Linear(4, 2, bias=False).double()])
        plain = nn.LayerNorm(4, elementwise_affine=False).double()
        lin2 = nn.Linear(4, 2).double()
        before = (lin2.weight.detach().clone(), lin2.bias.detach().clone())
        _fold_affine(plain, [lin2])  # nothing to fold
        assert torch.equal(lin2.weight, before[0]) and torch.equal(lin2.bias, before[1])

    def test_embed_fold_centres_every_writer_and_keeps_the_logits(self):
        from edgeprune.anatomy import find_anatomy
        from edgeprune.embed.fold import fold_centring_and_affine

        model = _vit()
        x = _images()
        ref = model(x).detach()
        folded = copy.deepcopy(model)
        parts = fold_centring_and_affine(find_anatomy(folded))
        assert torch.allclose(folded(x), ref, atol=1e-5)
        # every writer is centred: the stream's token means are 0
        seen = []
        h = folded.blocks[1].register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach()))
        folded(x)
        h.remove()
        assert seen[0].mean(-1).abs().max() < 1e-5
        assert parts.final_norm_name == "norm"
        for b in folded.blocks:
            for n in (b.norm1, b.norm2):
                assert torch.all(n.weight == 1) and torch.all(n.bias == 0)
        assert torch.all(folded.norm.weight == 1) and torch.all(folded.norm.bias == 0)

    def test_embed_ones_complement_by_hand(self):
        from edgeprune.embed.rotate import ones_complement

        u = ones_complement(2)
        assert u.shape == (2, 1)
        np.testing.assert_allclose(np.abs(u.numpy().ravel()), [1 / math.sqrt(2)] * 2, atol=1e-15)
        assert abs(float(u.sum())) < 1e-15
        for d in (3, 6):
            u = ones_complement(d)
            assert u.shape == (d, d - 1) and u.is_contiguous()
            np.testing.assert_allclose((u @ u.T).numpy(), np.eye(d) - 1.0 / d, atol=1e-12)
        with pytest.raises(UserError):
            ones_complement(1)

    def test_embed_principal_basis_is_the_top_eigenspace_of_the_centred_moment(self):
        from edgeprune.embed.rotate import principal_basis

        rng = np.random.default_rng(0)
        a = rng.normal(size=(6, 6))
        m = a @ a.T + 3.0 * np.ones((6, 6)) + np.diag([5.0, 0, 0, 0, 0, 0])
        c = np.eye(6) - 1.0 / 6
        ev, vec = np.linalg.eigh(c @ m @ c)
        order = np.argsort(ev)[::-1]
        v, evals = principal_basis(torch.tensor(m), 3)
        assert v.shape == (6, 3) and evals.shape == (5,)
        np.testing.assert_allclose(evals.numpy(), ev[order][:5], atol=1e-10)  # the 0 of the ones vector dropped
        top = vec[:, order[:3]]
        np.testing.assert_allclose((v @ v.T).numpy(), top @ top.T, atol=1e-10)
        np.testing.assert_allclose((v.T @ v).numpy(), np.eye(3), atol=1e-12)

    def test_embed_rotation_at_full_width_keeps_the_logits(self):
        from edgeprune.anatomy import find_anatomy
        from edgeprune.embed.fold import fold_centring_and_affine
        from edgeprune.embed.rotate import ones_complement, rotate_and_slice

        model = _vit()
        x = _images()
        ref = model(x).detach()
        an = find_anatomy(model)
        parts = fold_centring_and_affine(an)
        q, _ = torch.linalg.qr(torch.randn(15, 15, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
        v = ones_complement(16) @ q  # any orthonormal basis of the centred subspace: exact at D' = D
        with pytest.raises(UserError, match="basis"):
            rotate_and_slice(an, parts, v[:, :14], 16)
        rotate_and_slice(an, parts, v, 16)
        assert torch.allclose(model(x), ref, atol=1e-5)
        assert model.blocks[0].norm1.normalized_shape == (16,)

    def test_embed_rotation_to_a_smaller_width_is_exact_for_a_stream_in_the_subspace(self):
        from edgeprune.anatomy import find_anatomy
        from edgeprune.embed.covariance import stream_moment
        from edgeprune.embed.fold import fold_centring_and_affine, fold_layerscale, map_writers, stream_parts
        from edgeprune.embed.rotate import principal_basis, rotate_and_slice

        model = _vit()
        an = find_anatomy(model)
        q, _ = torch.linalg.qr(torch.randn(16, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
        fold_layerscale(an)
        map_writers(an, stream_parts(an), q @ q.T)  # every write in one 7-dim subspace
        x = _images(9)
        ref = model(x).detach()
        parts = fold_centring_and_affine(an)
        m, _ = stream_moment(an, parts, [x])
        v, _ = principal_basis(m, 7)
        rotate_and_slice(an, parts, v, 8)  # the centred 7 dims fit in D' = 8 (D' - 1 = 7)
        assert model.blocks[0].norm1.normalized_shape == (8,)
        assert model.blocks[0].norm1.eps == pytest.approx(1e-6 * 16 / 8)
        assert torch.allclose(model(x), ref, atol=1e-4)

    def test_embed_slice_record_by_hand(self):
        from edgeprune.anatomy import find_anatomy
        from edgeprune.embed.covariance import stream_moment
        from edgeprune.embed.fold import fold_centring_and_affine
        from edgeprune.embed.slice import slice_embed

        model = _vit()
        x = _images(7)
        probe = copy.deepcopy(model)
        an = find_anatomy(probe)
        parts = fold_centring_and_affine(an)
        m, _ = stream_moment(an, parts, [x])
        c = np.eye(16) - 1.0 / 16
        ev = np.sort(np.linalg.eigvalsh(c @ m.numpy() @ c))[::-1][:15].clip(0)
        t0 = time.perf_counter()
        new, rec = slice_embed(find_anatomy(model), lambda: iter([x[:3], x[3:]]), 0.5)
        assert 0 <= rec["seconds"] <= time.perf_counter() - t0
        assert rec["embed_dim"] == 8 and rec["dense_embed_dim"] == 16 and new.embed_dim == 8
        assert rec["images"] == 7 and rec["sparsity"] == 0.5 and rec["rotation"] == "single"
        assert rec["eps"] == model.norm.eps and "refit" not in rec
        assert rec["kept_energy"] == pytest.approx(ev[:7].sum() / ev.sum(), rel=1e-6)
        assert model.blocks[1].norm2.eps == pytest.approx(1e-6 * 16 / 8)
        # round_to reaches the width: 16 x 0.7 = 11.2 -> 12 with round_to 4 (8 with the default 8)
        _, rec4 = slice_embed(find_anatomy(_vit()), lambda: iter([x]), 0.3, round_to=4)
        assert rec4["embed_dim"] == 12
        # at sparsity 0 every eigenvalue is kept (the smallest are below 1)
        _, rec0 = slice_embed(find_anatomy(_vit()), lambda: iter([x]), 0.0)
        assert rec0["kept_energy"] == pytest.approx(1.0, abs=1e-9)

    def test_embed_kept_energy_of_a_tiny_moment(self):
        from edgeprune.anatomy import find_anatomy
        from edgeprune.embed.covariance import stream_moment
        from edgeprune.embed.fold import fold_centring_and_affine
        from edgeprune.embed.slice import slice_embed

        model = _vit()
        for n in model.modules():
            if isinstance(n, nn.LayerNorm):
                n.eps = 1e4  # u = x_c / sqrt(|x_c|^2 / D + eps): every u is tiny, the moment's trace < 1
        x = _images(7)
        probe = copy.deepcopy(model)
        an = find_anatomy(probe)
        m, _ = stream_moment(an, fold_centring_and_affine(an), [x])
        c = np.eye(16) - 1.0 / 16
        ev = np.sort(np.linalg.eigvalsh(c @ m.numpy() @ c))[::-1][:15].clip(0)
        assert ev.sum() < 0.1
        _, rec = slice_embed(find_anatomy(model), lambda: iter([x]), 0.5)
        assert rec["kept_energy"] == pytest.approx(ev[:7].sum() / ev.sum(), rel=1e-5)

    def test_embed_refit_default_strength_is_1e_3(self):
        from edgeprune.anatomy import find_anatomy
        from edgeprune.embed.slice import slice_embed

        x = _images(7)
        outs = []
        for kw in ({}, {"refit_alpha": 1e-3}, {"refit_alpha": 1.001}):
            m = _vit()
            _, rec = slice_embed(find_anatomy(m), lambda: iter([x]), 0.5, refit=True, **kw)
            assert rec["refit"]["blocks"] == 2
            outs.append(m(x).detach())
        assert torch.equal(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2], atol=1e-6)

    def test_embed_kept_dim_bounds(self):
        from edgeprune.embed.slice import embed_kept_dim

        assert embed_kept_dim(4, 0.5, 2) == 2  # exactly 2 channels is allowed
        with pytest.raises(UserError, match=r"no dims in the embedding \(residual stream\)"):
            embed_kept_dim(8, 0.99, 8)
        assert embed_kept_dim(16, 0.5) == 8 and embed_kept_dim(16, 0.25, 4) == 12
        with pytest.raises(UserError, match="need >= 2"):
            embed_kept_dim(8, 0.85, 1)  # round(1.2) = 1 channel

    def test_embed_reader_moment_by_hand(self):
        from edgeprune.embed.covariance import ReaderMoment

        norm = nn.LayerNorm(5, eps=0.3)
        x1 = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)) * 3 + 1
        x2 = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
        acc = ReaderMoment(norm)
        with pytest.raises(RuntimeError):
            acc.moment()
        acc.add_batch(x1)
        acc.add_batch(x2)
        s1, n1 = _u_moment(x1, 0.3)
        s2, n2 = _u_moment(x2, 0.3)
        assert acc.count == n1 + n2 == 10
        assert acc.moment().dtype == torch.float64
        np.testing.assert_allclose(acc.moment().numpy(), ((s1 + s2) / 10).numpy(), rtol=1e-5, atol=1e-6)
        first = ReaderMoment(norm, first_token_only=True)
        first.add_batch(x1)
        first.add_batch(x2)  # (B, D): nothing to pick
        s0, n0 = _u_moment(x1[:, 0], 0.3)
        assert first.count == n0 + 4 == 6
        np.testing.assert_allclose(first.moment().numpy(), ((s0 + s2) / 6).numpy(), rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("kw", [{}, dict(global_pool="avg", class_token=False, reg_tokens=0)])
    def test_embed_stream_moment_per_reader_by_hand(self, kw):
        from edgeprune.anatomy import find_anatomy
        from edgeprune.embed.covariance import stream_moment
        from edgeprune.embed.fold import stream_parts

        model = _vit(**kw)
        an = find_anatomy(model)
        parts = stream_parts(an)
        norms = [n for b in model.blocks for n in (b.norm1, b.norm2)] + [parts.final_norm]
        got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(norms))}
        hooks = [n.register_forward_pre_hook(lambda _m, a, i=i: got[i].append(a[0].detach()))
                 for i, n in enumerate(norms)]
        x = _images(5)
        batches = [x[:2], x[2:]]
        model(x[:2]), model(x[2:])
        for h in hooks:
            h.remove()
        per, info = stream_moment(an, parts, iter(batches), per_reader=True)
        total, _ = stream_moment(an, parts, iter(batches))
        assert info["images"] == 5 and info["readers"] == 5 and len(per) == 5 and info["seconds"] >= 0
        token = parts.token_pool and parts.final_norm_name == "norm"
        assert token == (not kw)
        for i, n in enumerate(norms):
            rows = [t[:, 0] if (token and i == 4 and t.dim() == 3) else t for t in got[i]]
            s, cnt = zip(*[_u_moment(r, n.eps) for r in rows])
            np.testing.assert_allclose(per[i].numpy(), (sum(s) / sum(cnt)).numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(total.numpy(), torch.stack(per).sum(0).numpy(), rtol=1e-12)
        assert all(not n._forward_pre_hooks for n in norms)  # hooks removed


# ------------------------------------------------------------------------------------ smoothquant


def _ln_graph(c: int = 4, o: int = 3, bias: bool = True, readers: str = "mm", seed: int = 0) -> onnx.ModelProto:
    """x (N, 1, T, C) -> LayerNorm(gamma[, beta]) -> readers; ``readers``: comma list of
    mm (MatMul W), mm2 (a second MatMul W2), shape (Shape), add (value read), out (graph output),
    wfirst (MatMul with the LN output second), shared (W also read by another MatMul)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 2.0, c).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.normal(0, 1, (c, o)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(0, 1, (c, o)).astype(np.float32), "W2")]
    ln_in = ["x", "gamma"]
    if bias:
        inits.append(numpy_helper.from_array(rng.normal(0, 0.3, c).astype(np.float32), "beta"))
        ln_in.append("beta")
    nodes = [helper.make_node("LayerNormalization", ln_in, ["ln"], name="norm", axis=-1)]
    outs = []
    for r in readers.split(","):
        if r == "mm":
            nodes.append(helper.make_node("MatMul", ["ln", "W"], ["y"], name="mm"))
            outs.append("y")
        elif r == "mm2":
            nodes.append(helper.make_node("MatMul", ["ln", "W2"], ["y2"], name="mm2"))
            outs.append("y2")
        elif r == "shape":
            nodes.append(helper.make_node("Shape", ["ln"], ["sh"], name="shape"))
            outs.append("sh")
        elif r == "add":
            nodes.append(helper.make_node("Add", ["ln", "ln"], ["a"], name="add"))
            outs.append("a")
        elif r == "out":
            outs.append("ln")
        elif r == "shared":
            inits.append(numpy_helper.from_array(rng.normal(0, 1, (o, c)).astype(np.float32), "Z"))
            nodes.append(helper.make_node("MatMul", ["y", "Z"], ["z"], name="other"))
            nodes.append(helper.make_node("MatMul", ["z", "W"], ["zz"], name="reuse"))
            outs.append("zz")
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT if n != "sh" else TensorProto.INT64, None)
          for n in outs]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 5, c])],
                              vi, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer}


def _stats(chan: dict[str, np.ndarray], rows: dict[str, np.ndarray] | None = None, gram=None):
    from exporters.quantization.stats import ActStats

    return ActStats({k: float(v.max()) for k, v in chan.items()}, {k: v.copy() for k, v in chan.items()},
                    dict(rows or {}), {}, 1, dict(gram or {}))


class TestSmoothQuant:
    def test_smooth_scales_by_hand_with_alpha_03(self):
        from exporters.quantization.smoothing import smoothing_scales

        x = np.array([9.0, 0.5, 2.0, 0.0, 3.0, 1e-20, 1e20])
        w = np.array([0.25, 4.0, 0.0, 1.0, 3.0, 1e20, 1e-20])
        s = smoothing_scales(x, w, 0.3)
        want = [9.0 ** 0.3 / 0.25 ** 0.7, 0.5 ** 0.3 / 4.0 ** 0.7, 1.0, 1.0, 3.0 ** 0.3 / 3.0 ** 0.7, 1e-4, 1e4]
        np.testing.assert_allclose(s, want, rtol=1e-12)
        assert s.dtype == np.float64
        s32 = smoothing_scales(np.array([4.0], dtype=np.float32), np.array([0.5], dtype=np.float32), 0.5)
        assert s32.dtype == np.float64

    def test_smooth_find_sites_rule(self):
        from exporters.quantization.smoothing import find_sites

        one = find_sites(_ln_graph(readers="mm,shape,mm2"))
        assert len(one) == 1
        assert (one[0].norm, one[0].output, one[0].scale, one[0].bias, one[0].weights) == \
            ("norm", "ln", "gamma", "beta", ("W", "W2"))
        nob = find_sites(_ln_graph(bias=False))
        assert len(nob) == 1 and nob[0].bias is None
        for readers in ("mm,add", "mm,out", "shape", "shared"):
            assert find_sites(_ln_graph(readers=readers)) == [], readers
        # gamma shared with another node, or not an initializer
        m = _ln_graph()
        m.graph.node.append(helper.make_node("Mul", ["gamma", "gamma"], ["g2"], name="gm"))
        assert find_sites(m) == []
        m = _ln_graph()
        m.graph.node.append(helper.make_node("Mul", ["beta", "beta"], ["b2"], name="bm"))
        assert find_sites(m) == []
        m = _ln_graph()
        m.graph.node[0].input[2] = "x"  # beta not an initializer
        assert find_sites(m) == []
        m = _ln_graph()
        m.graph.node[0].input[1] = "x"
        assert find_sites(m) == []
        m = _ln_graph()
        m.graph.node[1].input[0], m.graph.node[1].input[1] = "W", "ln"  # the LN output as second input
        assert find_sites(m) == []
        m = _ln_graph()
        m.graph.node[0].op_type = "Softmax"
        assert find_sites(m) == []
        m = _ln_graph(bias=False)
        m.graph.node[0].input.append("")  # an empty optional bias name is no bias
        assert find_sites(m)[0].bias is None
        # a 3-D weight is not a (C, out) matrix
        m = _ln_graph()
        w = next(t for t in m.graph.initializer if t.name == "W")
        w.CopyFrom(numpy_helper.from_array(np.ones((4, 3, 1), np.float32), "W"))
        assert find_sites(m) == []

    def test_smooth_weight_absmax_and_fold_by_hand(self):
        from exporters.quantization.smoothing import find_sites, fold_site, site_weight_absmax

        m = _ln_graph(readers="mm,mm2")
        before = _inits(m)
        inits = {t.name: t for t in m.graph.initializer}
        site = find_sites(m)[0]
        amax = site_weight_absmax(inits, site)
        want = np.maximum(np.abs(before["W"]).max(1), np.abs(before["W2"]).max(1))
        np.testing.assert_array_equal(amax, want.astype(np.float64))
        assert amax.dtype == np.float64
        s = np.array([2.0, 0.5, 4.0, 1.0])
        fold_site(inits, site, s)
        after = _inits(m)
        np.testing.assert_allclose(after["gamma"], before["gamma"] / s, rtol=1e-7)
        np.testing.assert_allclose(after["beta"], before["beta"] / s, rtol=1e-7)
        np.testing.assert_allclose(after["W"], before["W"] * s[:, None], rtol=1e-7)
        np.testing.assert_allclose(after["W2"], before["W2"] * s[:, None], rtol=1e-7)
        assert all(after[k].dtype == np.float32 for k in after)

    def test_smooth_choose_alpha_errors_are_output_errors(self):
        from exporters.quantization.search import output_error
        from exporters.quantization.smoothing import choose_alpha, smoothing_scales

        rng = np.random.default_rng(0)
        x = rng.normal(0, 1, (64, 6)).astype(np.float32)
        x[:, 2] *= 40
        ws = [rng.normal(0, 1, (6, 3)).astype(np.float32), rng.normal(0, 2, (6, 2)).astype(np.float32)]
        amax = np.abs(x).max(0).astype(np.float64)
        wmax = np.maximum(np.abs(ws[0]).max(1), np.abs(ws[1]).max(1)).astype(np.float64)
        alpha, s, errs = choose_alpha(x, amax, ws, (None, 0.2, 0.7))
        want = {"None": output_error(x, ws, float(amax.max()))}
        for a in (0.2, 0.7):
            sa = smoothing_scales(amax, wmax, a)
            want[str(a)] = output_error(x, ws, float((amax / sa).max()), sa)
        assert errs == pytest.approx(want, rel=1e-12)
        best = min(want, key=want.get)
        assert str(alpha) == best
        np.testing.assert_allclose(s, np.ones(6) if alpha is None else smoothing_scales(amax, wmax, alpha))
        a0, s0, _ = choose_alpha(x, amax, ws, (None,))
        assert a0 is None and np.array_equal(s0, np.ones(6))

    def test_smooth_stats_rescale_and_alias_by_hand(self):
        rng = np.random.default_rng(1)
        rows = rng.normal(size=(8, 3)).astype(np.float32)
        chan = np.abs(rows).max(0).astype(np.float64)
        g = (rows.T @ rows).astype(np.float64)
        st = _stats({"t": chan}, {"t": rows}, {"t": g})
        st.shapes["t"] = (1, 8, 3)
        s = np.array([2.0, 4.0, 0.5])
        st.alias("t", "u", s)
        np.testing.assert_allclose(st.chan_amax["u"], chan / s)
        assert st.amax["u"] == pytest.approx(float((chan / s).max()))
        np.testing.assert_allclose(st.rows["u"], rows / s, rtol=1e-6)
        np.testing.assert_allclose(st.gram["u"], g / np.outer(s, s), rtol=1e-12)
        assert st.shapes["u"] == (1, 8, 3)
        # the original is untouched
        np.testing.assert_array_equal(st.chan_amax["t"], chan)
        np.testing.assert_array_equal(st.rows["t"], rows)
        np.testing.assert_array_equal(st.gram["t"], g)
        assert st.amax["t"] == float(chan.max())
        st.rescale("t", s)
        np.testing.assert_allclose(st.gram["t"], g / np.outer(s, s), rtol=1e-12)
        assert st.rows["t"].dtype == np.float32
        bare = _stats({"v": chan})
        bare.alias("v", "w", s)
        assert "w" not in bare.rows and "w" not in bare.gram and "w" not in bare.shapes
        np.testing.assert_allclose(bare.chan_amax["w"], chan / s)

    def test_smooth_fold_sites_fixed_alpha_and_search(self):
        from exporters.quantization.smoothing import apply_smoothing, choose_alpha, fold_sites

        m = _ln_graph(readers="mm,mm2")
        before = _inits(m)
        chan = np.array([8.0, 1.0, 0.5, 2.0])
        rows = np.random.default_rng(2).normal(size=(16, 4)).astype(np.float32) * chan.astype(np.float32)
        st = _stats({"ln": chan}, {"ln": rows})
        [(site, alpha, s, errors)] = fold_sites(m, st, 0.4)
        wmax = np.maximum(np.abs(before["W"]).max(1), np.abs(before["W2"]).max(1)).astype(np.float64)
        want = chan ** 0.4 / wmax ** 0.6
        np.testing.assert_allclose(s, want, rtol=1e-12)
        assert alpha == 0.4 and errors == {} and site.norm == "norm"
        np.testing.assert_allclose(_inits(m)["W"], before["W"] * want[:, None], rtol=1e-6)
        np.testing.assert_allclose(st.chan_amax["ln"], chan / want)
        assert st.amax["ln"] == pytest.approx(float((chan / want).max()))
        np.testing.assert_allclose(st.rows["ln"], rows / want, rtol=1e-6)
        # apply_smoothing: None does nothing; a search with only "no smoothing" folds nothing
        m2 = _ln_graph(readers="mm,mm2")
        assert apply_smoothing(m2, _stats({"ln": chan}), None) == []
        assert _inits(m2)["W"].tobytes() == before["W"].tobytes()
        st2 = _stats({"ln": chan}, {"ln": rows})
        rec = apply_smoothing(m2, st2, "search", (None,))
        assert rec == [{"norm": "norm", "alpha": None, "errors": rec[0]["errors"]}] and "None" in rec[0]["errors"]
        assert _inits(m2)["gamma"].tobytes() == before["gamma"].tobytes()
        np.testing.assert_array_equal(st2.chan_amax["ln"], chan)
        rec = apply_smoothing(m2, st2, "search", (0.5,))
        assert rec[0]["alpha"] == 0.5 and set(rec[0]["errors"]) == {"0.5"}
        # the search measures the float32 weights, as the GEMMs hold them
        assert rec[0]["errors"] == choose_alpha(rows, chan, [before["W"], before["W2"]], (0.5,))[2]
        s5 = chan ** 0.5 / wmax ** 0.5
        np.testing.assert_allclose(_inits(m2)["gamma"], before["gamma"] / s5, rtol=1e-6)
        m3 = _ln_graph(readers="mm,mm2")
        assert apply_smoothing(m3, _stats({"ln": chan}), 0.5) == [{"norm": "norm", "alpha": 0.5, "errors": {}}]

    def test_smooth_onnx_report_and_refusal(self, tmp_path):
        from exporters.quantization.smoothing import smooth_onnx

        m = _ln_graph(c=6, o=6, readers="mm")
        src = tmp_path / "a.onnx"
        onnx.save_model(m, str(src))
        x = np.random.default_rng(0).normal(size=(7, 1, 5, 6)).astype(np.float32)
        with pytest.raises(UserError, match="^smooth_alpha must be in"):
            smooth_onnx(src, tmp_path / "b.onnx", x, alpha=1.5)
        for bound in (0.0, 1.0):  # both ends of [0, 1] are allowed
            assert len(smooth_onnx(src, tmp_path / "bound.onnx", x, alpha=bound)) == 1
        [rep] = smooth_onnx(src, tmp_path / "b.onnx", x, alpha=0.5, batch_size=3)
        ini = _inits(m)
        xc = x - x.mean(-1, keepdims=True)
        ln = xc / np.sqrt((xc ** 2).mean(-1, keepdims=True) + 1e-5) * ini["gamma"] + ini["beta"]
        amax = np.abs(ln.reshape(-1, 6)).max(0).astype(np.float64)
        s = np.clip(amax ** 0.5 / np.abs(ini["W"]).max(1).astype(np.float64) ** 0.5, 1e-4, 1e4)
        assert rep["norm"] == "norm" and rep["channels"] == 6
        assert rep["s_min"] == pytest.approx(s.min(), rel=1e-4) and rep["s_max"] == pytest.approx(s.max(), rel=1e-4)
        assert rep["x_range_before"] == pytest.approx(amax.max() / np.median(amax), rel=1e-4)
        after = amax / s
        assert rep["x_range_after"] == pytest.approx(after.max() / np.median(after), rel=1e-4)
        out = _inits(onnx.load(str(tmp_path / "b.onnx")))
        np.testing.assert_allclose(out["W"], ini["W"] * s[:, None].astype(np.float32), rtol=1e-4)
        none = _ln_graph(readers="mm,add")
        onnx.save_model(none, str(src))
        assert smooth_onnx(src, tmp_path / "c.onnx", x) == []
        assert onnx.load(str(tmp_path / "c.onnx")) == none

    def test_smooth_explicit_mul_by_hand(self):
        from exporters.quantization.qdq import find_gemms
        from exporters.quantization.smoothing_explicit import explicit_sites, smooth_explicit

        rng = np.random.default_rng(3)
        w = rng.normal(size=(4, 3)).astype(np.float32)
        inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w.copy(), "W2"),
                 numpy_helper.from_array(rng.normal(size=(3, 3)).astype(np.float32), "V")]
        nodes = [helper.make_node("Relu", ["x"], ["h"], name="act"),
                 helper.make_node("MatMul", ["h", "W"], ["y"], name="/blocks.0/mlp/fc2/MatMul"),
                 helper.make_node("MatMul", ["h", "W2"], ["y2"], name="/blocks.0/mlp/fc1/MatMul"),
                 helper.make_node("MatMul", ["y2", "V"], ["y3"], name="/blocks.1/mlp/fc2/MatMul"),
                 helper.make_node("MatMul", ["y3", "V"], ["y4"], name="/blocks.2/mlp/fc2/MatMul")]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                                  [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "y4")],
                                  inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        gemms = find_gemms(m)
        # V is read twice: no explicit site; fc1 is not of the kinds
        assert [g.name for g in explicit_sites(m, gemms, ("fc2",))] == ["/blocks.0/mlp/fc2/MatMul"]
        assert [g.name for g in explicit_sites(m, gemms, ("fc1", "fc2"))] == \
            ["/blocks.0/mlp/fc2/MatMul", "/blocks.0/mlp/fc1/MatMul"]
        rows = np.abs(rng.normal(size=(10, 4))).astype(np.float32) * np.array([30, 1, 1, 2], np.float32)
        chan = np.abs(rows).max(0).astype(np.float64)
        st = _stats({"h": chan}, {"h": rows})
        skip = _stats({"h": chan})
        assert smooth_explicit(copy.deepcopy(m), skip, gemms, ("fc2",), (0.5,)) == []  # no rows: skipped
        none = copy.deepcopy(m)
        rep = smooth_explicit(none, _stats({"h": chan}, {"h": rows}), gemms, ("fc2",), (None,))
        assert rep[0]["alpha"] is None and len(none.graph.node) == 5
        rep = smooth_explicit(m, st, gemms, ("fc2",), (0.5,))
        assert [(r["gemm"], r["alpha"]) for r in rep] == [("/blocks.0/mlp/fc2/MatMul", 0.5)]
        s = np.clip(chan ** 0.5 / np.abs(w).max(1).astype(np.float64) ** 0.5, 1e-4, 1e4)
        ini = _inits(m)
        inv = [k for k in ini if k.endswith("_smooth_inv_scale")]
        assert len(inv) == 1
        np.testing.assert_allclose(ini[inv[0]], (1 / s).astype(np.float32), rtol=1e-7)
        np.testing.assert_allclose(ini["W"], w * s[:, None].astype(np.float32), rtol=1e-6)
        np.testing.assert_array_equal(ini["W2"], w)
        ops = [(n.op_type, n.name) for n in m.graph.node]
        mul = next(n for n in m.graph.node if n.op_type == "Mul")
        assert ops.index(("Mul", mul.name)) + 1 == ops.index(("MatMul", "/blocks.0/mlp/fc2/MatMul"))
        assert list(mul.input) == ["h", inv[0]]
        fc2 = next(n for n in m.graph.node if n.name == "/blocks.0/mlp/fc2/MatMul")
        assert fc2.input[0] == mul.output[0] and mul.output[0] in st.chan_amax
        np.testing.assert_allclose(st.chan_amax[mul.output[0]], chan / s)
        np.testing.assert_array_equal(st.chan_amax["h"], chan)
        from exporters.quantization.stats import session_from_proto

        xin = rng.normal(size=(5, 4)).astype(np.float32)
        ref = session_from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        got = session_from_proto(m).run(None, {"x": xin})
        want = ref.run(None, {"x": xin})
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


    def test_smooth_explicit_skips_and_keeps_going(self):
        from exporters.quantization.qdq import find_gemms
        from exporters.quantization.smoothing import choose_alpha
        from exporters.quantization.smoothing_explicit import smooth_explicit

        rng = np.random.default_rng(5)
        wz = rng.normal(size=(4, 4)).astype(np.float32)
        wn = rng.normal(size=(4, 4)).astype(np.float32)
        w = rng.normal(size=(4, 3)).astype(np.float32)
        inits = [numpy_helper.from_array(a, n) for a, n in ((wz, "WZ"), (wn, "WN"), (w, "W"))]
        nodes = [helper.make_node("MatMul", ["x", "WZ"], ["y0"], name="/blocks.0/mlp/fc2/MatMul"),
                 helper.make_node("Relu", ["y0"], ["h1"], name="r1"),
                 helper.make_node("MatMul", ["h1", "WN"], ["y1"], name="/blocks.1/mlp/fc2/MatMul"),
                 helper.make_node("Relu", ["y1"], ["h2"], name="r2"),
                 helper.make_node("MatMul", ["h2", "W"], ["y2"], name="/blocks.2/mlp/fc2/MatMul")]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                                  [helper.make_tensor_value_info("y2", TensorProto.FLOAT, None)], inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        r1 = np.zeros((12, 4), np.float32)  # a dead input: every alpha ties at error 0, the first (None) stays
        r2 = np.abs(rng.normal(size=(12, 4))).astype(np.float32) * np.array([40, 1, 1, 3], np.float32)
        chan = {k: np.abs(v).max(0).astype(np.float64) for k, v in (("h1", r1), ("h2", r2))}
        chan["x"] = np.ones(4)
        st = _stats(chan, {"h1": r1, "h2": r2})
        rep = smooth_explicit(m, st, find_gemms(m), ("fc2",), (None, 0.5))
        # x has no sampled rows: skipped; h1 keeps None (no node), h2 gets its Mul
        assert [(r["gemm"], r["alpha"]) for r in rep] == [("/blocks.1/mlp/fc2/MatMul", None),
                                                          ("/blocks.2/mlp/fc2/MatMul", 0.5)]
        for r, rows, wt in ((rep[0], r1, wn), (rep[1], r2, w)):
            assert r["errors"] == choose_alpha(rows, chan["h1" if wt is wn else "h2"], [wt], (None, 0.5))[2]
        mul = [n for n in m.graph.node if n.op_type == "Mul"]
        assert len(mul) == 1 and mul[0].name == "blocks.2_mlp_fc2_MatMul_smooth_Mul"
        assert list(mul[0].input) == ["h2", "blocks.2_mlp_fc2_MatMul_smooth_inv_scale"]
        assert mul[0].output[0] == "h2_smoothed_blocks.2_mlp_fc2_MatMul"
        assert [n.name for n in m.graph.node][-2:] == [mul[0].name, "/blocks.2/mlp/fc2/MatMul"]
        np.testing.assert_array_equal(_inits(m)["WN"], wn)


# ------------------------------------------------------------------------------------------- gptq


def _gptq_by_hand(w: np.ndarray, h: np.ndarray, damp: float, dead: float = 1.0) -> np.ndarray:
    """GPTQ in the inverse-Hessian (OBQ) form: quantize row k, spread its error with the k-th column
    of H^-1 over the rows not yet quantized, then eliminate k from H^-1 (Frantar & Alistarh 2022).
    A dead input (H_kk <= 0) gets H_kk = ``dead`` and a zero weight row."""
    k_in = w.shape[0]
    scale = np.abs(w).max(0) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32).astype(np.float64)
    work = w.astype(np.float64).copy()
    h = h.astype(np.float64).copy()
    for k in range(k_in):
        if h[k, k] <= 0:
            h[k, k] = dead
            work[k] = 0.0
    h = h + damp * np.trace(h) / k_in * np.eye(k_in)
    hinv = np.linalg.inv(h)
    q = np.zeros(w.shape, dtype=np.int64)
    for k in range(k_in):
        q[k] = np.clip(np.rint(work[k] / scale), -127, 127)
        err = (work[k] - q[k] * scale) / hinv[k, k]
        for j in range(k + 1, k_in):
            work[j] -= hinv[j, k] * err
        hinv = hinv - np.outer(hinv[:, k], hinv[k, :]) / hinv[k, k]
    return q


class TestGPTQ:
    def test_gptq_equals_the_inverse_hessian_form_by_hand(self):
        from exporters.quantization.weight_rounding import round_gptq

        rng = np.random.default_rng(0)
        x = rng.normal(size=(40, 5)) @ rng.normal(size=(5, 5))  # correlated inputs
        w = rng.normal(size=(5, 4)).astype(np.float32)
        w[:, 1] *= 3
        h = x.T @ x
        for damp in (0.01, 0.3):
            q, s = round_gptq(w, h, damp=damp)
            assert q.dtype == np.int8 and s.dtype == np.float32
            np.testing.assert_array_equal(q, _gptq_by_hand(w, h, damp))
            np.testing.assert_array_equal(s, np.abs(w).max(0) / np.float32(127))
        q1, _ = round_gptq(w, h)  # the default damp is GPTQ's 1%
        np.testing.assert_array_equal(q1, _gptq_by_hand(w, h, 0.01))
        assert not np.array_equal(_gptq_by_hand(w, h, 0.01), np.clip(np.rint(w / s), -127, 127))

    def test_gptq_dead_inputs_and_saturation(self):
        from exporters.quantization.weight_rounding import round_gptq

        rng = np.random.default_rng(1)
        x = rng.normal(size=(30, 4)) @ rng.normal(size=(4, 4))
        x[:, 2] = 0.0  # a dead input
        w = rng.normal(size=(4, 3)).astype(np.float32)
        w[2] = 100.0  # its weight row is the largest: it sets the scale, and is zeroed
        h = x.T @ x
        q, _ = round_gptq(w, h)
        assert np.all(q[2] == 0)
        np.testing.assert_array_equal(q, _gptq_by_hand(w, h, 0.01))
        # error compensation can push a value past 127: clipped to the narrow range
        w2 = np.array([[1.0], [0.996]], np.float32)
        h2 = np.array([[1.0, -0.99], [-0.99, 1.0]])
        q2, _ = round_gptq(w2, h2, damp=0.0)
        np.testing.assert_array_equal(q2, _gptq_by_hand(w2, h2, 0.0))
        assert q2.min() >= -127 and q2.max() <= 127

    def test_gptq_works_in_float64_whatever_the_input_dtypes(self):
        from exporters.quantization.weight_rounding import round_gptq

        rng = np.random.default_rng(1)
        x = rng.normal(size=(64, 12)) @ rng.normal(size=(12, 12))
        h = x.T @ x
        w16 = rng.normal(size=(12, 16)).astype(np.float16)  # values exact in float32 and float64
        want = _gptq_by_hand(w16.astype(np.float32), h, 0.01)
        np.testing.assert_array_equal(round_gptq(w16.astype(np.float32), h)[0], want)
        np.testing.assert_array_equal(round_gptq(w16, h)[0], want)  # no float16 arithmetic
        hi = np.rint(h).astype(np.int64)  # an integer Gram: the same numbers as its float64 copy
        np.testing.assert_array_equal(round_gptq(w16, hi)[0], _gptq_by_hand(w16.astype(np.float32), hi, 0.01))

    def test_gptq_dead_input_counts_1_in_the_damping(self):
        from exporters.quantization.weight_rounding import round_gptq

        rng = np.random.default_rng(6)
        x = (rng.normal(size=(64, 16)) @ rng.normal(size=(16, 16))) * 0.005  # a Gram far below 1
        x[:, 0] = 0.0
        h = x.T @ x
        w = rng.normal(size=(16, 16)).astype(np.float32)
        q, _ = round_gptq(w, h, damp=0.1)  # the dead input's H_kk = 1 weighs in the mean diagonal
        np.testing.assert_array_equal(q, _gptq_by_hand(w, h, 0.1))
        assert not np.array_equal(q, _gptq_by_hand(w, h, 0.1, dead=2.0))  # a dead H_kk of 2 damps more

    def test_gptq_without_gram_is_nearest_and_shape_check(self):
        from exporters.quantization.weight_rounding import WEIGHT_ROUNDING, round_gptq, round_nearest

        w = np.array([[0.5, -1.0], [0.26, 0.004], [-0.3, 0.9]], np.float32)
        s = np.abs(w).max(0) / np.float32(127)
        want = np.clip(np.round(w / s), -127, 127).astype(np.int8)
        for q, sc in (round_gptq(w, None), round_nearest(w), round_nearest(w, np.eye(3))):
            np.testing.assert_array_equal(q, want)
            np.testing.assert_array_equal(sc, s)
        with pytest.raises(ValueError, match="gram"):
            round_gptq(w, np.eye(2))
        assert WEIGHT_ROUNDING["gptq"] is round_gptq and WEIGHT_ROUNDING["nearest"] is round_nearest

    def test_gptq_register_adds_the_function_under_its_name(self):
        from exporters.quantization.weight_rounding import (WEIGHT_ROUNDING, get_weight_rounding,
                                                            register_weight_rounding)

        def mine(w, gram=None):
            return w, w

        try:
            assert register_weight_rounding("mine-43")(mine) is mine
            assert WEIGHT_ROUNDING["mine-43"] is mine and get_weight_rounding("mine-43") is mine
        finally:
            WEIGHT_ROUNDING.unregister("mine-43", missing_ok=True)

    def test_gptq_registry_and_round_weights_layouts(self):
        from exporters.quantization.qdq import GemmNode, find_gemms
        from exporters.quantization.weight_rounding import get_weight_rounding, round_gptq, round_weights

        with pytest.raises(UserError, match="known: nearest, gptq$"):
            get_weight_rounding("fancy")
        assert get_weight_rounding("gptq") is round_gptq
        rng = np.random.default_rng(2)
        wm = rng.normal(size=(4, 3)).astype(np.float32)       # MatMul (K, O)
        wg = rng.normal(size=(2, 3)).astype(np.float32)       # Gemm transB: (O, K)
        wc = rng.normal(size=(2, 1, 1, 1)).astype(np.float32)  # Conv: skipped
        inits = [numpy_helper.from_array(a, n) for a, n in ((wm, "WM"), (wg, "WG"), (wc, "WC"))]
        nodes = [helper.make_node("Conv", ["img", "WC"], ["c"], name="conv"),  # first: skipped, not the end
                 helper.make_node("MatMul", ["x", "WM"], ["a"], name="mm"),
                 helper.make_node("Gemm", ["a", "WG"], ["b"], name="gemm", transB=1)]
        graph = helper.make_graph(nodes, "g", [], [], inits)
        m = helper.make_model(graph)
        gone = GemmNode("gone", "MatMul", "fc1", 0, "x", "NOT_AN_INIT", 1, 4, 3)  # weight not (any more) constant
        gemms = [gone] + find_gemms(m)
        assert [g.op_type for g in gemms] == ["MatMul", "Conv", "MatMul", "Gemm"]
        x = rng.normal(size=(20, 4)) @ rng.normal(size=(4, 4))
        a = x @ wm.astype(np.float64)
        st = _stats({"x": np.ones(4), "a": np.ones(3)}, gram={"x": x.T @ x, "a": a.T @ a})
        out = round_weights(m, gemms, st, "gptq")
        assert set(out) == {"mm", "gemm"}
        np.testing.assert_array_equal(out["mm"][0], _gptq_by_hand(wm, x.T @ x, 0.01))
        assert out["gemm"][0].shape == (2, 3) and out["gemm"][0].flags["C_CONTIGUOUS"]
        np.testing.assert_array_equal(out["gemm"][0], _gptq_by_hand(wg.T, a.T @ a, 0.01).T)
        np.testing.assert_array_equal(out["gemm"][1], np.abs(wg).max(1) / np.float32(127))
        near = round_weights(m, gemms, _stats({"x": np.ones(4)}), "gptq")  # no gram: nearest
        np.testing.assert_array_equal(near["mm"][0], np.clip(np.round(wm / (np.abs(wm).max(0) / np.float32(127))),
                                                             -127, 127))
        with pytest.raises(UserError):
            round_weights(m, gemms, st, "fancy")


# ---------------------------------------------------------------------------------------- fallback


def _cfg(**kw):
    from exporters.quantization.config import QuantizeConfig

    return QuantizeConfig(**kw)


class TestFallback:
    def test_fallback_thresholds_and_caps_at_their_boundaries(self):
        from exporters.quantization.recipe_tensorrt import choose_fallback

        rows = [{"node": "a", "rel_err": 3.0, "flops": 10}, {"node": "b", "rel_err": 1.0, "flops": 10},
                {"node": "c", "rel_err": -4.0, "flops": 80}]
        # err_sum = 4 (negative errors count 0); share 0.75 -> threshold exactly 3.0: a is a candidate
        assert choose_fallback(rows, 0.75, 1.0) == ["a"]
        assert choose_fallback(rows, 0.76, 1.0) == []
        # mean: 1/3 of 4 = 1.33: only a; the float FLOPs exactly at the cap are allowed
        assert choose_fallback(rows, None, 0.10) == ["a"]
        assert choose_fallback(rows, None, 0.0999) == []
        assert choose_fallback(rows, 0.25, 0.2) == ["a", "b"]
        assert choose_fallback([{"node": "z", "rel_err": 0.0, "flops": 5}], None, 1.0) == []
        assert choose_fallback([{"node": "n", "rel_err": -1.0, "flops": 5}], 0.1, 1.0) == []
        # zero FLOPs everywhere: the total counts as 1 and the per-FLOP key uses at least 1 FLOP
        zero = [{"node": "p", "rel_err": 1.0, "flops": 0}, {"node": "q", "rel_err": 2.0, "flops": 0}]
        assert choose_fallback(zero, 0.1, 0.0) == ["q", "p"]
        # error per FLOP orders the candidates; a FLOP count below 1 counts as 1
        tiny = [{"node": "s", "rel_err": 1.0, "flops": 0.5}, {"node": "t", "rel_err": 1.5, "flops": 1.0}]
        assert choose_fallback(tiny, 0.1, 1.0) == ["t", "s"]
        # the float FLOPs add up: after a and b (40 of 100) c (60) passes a 45% cap no more
        three = [{"node": n, "rel_err": e, "flops": 20.0} for n, e in (("a", 3.0), ("b", 2.0), ("c", 1.0))]
        assert choose_fallback(three + [{"node": "d", "rel_err": 0.0, "flops": 40.0}], 0.1, 0.45) == ["a", "b"]
        small = [{"node": "s", "rel_err": 1.0, "flops": 1.0}, {"node": "u", "rel_err": 1.5, "flops": 2.0}]
        assert choose_fallback(small, 0.1, 1.0) == ["s", "u"]  # 1.0 / 1 FLOP before 1.5 / 2 FLOPs
        # summed errors below 1 still choose
        assert choose_fallback([{"node": "v", "rel_err": 0.3, "flops": 1}, {"node": "w", "rel_err": 0.1, "flops": 1}],
                               None, 0.5) == ["v"]

    def test_fallback_share_one_skips_the_sensitivity_pass(self):
        from exporters.quantization.qdq import GemmNode
        from exporters.quantization.recipe_tensorrt import Prepared, _no_fallback, measured_fallback

        assert _no_fallback(_cfg(fallback_share=1.0))
        assert not _no_fallback(_cfg(fallback_share=0.99)) and not _no_fallback(_cfg())
        g1 = GemmNode("mm1", "MatMul", "fc1", 0, "x", "W", 1, 4, 3)
        g2 = GemmNode("mm2", "MatMul", "fc2", 0, "y", "V", 1, 3, 2)
        st = _stats({"x": np.ones(4), "y": np.ones(3)})
        st.shapes.update({"x": (1, 5, 4)})
        p = Prepared(None, [g1, g2], st, [], {"x": 1.0, "y": 1.0}, {}, {})
        rows, fb = measured_fallback(p, np.zeros((3, 1, 2, 2), np.float32), _cfg(fallback_share=1.0), {"mm2"})
        assert fb == [] and [r["node"] for r in rows] == ["mm1"]
        assert rows[0]["flops"] == 2.0 * 5 * 4 * 3 and math.isnan(rows[0]["rel_err"])
        # no images: no pass either, and nothing to choose from
        rows, fb = measured_fallback(p, np.zeros((0, 1, 2, 2), np.float32), _cfg(), set())
        assert fb == [] and [r["node"] for r in rows] == ["mm1", "mm2"]
        assert rows[1]["flops"] == 2.0 * 3 * 2  # no recorded shape: one row of k

    def test_fallback_measured_rows_feed_the_choice(self, monkeypatch):
        from exporters.quantization import recipe_tensorrt as rt
        from exporters.quantization.qdq import GemmNode

        gs = [GemmNode(n, "MatMul", "fc1", 0, "x", "W", 1, 4, 3) for n in ("a", "b", "c")]
        st = _stats({"x": np.array([4.0, 2.0])})
        p = rt.Prepared("MODEL", gs, st, [], {"x": 0.5}, {}, {"a": "WQ"})
        calls = []
        rows = [{"node": "a", "rel_err": 0.1, "flops": 10.0}, {"node": "b", "rel_err": 5.0, "flops": 10.0},
                {"node": "c", "rel_err": 2.0, "flops": 10.0}]

        def fake(model, stats, imgs, gemms, excluded, cfg, say, weights=None):
            calls.append((model, stats, len(imgs), gemms, excluded, say, weights))
            return rows

        def say(_m):
            return None

        monkeypatch.setattr(rt, "_sensitivity", fake)
        calib = np.zeros((10, 1, 2, 2), np.float32)
        got, fb = rt.measured_fallback(p, calib, _cfg(sensitivity_images=4, max_float_flops=0.5), {"b"}, say)
        assert got is rows
        # b is excluded: of a and c (errors 0.1, 2.0: mean 1.05) only c; it fits in 50% of their FLOPs
        assert fb == ["c"]
        model, stats, n, gemms, excluded, said, weights = calls[0]
        assert model == "MODEL" and n == 4 and gemms is gs and excluded == {"b"} and said is say
        assert weights == {"a": "WQ"}
        assert stats.amax == {"x": 0.5} and stats.chan_amax is st.chan_amax  # the prepared ranges
        # nothing excluded: the mean (7.1 / 3) leaves b alone; a share of 0.05 (0.355) adds c
        _, fb = rt.measured_fallback(p, calib, _cfg(max_float_flops=0.7), set())
        assert fb == ["b"]
        _, fb = rt.measured_fallback(p, calib, _cfg(max_float_flops=0.7, fallback_share=0.05), set())
        assert fb == ["b", "c"]
        _, fb = rt.measured_fallback(p, calib, _cfg(max_float_flops=0.4, fallback_share=0.05), set())
        assert fb == ["b"]  # c does not fit within 40%
        # share 1 skips the choice, even where one GEMM carries all the error (the choice would take it)
        rows[:] = [{"node": "b", "rel_err": 5.0, "flops": 10.0}, {"node": "a", "rel_err": 0.0, "flops": 10.0}]
        assert rt.choose_fallback(rows, 1.0, 1.0) == ["b"]
        _, fb = rt.measured_fallback(p, calib, _cfg(fallback_share=1.0, max_float_flops=1.0), set())
        assert fb == []

    def test_fallback_plan_by_hand(self):
        from exporters.quantization.qdq import GemmNode
        from exporters.quantization.recipe_tensorrt import _plan

        gs = [GemmNode("a", "MatMul", "fc1", 0, "x", "W", 1, 4, 2), GemmNode("b", "MatMul", "fc2", 1, "y", "V", 1, 2, 2),
              GemmNode("c", "MatMul", "head", None, "z", "U", 1, 2, 1)]
        st = _stats({})
        st.shapes.update({"x": (1, 3, 4), "y": (1, 3, 2)})
        rows = [{"node": "a", "rel_err": 0.5}, {"node": "b", "rel_err": float("nan")}]
        plan = _plan(gs, rows, st, {"y": 0.5}, {"c"}, ["b"], [{"norm": "n", "alpha": 0.5, "errors": {"0.5": 1.0}}],
                     "gptq")
        fa, fb, fc = 2.0 * 3 * 4 * 2, 2.0 * 3 * 2 * 2, 2.0 * 1 * 2 * 1
        assert plan.gemms == [
            {"node": "a", "kind": "fc1", "block": 0, "precision": "int8", "reason": "", "flops": fa, "clip": 1.0,
             "rel_err": 0.5},
            {"node": "b", "kind": "fc2", "block": 1, "precision": "float", "reason": "sensitivity", "flops": fb,
             "clip": 0.5, "rel_err": None},
            {"node": "c", "kind": "head", "block": None, "precision": "float", "reason": "--exclude", "flops": fc,
             "clip": 1.0, "rel_err": None}]
        assert plan.int8_flops_share == pytest.approx(fa / (fa + fb + fc))
        assert plan.weight_rounding == "gptq"
        assert plan.to_record() == {"gemms": plan.gemms, "smoothing": [{"norm": "n", "alpha": 0.5}],
                                    "int8_flops_share": plan.int8_flops_share, "weight_rounding": "gptq"}
        assert _plan(gs[:1], [], _stats({}), {}, set(), [], []).weight_rounding == "nearest"
        empty = _plan([GemmNode("e", "MatMul", "fc1", 0, "x", "W", 1, 0, 0)], [], _stats({}), {}, set(), [], [])
        assert empty.int8_flops_share == 0.0


# ------------------------------------------------------- smoothquant: the sampled run (docs/mutation.md)


class TestSmoothQuantSampled:
    def test_smooth_onnx_range_after_of_channels_below_one(self, tmp_path):
        """Small activations and weights (every per-channel max after the fold below 1): the range is still
        max / median, not max / 1."""
        from exporters.quantization.smoothing import smooth_onnx

        m = _ln_graph(c=6, o=6, readers="mm")
        for t in m.graph.initializer:
            if t.name in ("gamma", "beta", "W"):
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(0.01), t.name))
        src = tmp_path / "a.onnx"
        onnx.save_model(m, str(src))
        x = np.random.default_rng(0).normal(size=(7, 1, 5, 6)).astype(np.float32)
        [rep] = smooth_onnx(src, tmp_path / "b.onnx", x, alpha=0.5)
        ini = _inits(m)
        xc = x - x.mean(-1, keepdims=True)
        ln = xc / np.sqrt((xc ** 2).mean(-1, keepdims=True) + 1e-5) * ini["gamma"] + ini["beta"]
        amax = np.abs(ln.reshape(-1, 6)).max(0).astype(np.float64)
        after = amax / np.clip(amax ** 0.5 / np.abs(ini["W"]).max(1).astype(np.float64) ** 0.5, 1e-4, 1e4)
        assert after.max() < 0.1
        assert rep["x_range_after"] == pytest.approx(after.max() / np.median(after), rel=1e-4)
        assert rep["x_range_before"] == pytest.approx(amax.max() / np.median(amax), rel=1e-4)
