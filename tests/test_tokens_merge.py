"""Token merging (ToMe, issue 44; edgeprune.tokens, docs/tokens.md): the merge math, the merged model, the prune
stage, the record, the export and the bad values.

Small seeded timm ViTs (32 px, patch 4: 64 patch tokens) so that every test runs in seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.errors import UserError
from edgeprune.flops import block_tokens, model_flops
from edgeprune.layers.class_token_block import to_class_token_block
from edgeprune.surgery import apply_structure, block_dims
from edgeprune.tokens import (MergedBlocks, apply_token_merge, bipartite_soft_matching, merge_plan, merge_wavg,
                              parse_tokens_merge, schedule_r)
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli

PATCHES = 64


def vit(depth: int = 4, seed: int = 0, distilled: bool = False, **kw):
    """A seeded random timm ViT (or distilled DeiT: class and distillation tokens): 32 px, patch 4 (64 patches),
    width 48, 3 heads, LayerScale, 5 classes."""
    from edgeprune._compat import import_timm

    import_timm()
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    m = (VisionTransformerDistilled if distilled else VisionTransformer)(img_size=32, patch_size=4, embed_dim=48, depth=depth, num_heads=3, num_classes=5,
                          init_values=0.5, **kw).eval()
    with torch.no_grad():  # visible position embeddings, peaked attention, logits of order 1 (timm's init is
        m.pos_embed.normal_(0, 0.5)  # small: nearly uniform attention, outputs near 0)
        for blk in m.blocks:
            blk.attn.qkv.weight.normal_(0, 0.5)
        for head in (m.head, getattr(m, "head_dist", m.head)):
            head.weight.normal_(0, 1.0)
    return m


def pruned_attention(m):
    """``m`` with every block's attention a PrunedAttention of uneven dims (2 heads, d_qk 8, d_v 12)."""
    dims = block_dims(find_anatomy(m))
    for d in dims:
        d.update(num_heads=2, qk_dim=8, v_dim=12)
    torch.manual_seed(1)
    return apply_structure(m, dims)


def class_token_last(m):
    to_class_token_block(m, 1)
    return m


CASES = {
    "token pool": lambda: vit(),
    "avg pool, no class token": lambda: vit(class_token=False, global_pool="avg"),
    "avg pool after a class token": lambda: vit(global_pool="avg"),
    "register tokens": lambda: vit(reg_tokens=2),
    "distilled (2 prefix tokens)": lambda: vit(distilled=True),
    "pruned attention": lambda: pruned_attention(vit()),
    "class-token last block": lambda: class_token_last(vit()),
}


