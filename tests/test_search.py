"""The candidate search written once (issue 53 item 4, edgeprune.pruning.search): a toy axis with known errors, and
the two real axes (embed_sparsity="auto", tokens_merge="auto") going through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import edgeprune
from edgeprune.errors import UserError
from edgeprune.pruning import dispatch, search
from edgeprune.pruning.embed_auto import EMBED_AXIS
from edgeprune.pruning.tokens_auto import TOKENS_AXIS
from edgeprune.pruning.search import Axis, Found
from tests.test_embed import _images, _vit
from tests.test_latency_budget import small_vit
from tests.test_latency_tokens import with_axis
from tests.test_tokens_auto import FAST as TOKENS_FAST, _x


class _Scaled(nn.Module):
    """``y = scale * x`` (a parameter, so the search finds its device): relative squared error (scale - 1)^2 against
    the dense ``scale = 1``."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(scale), dtype=torch.float64))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.scale * x.double()  # exact for the deltas below: equal errors tie exactly


class _Config:
    allocation_check_images = 4
    toy = "auto"


def _toy_axis(deltas: dict, skipped: list | None = None, log: list | None = None) -> Axis:
    """An axis of candidates ``name -> delta`` (in this order, the lightest first): candidate ``name``'s prune is
    ``_Scaled(1 + delta)``, so its check error is ``delta ** 2``."""
    log = [] if log is None else log

    def runner(model, calibration, config, **kwargs):
        log.append(("runner", kwargs))

        def run(candidate):
            log.append(("run", candidate))
            return _Scaled(1 + deltas[candidate]), {"config": {"toy": candidate}}

        return run

    return Axis(name="toy", flag="--toy", setting="toy", is_asked=lambda c: c.toy == "auto",
                check=lambda model, config: log.append(("check",)),
                candidates=lambda model, config: (list(deltas), list(skipped or [])),
                skip_label=lambda s: s["toy"], runner=runner,
                row=lambda c, rec, config, err, seconds: {"toy": c, "check_error": err, "seconds": seconds},
                section=lambda f: {"asked": "auto", "chosen": f.chosen, "images": f.images, "candidates": f.rows,
                                   "skipped": f.skipped, "check_error": f.check_error})


def _batches():
    return iter([torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
                 torch.randn(3, 5, generator=torch.Generator().manual_seed(1))])


def _search(axis, dense=None, **kwargs):
    return search.search(axis, dense if dense is not None else _Scaled(1.0), None, _Config(), _batches, **kwargs)


def test_the_smallest_error_is_chosen_and_every_candidate_recorded():
    log = []
    skipped = [{"toy": "z", "reason": "the toy budget cannot reach it"}]
    pruned, rec = _search(_toy_axis({"a": 0.3, "b": -0.1, "c": 0.2}, skipped, log), batch_size=7)
    auto = rec["toy_auto"]
    assert auto["chosen"] == "b" and pruned.scale.item() == pytest.approx(0.9)
    assert [r["toy"] for r in auto["candidates"]] == ["a", "b", "c"]
    assert [r["check_error"] for r in auto["candidates"]] == pytest.approx([0.09, 0.01, 0.04])
    assert auto["check_error"] == pytest.approx(0.01) and auto["images"] == 4  # the first 4 of 3 + 3 images
    assert auto["skipped"] == skipped and rec["config"] == {"toy": "b"}
    assert all(r["seconds"] >= 0 for r in auto["candidates"])
    # the refusals, then one runner (the prune keywords handed on), then one run per candidate
    assert log == [("check",), ("runner", {"batch_size": 7}), ("run", "a"), ("run", "b"), ("run", "c")]


def test_ties_go_to_the_earlier_lighter_candidate():
    for deltas, chosen in (({"light": 0.5, "heavy": -0.5}, "light"),
                           ({"light": 0.5, "mid": 0.25, "heavy": -0.25}, "mid"), ({"only": 0.5}, "only")):
        assert _search(_toy_axis(deltas))[1]["toy_auto"]["chosen"] == chosen


def test_the_dense_reference_is_computed_once(monkeypatch):
    calls = []
    real = search._dense_reference
    monkeypatch.setattr(search, "_dense_reference", lambda *a: calls.append(1) or real(*a))
    dense = _Scaled(1.0)
    dense.train()
    _search(_toy_axis({"a": 0.1, "b": 0.2, "c": 0.3}), dense)
    assert calls == [1] and dense.calls == 1  # one forward pass of the dense model, for all three candidates
    assert dense.training  # its mode restored


def test_refusals_and_no_candidate_left_before_any_pass(monkeypatch):
    log = []
    monkeypatch.setattr(search, "_dense_reference", lambda *a: pytest.fail("no pass expected"))
    with pytest.raises(UserError, match="--toy auto prunes one copy per candidate; inplace=True"):
        _search(_toy_axis({"a": 0.1}, log=log), inplace=True)
    skipped = [{"toy": "a", "reason": "too heavy"}, {"toy": "b", "reason": "same as a"}]
    with pytest.raises(UserError, match=r"^--toy auto: no candidate left \(a: too heavy; b: same as a\)$"):
        _search(_toy_axis({}, skipped, log))
    assert log == [("check",)]  # inplace refused before the axis's checks; no runner built


def test_dispatch_finds_the_axis_by_the_setting_that_is_auto():
    assert dispatch.SEARCHED == {"embed_sparsity": EMBED_AXIS, "tokens_merge": TOKENS_AXIS}
    assert all(isinstance(a, Axis) and a.setting == key for key, a in dispatch.SEARCHED.items())
    assert isinstance(Found, type)


def test_both_real_axes_go_through_the_search(monkeypatch, tmp_path):
    seen = []
    real = search.search

    def spy(axis, *args, **kwargs):
        seen.append(axis.name)
        return real(axis, *args, **kwargs)

    monkeypatch.setattr(search, "search", spy)
    res = edgeprune.prune(_vit(), _images(16), flops=0.5, embed_sparsity="auto", embed_candidates=(0.25,),
                          batch_size=16, allocation_sensitivity=False, allocation_check_images=8, head_refit=False)
    assert [c["embed_sparsity"] for c in res.record["embed_auto"]["candidates"]] == [0.0, 0.25]
    table = with_axis(tmp_path / "t.json", head_ms=0.1, dim_ms=0.01, mlp_ms=0.01)
    res = edgeprune.prune(small_vit(), _x(16), latency=0.6, latency_table=table, tokens_merge="auto",
                          tokens_candidates=(2,), **TOKENS_FAST)
    assert [c["schedule"] for c in res.record["tokens_auto"]["candidates"]] == [0, 2]
    assert seen == ["embed", "tokens"]
    res = edgeprune.prune(small_vit(), _x(16), latency=0.6, latency_table=table, **{**TOKENS_FAST, "tokens_merge": 2})
    assert seen == ["embed", "tokens"] and "tokens_auto" not in res.record  # a fixed setting: no search
