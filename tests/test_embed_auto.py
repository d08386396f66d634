"""``embed_sparsity="auto"`` (issue 33): the budget chooses D' by the measured output error."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

import edgeprune
from edgeprune.allocation.select import output_error
from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import load_run, save_run
from edgeprune.jobs.prune_report import report_embed_auto as _report_embed_auto
from edgeprune.corp import CorpConfig
from edgeprune.pruning.embed_auto import candidate_sparsities
from edgeprune.embed.fold import fold_layerscale, map_writers, stream_parts
from edgeprune.errors import UserError
from tests.conftest import assert_one_line_error, run_cli
from tests.test_embed import _images, _vit
from tests.test_latency_budget import make_table

FAST = dict(allocation_sensitivity=False, allocation_check_images=16, head_refit=False)  # head refit: slow CV


def _nonlinear_low_rank(model: nn.Module, k: int, seed: int = 7) -> nn.Module:
    """``model`` with O(1) random Linear weights (so GELU and softmax are far from linear and the width
    pruning loses something) whose every writer writes into one fixed k-dim subspace of the stream
    (so a slice to D' >= k + 1 is exact)."""
    _full_rank(model, seed)
    anatomy = find_anatomy(model)
    g = torch.Generator().manual_seed(seed + 1)
    q, _ = torch.linalg.qr(torch.randn(anatomy.embed_dim, k, dtype=torch.float64, generator=g))
    fold_layerscale(anatomy)
    map_writers(anatomy, stream_parts(anatomy), q @ q.T)
    return model


def _chosen_row(auto: dict) -> dict:
    return next(c for c in auto["candidates"] if c["embed_sparsity"] == auto["chosen"])


def _full_rank(model: nn.Module, seed: int = 7) -> nn.Module:
    """``model`` with O(1) random Linear weights (its stream fills all D dims: no slice is free)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / math.sqrt(m.in_features))
    return model


def test_auto_keeps_the_smallest_recorded_check_error():
    model = _full_rank(_vit())  # D = 32
    calib = _images(32)
    res = edgeprune.prune(model, calib, flops=0.5, embed_sparsity="auto", embed_candidates=(0.25, 0.5),
                          batch_size=32, **FAST)
    auto = res.record["embed_auto"]
    rows = auto["candidates"]
    assert [c["embed_sparsity"] for c in rows] == [0.0, 0.25, 0.5] and auto["images"] == 16
    assert [c["embed_dim"] for c in rows] == [32, 24, 16]
    assert len({c["check_error"] for c in rows}) == len(rows)  # distinct: the choice below means something
    assert _chosen_row(auto)["check_error"] == min(c["check_error"] for c in rows)
    assert res.record["config"]["embed_sparsity"] == auto["chosen"]
    assert res.record.get("embed", {}).get("embed_dim", 32) == auto["embed_dim"] == res.model.embed_dim
    for c in rows:
        assert c["budget_fraction"] <= 0.5 + 1e-9 and c["seconds"] > 0
    # the recorded error is the chosen model's own error on the first 16 calibration images
    with torch.no_grad():
        again = output_error(res.model(calib[:16]), model(calib[:16]))
    assert again == pytest.approx(_chosen_row(auto)["check_error"], rel=1e-6)
    # the S = 0 candidate is the widths-alone prune
    widths = edgeprune.prune(model, calib, flops=0.5, batch_size=32, **FAST)
    with torch.no_grad():
        assert output_error(widths.model(calib[:16]), model(calib[:16])) == rows[0]["check_error"]


def test_auto_slices_a_stream_that_lives_in_a_subspace():
    model = _nonlinear_low_rank(_vit(), 15)  # D = 32, stream in 15 dims: D' = 16 is exact
    x = _images(32)
    res = edgeprune.prune(model, x, flops=0.3, embed_sparsity="auto", embed_candidates=(0.25, 0.5),
                          batch_size=32, **FAST)
    auto = res.record["embed_auto"]
    errors = {c["embed_sparsity"]: c["check_error"] for c in auto["candidates"]}
    assert set(errors) == {0.0, 0.25, 0.5}
    assert auto["chosen"] > 0 and res.model.embed_dim < 32
    assert errors[auto["chosen"]] < 0.1 * errors[0.0]  # the slice is free, the widths are not
    assert all(c["budget_fraction"] <= 0.3 + 1e-9 for c in auto["candidates"])


def test_candidates_drop_duplicate_widths_and_keep_zero():
    model = _vit()  # D = 32, round_to 8: 0.1 -> 32 (= 0), 0.2 -> 24 (= 0.25's)
    cfg = CorpConfig.from_target("all", None, budget={"kind": "flops", "value": 0.5}, embed_sparsity="auto",
                                 embed_candidates=(0.25, 0.2, 0.1))
    kept, skipped = candidate_sparsities(model, cfg)
    assert kept == [(0.0, 32), (0.2, 24)]
    assert {s["embed_sparsity"] for s in skipped} == {0.1, 0.25}


def test_auto_refusals_before_any_pass(tmp_path):
    model = _vit()
    x = _images(8)
    for kw, pattern in ((dict(sparsity=0.5), "needs a budget"),
                        (dict(flops=0.5, embed_order="last"), "drop embed_order last"),  # the Python keyword
                        (dict(flops=0.5, allocation_check_images=0), "give allocation_check_images >= 1"),
                        (dict(flops=0.5, embed_candidates=(0.5, 1.5)), "embed candidates")):
        with pytest.raises(UserError, match=pattern):
            edgeprune.prune(model, x, embed_sparsity="auto", **kw)
    with pytest.raises(UserError, match="go with embed_sparsity='auto'"):
        edgeprune.prune(model, x, flops=0.5, embed_sparsity=0.25, embed_candidates=(0.5,))
    for s in ("auto", 0.25):  # a fixed slice cannot be priced by the dense table either
        with pytest.raises(UserError, match="cannot be priced with --latency"):
            edgeprune.prune(model, x, latency=0.5, latency_table=make_table(tmp_path / "t.json"), embed_sparsity=s)
    with pytest.raises(UserError, match="inplace"):
        edgeprune.prune(model, x, flops=0.5, embed_sparsity="auto", inplace=True)
    base = ["prune", "--model", "fmnist-vit", "--no-eval", "--calib-size", "8"]
    for extra, pattern in ((["--embed-sparsity", "auto"], "needs a budget"),
                           (["--flops", "0.5", "--embed-sparsity", "auto", "--embed-order", "last"],
                            "embed-order last"),
                           (["--flops", "0.5", "--embed-sparsity", "a quarter"], "'auto'")):
        r = run_cli(base + extra + ["-o", tmp_path / "bad"])
        assert_one_line_error(r, pattern)
        assert "calibration" not in r.stdout and not (tmp_path / "bad").exists()


def test_saved_auto_runs_reload_with_their_logits(tmp_path, capsys):
    spec = edgeprune.get_model_spec("deit_tiny_patch16_224", random_init=True, img_size=32,
                                    model_kwargs={"depth": 2, "init_values": 0.5, "embed_dim": 32, "num_heads": 2})
    x = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    sliced = _nonlinear_low_rank(spec.create(), 15)  # D = 32 in 15 dims: D' = 16 exact
    runs = {"sliced": edgeprune.prune(sliced, x, flops=0.65, embed_sparsity="auto", embed_candidates=(0.5,),
                                      spec=spec, batch_size=16, **FAST),
            "zero": edgeprune.prune(spec.create(), x, flops=0.7, embed_sparsity="auto", embed_candidates=(0.0,),
                                    spec=spec, batch_size=16, **FAST)}
    assert runs["sliced"].record["embed_auto"]["chosen"] == 0.5 and runs["sliced"].record["embed"]["embed_dim"] == 16
    assert runs["zero"].record["embed_auto"]["chosen"] == 0.0 and "embed" not in runs["zero"].record
    for name, res in runs.items():
        save_run(tmp_path / name, res.model, json.loads(json.dumps(res.record)))
        loaded, rec = load_run(tmp_path / name)
        assert rec["embed_auto"]["chosen"] == res.record["embed_auto"]["chosen"]
        assert loaded.embed_dim == res.model.embed_dim
        with torch.no_grad():
            assert torch.equal(loaded(x), res.model(x))
    _report_embed_auto(runs["sliced"].record["embed_auto"])  # what `edgeprune prune` prints
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["embed auto: S 0", "embed auto: S 0.5", "embed auto: chose S 0.5"]