def images(n: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def run(model, x):
    with torch.no_grad():
        return model(x)


def merged(model, r):
    m = copy.deepcopy(model)
    apply_token_merge(m, r)
    return m


#: duplicate pairs of :func:`duplicate_pairs`: the patches of the top 4 of the 8 patch rows
PAIRS = 16


def duplicate_pairs(model, x):
    """Make patch tokens 2j and 2j + 1 of the top half of the image identical (same pixels, same position
    embedding), in place: the tokens the merge puts in A and B at the same index; the other tokens stay distinct,
    so that merging the PAIRS duplicates leaves tokens of sizes 1 and 2 (uniform sizes would make the log-size
    bias a constant that the softmax ignores)."""
    with torch.no_grad():
        pe = model.pos_embed[:, -PATCHES:][:, :PAIRS * 2]
        pe[:, 1::2] = pe[:, 0::2]
    cols = x[:, :, :16].view(x.shape[0], 3, 16, 8, 4)  # (B, C, H of the top 4 patch rows, patch column, pixel)
    cols[:, :, :, 1::2] = cols[:, :, :, 0::2]
    return model, x


# -- the merge step ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", [0, 1, 3])
def test_a_merge_conserves_the_size_weighted_sums_and_keeps_the_prefix_first(prefix):
    g = torch.Generator().manual_seed(prefix)
    n, r = 21, 7
    x, metric = torch.randn(2, n, 6, generator=g, dtype=torch.float64), torch.randn(2, n, 4, generator=g)
    size = torch.randint(1, 5, (2, n, 1), generator=g).double()
    plan = bipartite_soft_matching(metric, r, prefix)
    y, s = merge_wavg(x, size, plan)
    assert y.shape == (2, n - r, 6) and s.shape == (2, n - r, 1)
    torch.testing.assert_close((s * y).sum(1), (size * x).sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.sum(1), size.sum(1))
    assert torch.equal(y[:, :prefix], x[:, :prefix]) and torch.equal(s[:, :prefix], size[:, :prefix])
    assert plan.src.shape == plan.dst.shape == (2, r)


def test_the_matching_merges_the_most_similar_pairs():
    """A tokens 0 and 2 have exact copies in B; the other tokens are far apart: r = 2 merges exactly those two."""
    metric = torch.eye(8).unsqueeze(0)  # 8 orthogonal tokens
    metric[0, 1], metric[0, 5] = metric[0, 0], metric[0, 4]  # B0 = A0, B2 = A2 (positions 1 = B0, 5 = B2)
    plan = bipartite_soft_matching(metric, 2, 0)
    assert sorted(plan.src[0].tolist()) == [0, 2]
    assert sorted(zip(plan.src[0].tolist(), plan.dst[0].tolist())) == [(0, 0), (2, 2)]


# -- the merged model -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_zero_merges_leave_the_model_exactly_as_it_was(case):
    model, x = CASES[case](), images()
    m = merged(model, [0] * len(model.blocks))
    assert not isinstance(m.blocks, MergedBlocks)
    assert torch.equal(run(m, x), run(model, x))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("at", [0, 2])
def test_merging_duplicate_tokens_with_proportional_attention_gives_the_unmerged_output(case, at):
    """Two identical tokens attend and are attended to as one token of size 2 with log 2 on its logits: merging
    the duplicate pairs (r = 16) in block ``at`` changes the output by rounding only (ToMe eq. 1 is exact here;
    an average pool weighs the merged tokens by their sizes)."""
    model, x = duplicate_pairs(CASES[case](), images())
    r = [0] * len(model.blocks)
    r[at] = PAIRS
    ref = run(model, x)
    got = run(merged(model, r), x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_without_proportional_attention_the_duplicates_test_fails(case, monkeypatch):
    """The duplicates test above can fail: the same merge with plain attention (no log size) moves the output."""
    from edgeprune.tokens import model as model_mod

    model, x = duplicate_pairs(CASES[case](), images())
    m = merged(model, [PAIRS, 0, 0, 0])
    plain = model_mod.proportional_attention
    monkeypatch.setattr(model_mod, "proportional_attention", lambda attn, h, size, *a: plain(attn, h, None, *a))
    assert (run(m, x) - run(model, x)).abs().max() > 1e-2


def test_two_merges_of_quadruplicates_carry_the_sizes_to_the_next_block():
    """Groups of 4 identical tokens merged in two steps (block 0: 32, block 1: 16) give the unmerged output."""
    model, x = vit(), images()
    with torch.no_grad():
        pe = model.pos_embed[:, -PATCHES:].view(1, 16, 4, 48)
        pe[:] = pe[:, :, :1]
    cols = x.view(3, 3, 32, 2, 4, 4)  # (B, C, H, group of 4 patch columns, column in group, pixel)
    cols[:] = cols[:, :, :, :, :1].clone()
    torch.testing.assert_close(run(merged(model, [32, 16, 0, 0]), x), run(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["token pool", "register tokens", "avg pool, no class token"])
def test_each_block_receives_the_tokens_the_schedule_says(case):
    model = CASES[case]()
    prefix = model.num_prefix_tokens
    seen: list[int] = []
    m = merged(model, [8, 4, 0, 2])
    for blk in m.blocks:
        blk.norm1.register_forward_hook(lambda _m, _a, out: seen.append(out.shape[1]))
    out = run(m, images())
    assert seen == [prefix + 64, prefix + 56, prefix + 52, prefix + 52] == block_tokens(find_anatomy(m))
    assert out.shape == (3, 5)
    assert [d["tokens"] for d in block_dims(find_anatomy(m))] == seen


def test_schedules():
    assert schedule_r(4, 3) == [4, 4, 4]
    assert schedule_r("3,2,1", 3) == [3, 2, 1]
    assert schedule_r("decreasing:8", 5) == [16, 12, 8, 4, 0]  # ToMe's parse_r((8, -1)): 2R down to 0
    assert parse_tokens_merge(" 7 ") == 7 and parse_tokens_merge([1, 2]) == (1, 2)
    r, tokens = merge_plan(vit(), "decreasing:8")
    assert r == [16, 10, 5, 0] and tokens == [65, 49, 39, 34]
    assert merge_plan(class_token_last(vit()), 4)[0] == [4, 4, 4, 0]  # the class-token block merges nothing


def test_flops_count_the_merged_tokens_like_torchs_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    m = merged(class_token_last(pruned_attention(vit())), [8, 4, 4, 0])
    an = find_anatomy(m)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, torch.no_grad():
        m(images(1))
    per_module = fc.get_flop_counts()
    ours = model_flops(an)
    for i, b in enumerate(ours["blocks"]):
        assert b["total"] == sum(per_module[f"VisionTransformer.blocks.{i}"].values()), (i, b)
    dense = model_flops(find_anatomy(class_token_last(pruned_attention(vit()))))
    assert ours["blocks"][0]["mlp"] < dense["blocks"][0]["mlp"] and ours["blocks"][0]["merge"] > 0
    assert ours["total"] < dense["total"]


# -- export ------------------------------------------------------------------------------------------------------

def _norm_tokens(path) -> list[int]:
    import onnx
    from onnx import shape_inference

    g = shape_inference.infer_shapes(onnx.load(str(path))).graph
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in g.value_info}
    return [shapes[n.output[0]][1] for n in g.node if n.op_type == "LayerNormalization" and "/norm1/" in n.name]


@pytest.mark.parametrize("case", ["register tokens", "pruned attention", "avg pool, no class token"])
def test_the_onnx_graph_has_static_token_counts_and_matches_pytorch(case, tmp_path):
    import onnx

    from exporters.onnx import export_onnx
    from exporters.verify import verify_onnx

    model = CASES[case]()
    m = merged(model, [8, 4, 6, 2])
    path = export_onnx(m, tmp_path / "m.onnx", (3, 32, 32))
    assert _norm_tokens(path) == block_tokens(find_anatomy(m))
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"TopK", "GatherElements", "Equal", "MatMul"} <= ops
    assert not ops & {"ScatterElements", "ScatterND", "NonZero", "Loop", "If"}
    report = verify_onnx(path, m, images(5, seed=3), atol=1e-4)
    assert report["passed"], report


# -- the prune stage, the record, the command line ---------------------------------------------------------------

@needs_fmnist
def test_a_pruned_and_merged_run_loads_exports_and_verifies(tmp_path):
    from edgeprune.artifact import load_run

    out = tmp_path / "run"
    r = run_cli(["prune", "--quiet", "--no-eval", "--calib-size", "16", "--sparsity", "0.25", "--tokens-merge",
                 "decreasing:4", "--embed-sparsity", "0.25", "-o", out])
    assert r.exit_code == 0, r.output
    model, rec = load_run(out)
    assert rec["tokens_merge"]["r"] == [8, 6, 4, 3, 1, 0] and rec["tokens_merge"]["tokens"] == [49, 41, 35, 31, 28, 27]
    assert [b["tokens"] for b in rec["blocks"]] == rec["tokens_merge"]["tokens"] == block_tokens(find_anatomy(model))
    assert rec["flops"] == model_flops(find_anatomy(model))["total"]
    info = run_cli(["info", out])
    assert info.exit_code == 0 and "| block | tokens | merged |" in info.stdout and "| 3 | 31 | 3 |" in info.stdout
    e = run_cli(["export", out, "-o", tmp_path / "m.onnx"])
    assert e.exit_code == 0, e.output
    assert _norm_tokens(tmp_path / "m.onnx") == [49, 41, 35, 31, 28, 27]
    v = run_cli(["verify", tmp_path / "m.onnx", "--against", out, "--n", "16"])
    assert v.exit_code == 0 and "PASS" in v.stdout, v.output


@needs_fmnist
def test_tokens_merge_zero_prunes_exactly_like_no_merge(fmnist_model, fmnist_calib):
    from edgeprune import api

    calib = fmnist_calib[0][:16]
    plain = api.prune(fmnist_model, calib, target="mlp", sparsity=0.25)
    zero = api.prune(fmnist_model, calib, target="mlp", sparsity=0.25, tokens_merge=0)
    x = fmnist_calib[1][:8]
    assert torch.equal(run(zero.model, x), run(plain.model, x))
    assert zero.record["tokens_merge"]["r"] == [0] * 6 and "tokens_merge" not in plain.record


def test_a_class_token_run_round_trips_through_load_run(tmp_path):
    from edgeprune import api
    from edgeprune.artifact import load_run, save_run
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("deit_tiny_patch16_224", random_init=True, img_size=64, model_kwargs={"depth": 2})
    res = api.prune(spec.create(), images(4, 1).repeat(1, 1, 2, 2), target="mlp", sparsity=0.25, spec=spec,
                    last_block="cls", tokens_merge="3,5")
    assert res.record["tokens_merge"]["r"] == [3, 0] and res.record["tokens_merge"]["output_tokens"] == 1
    save_run(tmp_path / "run", res.model, res.record)
    model, rec = load_run(tmp_path / "run")
    x = images(2, 5).repeat(1, 1, 2, 2)
    assert torch.equal(run(model, x), run(res.model, x))
    assert [b.merge_r for b in find_anatomy(model).blocks] == [3, 0]


# -- bad values --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, pattern", [
    ("-1", "must be >= 0"), ("x", "must be an integer"), ("2.5", "must be an integer"),
    ("decreasing", "needs its R"), ("1,,2", "r of block 1 must be an integer"), ("", "must be an integer")])
