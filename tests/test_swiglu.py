"""Gated MLPs (SwiGLU; issue 54 item 3, METHODS.md §6 "Gated MLPs").

Hidden channel j of a gated MLP is ``h_j = act(u w_g,j) * (u w_u,j)``; pruning it removes row j of the gate
``fc1_g`` and of the up projection ``fc1_x`` together and column j of ``fc2``, and CORP's statistics, ranking
and ridge fold at fc2's input apply unchanged. Both timm forms are covered: the packed ``GluMlp`` (DINOv2-g,
``gate_last`` False and True), split exactly by ``edgeprune.zoo.glu``, and the split ``SwiGLU`` (a timm
VisionTransformer built with it, and DINOv3 S+ through the Eva conversion). Tiny random-init models; weights
re-drawn so that every branch matters (``tests.test_architectures._randomize``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune.anatomy import UnsupportedModelError, find_anatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp import CorpConfig, apply_corp
from edgeprune.errors import UserError
from edgeprune.plan import BlockPlan, pruned_indices
from tests.test_architectures import _randomize

GIANT = "vit_giant_patch14_dinov2"
GIANT_KW = {"depth": 2, "img_size": 28, "embed_dim": 96, "num_heads": 2, "num_classes": 10}  # hidden 256
DINOV3 = "vit_small_plus_patch16_dinov3"
DINOV3_KW = {"depth": 2, "img_size": 32, "embed_dim": 96, "num_heads": 2, "num_classes": 10}  # hidden 384
FORMS = ("packed", "packed_gate_last", "split", "dinov3")


def _timm_model(timm, form: str, seed: int = 0, **over):
    """The timm model of ``form``, unconverted (eval mode, seeded weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if form == "dinov3":
            model = timm.create_model(DINOV3, pretrained=False, **{**DINOV3_KW, **over})
        elif form == "split":  # timm's split SwiGLU (fc1_g / fc1_x) inside a VisionTransformer
            model = timm.create_model(GIANT, pretrained=False, mlp_layer=timm.layers.SwiGLU, mlp_ratio=2.66667,
                                      **{**GIANT_KW, **over})
        else:
            model = timm.create_model(GIANT, pretrained=False, **{**GIANT_KW, **over})
            if form == "packed_gate_last":
                for blk in model.blocks:
                    blk.mlp.gate_last = True
    return _randomize(model.eval(), seed)


def _gated(timm, form: str, seed: int = 0, **over):
    from edgeprune.zoo.canonical import canonical_model

    return canonical_model(_timm_model(timm, form, seed, **over))


def _images(model, n: int, seed: int) -> torch.Tensor:
    pe = model.patch_embed
    return torch.randn(n, pe.proj.in_channels, *pe.img_size, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, x):
    return model(x)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


# ---- the canonical form ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("gate_last", [False, True])
def test_packed_glu_is_split_exactly_honouring_gate_last(timm, gate_last):
    from edgeprune.zoo.canonical import canonical_model, conversions_for

    model = _timm_model(timm, "packed_gate_last" if gate_last else "packed")
    x = _images(model, 4, 1)
    dense = _logits(model, x)
    packed = model.blocks[0].mlp.fc1.weight.detach().clone()  # (2H, D): [first half; second half]
    assert conversions_for(model) == ["glu"]
    with pytest.raises(UnsupportedModelError, match=r"packed gated \(GLU\) MLP GluMlp .*canonical_model") as err:
        find_anatomy(model)
    assert "\n" not in str(err.value)
    conv = canonical_model(model)
    assert conversions_for(conv) == [] and type(model.blocks[0].mlp).__name__ == "GluMlp"  # the input is kept
    b = find_anatomy(conv).blocks[0]
    h = packed.shape[0] // 2
    gate, up = (packed[h:], packed[:h]) if gate_last else (packed[:h], packed[h:])
    assert torch.equal(b.fc1_gate.weight, gate) and torch.equal(b.fc1.weight, up)
    assert b.fc1 is conv.blocks[0].mlp.fc1_x and b.mlp_hidden == h == 256
    assert (_logits(conv, x) - dense).abs().max().item() <= 1e-6
    assert torch.equal(_logits(model, x), dense)


# ---- (a) pruning nothing is exact -------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
def test_sparsity_zero_and_keeping_every_channel_reproduce_the_dense_logits(timm, form):
    import edgeprune

    model = _gated(timm, form)
    x = _images(model, 8, 2)
    dense = _logits(model, x)
    assert find_anatomy(model).blocks[0].fc1_gate is not None
    res = edgeprune.prune(model, x, target="mlp", sparsity=0.0)
    assert (_logits(res.model, x) - dense).abs().max().item() <= 1e-5
    # S = every channel, through the statistics, the (empty) fold and the surgery of gate, up and fc2
    kept = copy.deepcopy(model)
    an = find_anatomy(kept)
    stats = collect_statistics(an, [x], mlp=True, qk=False, vo=False, progress=False)
    apply_corp(an, [BlockPlan(b.index, mlp_keep=torch.arange(b.mlp_hidden)) for b in an.blocks], CorpConfig(),
               stats.mlp, None)
    assert all(b.block.mlp.fc1_g is b.fc1_gate and b.block.mlp.fc1_x is b.fc1 for b in an.blocks)
    assert (_logits(kept, x) - dense).abs().max().item() <= 1e-5


# ---- (b) an exactly duplicated channel is compensated exactly --------------------------------------------------
def _duplicate_channels(model, block: int, pairs: dict[int, int]) -> None:
    """Hidden channel ``dup`` := channel ``src`` for each ``dup: src`` (rows of fc1_g and fc1_x, weights and
    biases): ``h_dup = h_src`` exactly."""
    mlp = model.blocks[block].mlp
    with torch.no_grad():
        for lin in (mlp.fc1_g, mlp.fc1_x):
            for dup, src in pairs.items():
                lin.weight[dup] = lin.weight[src]
                lin.bias[dup] = lin.bias[src]


def _prune_channels(model, x, block: int, drop: list[int], compensation: bool):
    an = find_anatomy(model)
    stats = collect_statistics(an, [x], mlp=True, qk=False, vo=False, progress=False)
    plans = [BlockPlan(b.index) for b in an.blocks]
    plans[block].mlp_keep = pruned_indices(torch.tensor(drop), an.blocks[block].mlp_hidden)
    apply_corp(an, plans, CorpConfig(ridge_alpha=1e-10, compensation=compensation), stats.mlp, None)
    return an.blocks[block]


def test_an_exactly_duplicated_channel_is_compensated_exactly(timm):
    """64 images x 17 tokens (1088) > 256 hidden channels: the ridge map is determined, and held-out images
    see the same exact relation h_dup = h_src."""
    dense = _gated(timm, "packed", img_size=56)
    pairs = {3: 0, 10: 1, 200: 57}
    _duplicate_channels(dense, 0, pairs)
    calib, held = _images(dense, 64, 3), _images(dense, 16, 4)
    ref = _logits(dense, held)
    errs = {}
    for comp in (True, False):
        model = copy.deepcopy(dense)
        b = _prune_channels(model, calib, 0, sorted(pairs), comp)
        assert b.mlp_hidden == 253 and b.fc1_gate.out_features == b.fc1.out_features == b.fc2.in_features == 253
        errs[comp] = float((_logits(model, held) - ref).abs().max())
    assert errs[True] <= 1e-4, errs
    assert errs[False] > 100 * max(errs[True], 1e-6), errs  # the channels mattered


# ---- (c) --target mlp at 0.5: multiples of 8, save/reload, ONNX -------------------------------------------------
def _export_and_verify(model, record, tmp_path, x):
    from exporters.onnx import build_metadata, export_onnx, read_metadata
    from exporters.verify import verify_onnx

    an = find_anatomy(model)
    path = export_onnx(model, tmp_path / "gated.onnx", (an.in_chans, *an.img_size), build_metadata(record=record))
    rep = verify_onnx(path, model, x)
    assert rep["passed"] and rep["max_abs_diff"] <= 1e-4, rep
    assert read_metadata(path)["blocks"] == record["blocks"]


def _check_half(model, dense_hidden: int):
    an = find_anatomy(model)
    for b in an.blocks:
        assert b.mlp_hidden == dense_hidden // 2 and b.mlp_hidden % 8 == 0
        assert b.fc1_gate.out_features == b.fc1.out_features == b.fc2.in_features == b.mlp_hidden
    return an


def test_mlp_half_on_dinov2_giant_saves_reloads_and_exports(tmp_path):
    import edgeprune
    from edgeprune.artifact import load_run, save_run
    from edgeprune.zoo.registry import get_model_spec

    kw = {k: v for k, v in GIANT_KW.items() if k not in ("img_size", "num_classes")}
    spec = get_model_spec(GIANT, random_init=True, num_classes=10, img_size=28, model_kwargs=kw)
    model = _randomize(spec.create(), 0)  # ModelSpec converts (edgeprune.zoo.canonical)
    x = _images(model, 32, 5)
    res = edgeprune.prune(model, x, target="mlp", sparsity=0.5, spec=spec)
    _check_half(res.model, 256)
    assert [b["mlp_hidden"] for b in res.record["blocks"]] == [128, 128]
    run = save_run(tmp_path / "run", res.model, res.record)
    back, rec = load_run(run)
    _check_half(back, 256)
    assert (_logits(back, x) - _logits(res.model, x)).abs().max().item() <= 1e-6
    _export_and_verify(res.model, res.record, tmp_path, x)


def test_mlp_half_on_a_dinov3_layout_reloads_and_exports(timm, tmp_path):
    """DINOv3 S+ (split SwiGLU, through the Eva conversion); reloaded as ``load_run`` does (fresh converted model,
    ``apply_structure``, strict state dict)."""
    import edgeprune
    from edgeprune.surgery import apply_structure

    model = _gated(timm, "dinov3")
    x = _images(model, 32, 6)
    res = edgeprune.prune(model, x, target="mlp", sparsity=0.5)
    _check_half(res.model, 384)
    fresh = apply_structure(_gated(timm, "dinov3", seed=1), res.record["blocks"])
    fresh.load_state_dict(res.model.state_dict(), strict=True)
    assert (_logits(fresh.eval(), x) - _logits(res.model, x)).abs().max().item() <= 1e-6
    _export_and_verify(res.model, res.record, tmp_path, x)


# ---- (d) compensation helps -------------------------------------------------------------------------------------
def test_compensation_beats_no_compensation_at_mlp_half(timm):
    import edgeprune

    model = _gated(timm, "packed", img_size=56)
    calib, held = _images(model, 64, 7), _images(model, 32, 8)
    dense = _logits(model, held)
    err = {c: _rel(_logits(edgeprune.prune(model, calib, target="mlp", sparsity=0.5, compensation=c).model, held),
                   dense) for c in (True, False)}
    assert err[True] < 0.85 * err[False], err


# ---- costs, readers, refusals ---------------------------------------------------------------------------------
def test_flops_count_three_matmuls_and_params_count_the_gate(timm):
    import edgeprune
    from torch.utils.flop_counter import FlopCounterMode

    from edgeprune.budget.params import ParamsCost
    from edgeprune.budget.registry import dense_dims
    from edgeprune.flops import block_flops, block_params, count_params, model_flops

    model = _gated(timm, "packed")
    x = _images(model, 8, 9)
    pruned = edgeprune.prune(model, x, target="mlp", sparsity=0.5).model
    for m in (model, pruned):
        an = find_anatomy(m)
        for b in an.blocks:
            b.attn.fused_attn = False  # the counter sees q @ k^T and attn @ v
            D, H = b.fc1.in_features, b.mlp_hidden
            assert block_flops(b, an.num_tokens)["mlp"] == 2 * 3 * an.num_tokens * D * H
            mlp_params = sum(p.numel() for p in b.block.mlp.parameters())
            assert block_params(b)["mlp"] + b.fc2.out_features == mlp_params == 3 * D * H + 2 * H + D
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            m(x[:1])
        assert model_flops(an)["total"] == fc.get_total_flops()
        cost = ParamsCost(an)
        assert cost.fixed_cost() + sum(cost.block_cost(b, dense_dims(b)) for b in an.blocks) == count_params(m)


def test_embed_slice_resizes_both_input_projections(timm):
    import edgeprune

    model = _gated(timm, "packed")
    x = _images(model, 16, 10)
    res = edgeprune.prune(model, x, target="mlp", sparsity=0.25, embed_sparsity=0.25)
    for b in find_anatomy(res.model).blocks:
        assert b.fc1_gate.in_features == b.fc1.in_features == 72 and b.fc1_gate.out_features == 192
    assert torch.isfinite(_logits(res.model, x)).all()


def test_heal_trains_the_gate_with_the_up_projection(timm):
    import edgeprune
    from edgeprune.heal.reduced import reduced_modules

    model = _gated(timm, "packed")
    res = edgeprune.prune(model, _images(model, 8, 11), target="mlp", sparsity=0.5)
    assert reduced_modules(res.model, model) == [f"blocks.{i}.mlp.{n}" for i in range(2)
                                                 for n in ("fc1_g", "fc1_x", "fc2")]


def test_nuwa_derives_a_gated_model(timm):
    import dataclasses

    from edgeprune.flops import model_flops
    from edgeprune.nuwa.config import DeriveConfig
    from edgeprune.nuwa.derive import derive

    model = _gated(timm, "packed")
    x = _images(model, 40, 12)
    cfg = DeriveConfig()
    cfg = dataclasses.replace(cfg, skp=dataclasses.replace(cfg.skp, steps=0))
    res = derive(model, [0, 1, 2], x, torch.arange(40) % 10, flops=0.6, config=cfg)
    an = find_anatomy(res.model)
    assert all(b.fc1_gate.out_features == b.fc1.out_features == b.mlp_hidden < 256 for b in an.blocks)
    assert model_flops(an)["total"] <= 0.6 * model_flops(find_anatomy(model))["total"] * 1.001


def test_a_latency_table_times_gated_mlps_and_refuses_the_other_kind(timm, tmp_path):
    """Issue 54: a gated model's latency table times gated MLP sub-blocks (the three matmuls the model runs: with the
    block's weights the sub-block is the block's MLP residual exactly) and says so in its key; built with the real
    torch timer, its self-check rebuilds the pruned models gated; a table of plain MLPs refuses the gated model and
    the gated table a plain one, in one line."""
    import devices
    from edgeprune.latency.build import build_table
    from edgeprune.latency.grid import shape_of
    from edgeprune.latency.subblocks import mlp_subblock
    from edgeprune.latency.table import LatencyTable
    from tests.test_latency_table import _hand_table, _opts

    an = find_anatomy(_gated(timm, "dinov3"))
    b, D = an.blocks[0], an.embed_dim
    plain = find_anatomy(timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, depth=2).eval())
    assert shape_of(an)["mlp_gated"] is True and "mlp_gated" not in shape_of(plain)  # plain tables' keys as before
    sub = mlp_subblock(b, D, b.mlp_hidden)
    assert sub.gate is not None and sub.gate.out_features == sub.fc1.out_features == b.mlp_hidden
    for mine, theirs in ((sub.gate, b.fc1_gate), (sub.fc1, b.fc1), (sub.fc2, b.fc2)):
        mine.load_state_dict(theirs.state_dict())
    x = torch.randn(2, an.num_tokens, D, generator=torch.Generator().manual_seed(0))
    ls2 = b.ls2 if b.ls2 is not None else torch.nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(sub(x), x + ls2(b.mlp(b.block.norm2(x))), rtol=1e-6, atol=1e-6)
    out = tmp_path / "t.json"
    t = build_table(an, devices.load_profile("cpu"), _opts(backend="torch", batch=2, warmup=1, iterations=3,
                                                           clock="auto", force=True), out, show_progress=False)
    assert t.key["mlp_gated"] is True and [m["name"] for m in t.meta["self_check"]["models"]][-1] == "x0.3"
    loaded = LatencyTable.load(out)
    loaded.check_model(an)  # the same kind: no error
    for table, model, says in ((_hand_table(), an, "times plain MLPs, the model's are gated"),
                               (loaded, plain, "times gated MLPs, the model's are plain")):
        with pytest.raises(UserError, match=says) as err:
            table.check_model(model)
        assert "\n" not in str(err.value)


def test_a_gated_mlp_with_a_hidden_norm_is_refused_in_one_line(timm):
    """EVA-02 B/L ``scale_mlp``: a LayerNorm over the hidden couples every channel, so removing one changes
    the others (no exact fold); the conversion keeps it, the anatomy refuses it."""
    from edgeprune.zoo.canonical import canonical_model

    with torch.random.fork_rng(devices=[]):
        model = canonical_model(timm.create_model("eva02_base_patch14_224", pretrained=False, depth=1,
                                                  img_size=28).eval())
    assert type(model.blocks[0].mlp).__name__ == "SwiGLU"
    with pytest.raises(UnsupportedModelError, match="MLP hidden norm \\(mlp.norm LayerNorm.*scale_mlp") as err:
        find_anatomy(model)
    assert "\n" not in str(err.value)
