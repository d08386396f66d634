"""The measured selection's tests (tests/test_allocation_select.py) on a tiny seeded ViT and noise images instead of
fmnist-vit and its calibration set: the same assertions, a second model, about a second each -- fast enough for the
mutation check of ``edgeprune/allocation/select.py`` (issue 43: its "no tests" mutants).

The test functions are the other file's, collected here again with this file's ``setup`` fixture (pytest resolves a
test's fixtures in the module that collects it)."""

from __future__ import annotations

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp import CorpConfig
from tests.test_allocation_select import (  # noqa: F401  (collected here with this module's fixtures)
    selection,
    test_check_off_falls_back_to_the_proxy,
    test_measured_candidate_is_offered_and_judged_like_the_others,
    test_measured_curves_equal_single_unit_prunes_and_keep_the_proxy_shape,
    test_second_anchor_measures_each_unit_where_the_first_allocation_put_it,
    test_selection_keeps_the_candidate_with_the_lowest_measured_error,
    test_two_anchors_offer_one_more_candidate_and_never_choose_worse,
)
from tests.test_latency_budget import small_vit


@pytest.fixture(scope="module")
def setup():
    """small_vit (2 blocks, 17 tokens, MLP 128), 96 seeded noise images, FLOPs x0.45 with 48 check images: the
    fmnist setup's config on a model the selection folds in milliseconds."""
    model = small_vit()
    x = torch.randn(96, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    an = find_anatomy(model)
    cfg = CorpConfig.from_target("both", None, budget={"kind": "flops", "value": 0.45}, allocation_check_images=48)
    stats = collect_statistics(an, x.split(32), progress=False)
    return model, an, x, cfg, stats