def test_bad_schedules_are_one_line(value, pattern):
    with pytest.raises(UserError, match=pattern):
        parse_tokens_merge(value)


def test_schedules_the_model_cannot_take_are_refused():
    with pytest.raises(UserError, match="block 0 would merge 33 tokens but can merge at most 32"):
        merge_plan(vit(), 33)
    with pytest.raises(UserError, match="block 2 would merge 20 tokens but can merge at most 12"):
        merge_plan(vit(), "30,10,20,0")  # 65 -> 35 -> 25 tokens: (25 - 1) // 2 = 12
    with pytest.raises(UserError, match="lists 2 values for a model of 4 blocks"):
        merge_plan(vit(), "1,2")


def test_models_a_merge_does_not_fit_are_refused_saying_where():
    m = vit(class_token=False, global_pool="avg")
    m.global_pool = "token"
    with pytest.raises(UserError, match="no class token"):
        merge_plan(m, 2)
    with pytest.raises(UserError, match="global_pool='max'"):
        merge_plan(vit(class_token=False, global_pool="max"), 2)
    with pytest.raises(UserError, match="attention"):
        merge_plan(vit(global_pool="map"), 2)
    wrapper = torch.nn.Module()  # a network with a ViT inside merges inside each block and unmerges (issue 55)
    wrapper.backbone = vit()
    r, tokens = merge_plan(wrapper, 2)
    assert r == [2] * len(wrapper.backbone.blocks) and len(set(tokens)) == 1
    with pytest.raises(UserError, match="merged already"):
        apply_token_merge(merged(vit(), [2, 0, 0, 0]), [2, 0, 0, 0])


