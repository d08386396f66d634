"""Class-token last block (edgeprune/layers/class_token_block.py, ``--last-block``).

Properties:
* exactness: the block computes the class token(s) as the full block does -- the model's output
  is unchanged up to float rounding (plain and distilled DeiT), also after pruning nothing;
* its FLOPs formula (``edgeprune.flops``) equals PyTorch's FLOP counter, and the allocator's cost
  model prices the converted model exactly (achieved FLOPs == the pruned model's FLOPs);
* a budget is a fraction of the model as given and is met within 1%, never exceeded;
* with a budget the freed FLOPs go to the other blocks: lower output error than the full last
  block at the same budget (held-out images);
* the run record rebuilds it (save/load), ONNX equals PyTorch, heal aligns its T tokens;
* auto: not with --sparsity, not for average pooling, not for a headless backbone; cls on a model
  that reads other tokens is a one-line error; a class-token block that is not the last is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

import edgeprune
from edgeprune.anatomy import UnsupportedModelError, find_anatomy
from edgeprune.errors import UserError
from edgeprune.flops import model_flops
from edgeprune.layers.class_token_block import (ClassTokenBlock, output_query_tokens, to_class_token_block,
                                                to_full_block)

from tests.conftest import assert_one_line_error, run_cli, tiny_vit


def _deit(name: str = "deit_tiny_patch16_224", depth: int = 3, **kw):
    spec = edgeprune.get_model_spec(name, None, True, 10, model_kwargs={"depth": depth, **kw})
    return spec, spec.create(pretrained=False).eval()


def _images(n: int, size: int = 224, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,tokens", [("deit_tiny_patch16_224", 1), ("deit_tiny_distilled_patch16_224", 2)])
def test_conversion_is_exact_and_counted_exactly(name, tokens):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    _, dense = _deit(name, depth=2)
    x = _images(3)
    model = copy.deepcopy(dense)
    assert output_query_tokens(model) == tokens
    assert to_class_token_block(model, tokens) == 1
    with torch.no_grad():
        y, y_dense = model(x), dense(x)
        feats = model.forward_features(x)
    assert feats.shape[1] == tokens  # the other tokens are not computed at all
    assert torch.allclose(y, y_dense, atol=1e-5, rtol=1e-5)
    an = find_anatomy(model)
    assert an.blocks[-1].query_tokens == tokens and an.blocks[0].query_tokens is None
    flops = model_flops(an)
    n, D, H, d, m = an.num_tokens, 192, 3, 64, 768
    last = 2 * n * D * H * 2 * d + 2 * tokens * D * H * d + 2 * tokens * n * H * 2 * d + 2 * tokens * H * d * D \
        + 4 * tokens * D * m
    assert flops["blocks"][1]["total"] == last
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            model(x[:1])
    extra_head = 2 * 192 * 10 if tokens == 2 else 0  # the distilled head_dist is not in model_flops
    assert counter.get_total_flops() == flops["total"] + extra_head
    assert to_full_block(model) == tokens and not isinstance(model.blocks[-1], ClassTokenBlock)
    with torch.no_grad():
        assert torch.allclose(model(x), y_dense, atol=1e-5, rtol=1e-5)


def test_pruning_nothing_with_the_class_token_block_changes_only_the_flops():
    spec, dense = _deit()
    x = _images(16)
    res = edgeprune.prune(dense, x, sparsity=0.0, last_block="cls", spec=spec)
    xe = _images(4, seed=1)
    with torch.no_grad():
        assert torch.allclose(res.model(xe), dense(xe), atol=1e-5, rtol=1e-5)
    rec = res.record
    assert rec["blocks"][-1]["query_tokens"] == 1 and rec["settings"]["class_token_blocks"] == {"2": 1}
    assert rec["params"] == rec["dense_params"]
    assert rec["flops"] < rec["dense_flops"]
    assert rec["flops"] == model_flops(find_anatomy(res.model))["total"]


@pytest.fixture(scope="module")
def budget_pair():
    """deit_tiny (3 blocks, random init) at FLOPs x0.6: auto (class-token last block) and full."""
    spec, dense = _deit()
    x = _images(24)
    runs = {lb: edgeprune.prune(dense, x, flops=0.6, last_block=lb, allocation_check_images=8, spec=spec)
            for lb in ("auto", "full")}
    return spec, dense, runs


def test_budget_is_met_against_the_model_as_given_and_priced_exactly(budget_pair):
    _, dense, runs = budget_pair
    dense_flops = model_flops(find_anatomy(dense))["total"]
    for lb, res in runs.items():
        rec, alloc = res.record, res.record["allocation"]
        achieved = model_flops(find_anatomy(res.model))["total"]
        assert rec["dense_flops"] == dense_flops and alloc["dense_flops"] == dense_flops
        assert alloc["flops"] == achieved == rec["flops"]  # the cost model prices the converted block exactly
        assert 0.6 * 0.99 * dense_flops <= achieved <= 0.6 * dense_flops
    assert isinstance(runs["auto"].model.blocks[-1], ClassTokenBlock)
    assert not isinstance(runs["full"].model.blocks[-1], ClassTokenBlock)
    assert runs["auto"].record["allocation"]["class_token_blocks"] == {"2": 1}
    # pruning the last block's MLP would save the FLOPs of one token only: the budget goes elsewhere
    assert runs["auto"].record["blocks"][-1]["mlp_hidden"] == 768


def test_the_freed_flops_lower_the_output_error(budget_pair):
    _, dense, runs = budget_pair
    xe = _images(16, seed=5)
    with torch.no_grad():
        ref = dense(xe)
        err = {lb: float((r.model(xe) - ref).pow(2).mean()) for lb, r in runs.items()}
    assert err["auto"] < 0.8 * err["full"], err


def test_run_record_onnx_and_heal(budget_pair, tmp_path):
    from exporters.onnx import export_onnx
    from exporters.verify import verify_onnx

    _, dense, runs = budget_pair
    res = runs["auto"]
    edgeprune.save_run(tmp_path / "run", res.model, res.record)
    model, rec = edgeprune.load_run(tmp_path / "run")
    assert isinstance(model.blocks[-1], ClassTokenBlock) and model.blocks[-1].query_tokens == 1
    xe = _images(4, seed=2)
    with torch.no_grad():
        assert torch.equal(model(xe), res.model(xe))
    path = export_onnx(model, tmp_path / "m.onnx", (3, 224, 224))
    report = verify_onnx(path, model, xe, atol=1e-4)
    assert report["passed"], report
    from edgeprune.heal import heal

    healed = heal(model, dense, _images(16, seed=3), epochs=1, batch_size=8)
    assert isinstance(healed.model.blocks[-1], ClassTokenBlock)


def test_alignment_compares_the_class_token_block_with_its_targets_tokens():
    from edgeprune.heal.alignment import per_image_alignment

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 5, 4, generator=g) for _ in range(2)]
    out = [torch.randn(2, 5, 4, generator=g), torch.randn(2, 1, 4, generator=g)]
    for kind in ("cosine", "mse"):
        got = per_image_alignment(out, full, kind)
        want = per_image_alignment([out[0], out[1]], [full[0], full[1][:, :1]], kind)
        assert torch.equal(got, want)
    with pytest.raises(ValueError):
        per_image_alignment([torch.randn(2, 6, 4)], [torch.randn(2, 5, 4)])


def test_auto_is_off_without_a_budget_for_average_pooling_and_for_headless_backbones():
    spec, dense = _deit()
    x = _images(12)
    res = edgeprune.prune(dense, x, sparsity=0.3, spec=spec)
    assert not isinstance(res.model.blocks[-1], ClassTokenBlock)
    assert "query_tokens" not in res.record["blocks"][-1]
    avg = tiny_vit()
    avg.global_pool = "avg"
    assert output_query_tokens(avg) is None
    cfg = edgeprune.CorpConfig.from_target("all", None, budget={"kind": "flops", "value": 0.8})
    from edgeprune.layers.class_token_block import class_token_plan

    assert class_token_plan(cfg, find_anatomy(avg)) == {}
    headless = tiny_vit()
    headless.reset_classifier(0)
    assert class_token_plan(cfg, find_anatomy(headless)) == {}
    cls = edgeprune.CorpConfig.from_target("all", None, budget={"kind": "flops", "value": 0.8}, last_block="cls")
    assert class_token_plan(cls, find_anatomy(headless)) == {1: 1}
    with pytest.raises(UserError, match="reads only the class token"):
        class_token_plan(cls, find_anatomy(avg))
    with pytest.raises(UserError, match="unknown last block"):
        edgeprune.CorpConfig.from_target("both", 0.5, last_block="first")


def test_class_token_block_must_be_last():
    model = tiny_vit()
    model.blocks[0] = ClassTokenBlock(model.blocks[0], 1)
    with pytest.raises(UnsupportedModelError, match="not the last block"):
        find_anatomy(model)


def test_cli_prints_it_and_refuses_cls_for_an_average_pooling_model(tmp_path):
    from tests.test_cli import _image_folder

    calib = _image_folder(tmp_path / "calib", n=4)
    common = ["prune", "--quiet", "--model", "deit_tiny_patch16_224", "--random-init", "--calib", str(calib),
              "--calib-size", "4", "--flops", "0.7", "--check-images", "0", "--no-eval"]
    r = run_cli(common + ["--model-kwargs", "depth=2", "-o", str(tmp_path / "ok")])
    assert r.exit_code == 0, r.output
    assert "block 1 computes only the first 1 token(s)" in r.stdout
    rec = edgeprune.artifact.read_record(tmp_path / "ok")
    assert rec["blocks"][-1]["query_tokens"] == 1 and rec["settings"]["last_block"] == "auto"
    info = run_cli(["info", str(tmp_path / "ok")])
    assert info.exit_code == 0 and "| 1 (computes 1 token(s): class-token block) |" in info.stdout, info.output
    out = tmp_path / "avg"
    r = run_cli(common + ["--model-kwargs", 'depth=2,global_pool="avg"', "--last-block", "cls", "-o", str(out)])
    assert_one_line_error(r, "--last-block cls needs a timm ViT")
    assert not out.exists()
