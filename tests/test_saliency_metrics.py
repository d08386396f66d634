"""saliency_fidelity / feature_cosine on hand-computable cases."""

from __future__ import annotations

import math

import pytest
import torch

from edgeprune.metrics.saliency import feature_cosine, saliency_fidelity


def test_identical_maps():
    torch.manual_seed(0)
    m = torch.rand(3, 1, 8, 8)
    r = saliency_fidelity(m, m.clone())
    assert r["mae"] == 0.0
    assert r["pearson"] == pytest.approx(1.0, abs=1e-12)
    assert r["iou@0.5"] == 1.0


def test_known_case():
    # image 0: p = [0.0, 0.2, 0.6, 0.8], r = [0.0, 0.4, 0.4, 1.0]
    #   mae = (0 + .2 + .2 + .2)/4 = 0.15
    #   centred p = [-.4, -.2, .2, .4], centred r = [-.45, -.05, -.05, .55]
    #   cov = .18 + .01 - .01 + .22 = .40 ; |p|^2 = .40 ; |r|^2 = .2025+.0025+.0025+.3025 = .51
    #   pearson = .40 / sqrt(.40 * .51)
    #   masks p>=.5: {2,3}; r>=.5: {3} -> IoU 1/2
    # image 1: p = r = 0.1 everywhere -> constant and identical: pearson 1, both masks empty: IoU 1
    p = torch.tensor([[0.0, 0.2], [0.6, 0.8]]).view(1, 1, 2, 2)
    r = torch.tensor([[0.0, 0.4], [0.4, 1.0]]).view(1, 1, 2, 2)
    c = torch.full((1, 1, 2, 2), 0.1)
    out = saliency_fidelity(torch.cat([p, c]), torch.cat([r, c]))
    assert out["mae"] == pytest.approx(0.15 / 2)
    assert out["pearson"] == pytest.approx((0.40 / math.sqrt(0.40 * 0.51) + 1.0) / 2)
    assert out["iou@0.5"] == pytest.approx((0.5 + 1.0) / 2)


def test_anticorrelated_and_disjoint():
    p = torch.tensor([0.0, 1.0, 0.0, 1.0]).view(1, 1, 2, 2)
    r = 1.0 - p
    out = saliency_fidelity(p, r)
    assert out["mae"] == 1.0
    assert out["pearson"] == pytest.approx(-1.0)
    assert out["iou@0.5"] == 0.0


def test_constant_vs_varying_map_pearson_zero():
    p = torch.full((1, 1, 2, 2), 0.3)
    r = torch.tensor([0.0, 0.1, 0.2, 0.3]).view(1, 1, 2, 2)
    out = saliency_fidelity(p, r)
    assert out["pearson"] == 0.0
    assert out["iou@0.5"] == 1.0  # both masks empty


def test_shape_errors():
    with pytest.raises(ValueError):
        saliency_fidelity(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 5))
    with pytest.raises(ValueError):
        saliency_fidelity(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError):
        feature_cosine(torch.zeros(2, 3), torch.zeros(2, 4))


def test_feature_cosine():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [3.0, 4.0]])
    b = torch.tensor([[0.0, 2.0], [2.0, 2.0], [-3.0, -4.0]])
    # cosines 0, 1, -1 -> mean 0
    assert feature_cosine(a, b) == pytest.approx(0.0, abs=1e-12)
    assert feature_cosine(a, a * 5) == pytest.approx(1.0)
    assert feature_cosine(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])) == pytest.approx(1 / math.sqrt(2))