@pytest.mark.parametrize("args, pattern", [
    (["--tokens-merge", "-2"], "--tokens-merge: R must be >= 0"),
    (["--tokens-merge", "four"], "must be an integer"),
    (["--tokens-merge", "20"], "block 1 would merge 20 tokens but can merge at most 14"),
    (["--tokens-merge", "1,2,3"], "lists 3 values for a model of 6 blocks"),
    (["--tokens-merge", "2", "--latency", "0.5", "--latency-table", "t.json"], "--tokens-merge with a --latency"),
])
def test_prune_refuses_bad_tokens_merge_in_one_line(args, pattern, tmp_path):
    if "--latency-table" in args:
        from tests.test_bad_input_41 import hand_table

        hand_table(tmp_path / "t.json")
        args = [a if a != "t.json" else str(tmp_path / "t.json") for a in args]
    r = run_cli(["prune", "--quiet", "--no-eval", "--calib-size", "8", "-o", tmp_path / "run", *args])
    assert_one_line_error(r, pattern)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, pattern", [
    (["--sparsity", "0.5", "--tokens-merge", "-1"], "--tokens-merge: R must be >= 0"),
    (["--latency", "0.5", "--latency-table", "t.json", "--tokens-merge", "2"], "--tokens-merge with a --latency"),
])
def test_deploy_refuses_bad_tokens_merge_before_any_work(args, pattern, tmp_path):
    from tests.test_bad_input_41 import hand_table

    hand_table(tmp_path / "t.json")
    args = [a if a != "t.json" else str(tmp_path / "t.json") for a in args]
    r = run_cli(["deploy", "--device", "cpu", "-o", tmp_path / "dep", *args])
    assert_one_line_error(r, pattern)
    assert not (tmp_path / "dep").exists()


def test_a_recipe_with_a_bad_tokens_merge_is_one_line(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[method]\ntokens-merge = "-3"\n')
    r = run_cli(["prune", "--config", f, "--quiet", "--no-eval", "-o", tmp_path / "run"])
    assert_one_line_error(r, "must be >= 0")
