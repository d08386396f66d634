"""Seams: a criterion and a Q/K solver are each one class/function plus one registration.

The toy criterion below is defined and registered here, in the test, and runs end to end through
``CorpConfig(mlp_criterion="toy")`` on a tiny random-init ViT.
"""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune._compat import import_timm
from edgeprune.anatomy import find_anatomy
from edgeprune.corp import CorpConfig, get_qk_solver, list_qk_solvers, register_qk_solver, unregister_qk_solver
from edgeprune.pruning.corp import corp_prune, statistics_request
from edgeprune.corp.qk_solvers import solve_direct
from edgeprune.errors import UserError
from edgeprune.ranking import Criterion, get_criterion, list_criteria, register_criterion, unregister_criterion


class ToyCriterion(Criterion):
    """Scores channel j by j: the highest indices are kept (no statistics needed)."""

    needs = frozenset()
    applies_to = frozenset({"mlp"})

    def scores(self, stats, weight):
        return torch.arange(weight.shape[1], dtype=torch.float64)


@pytest.fixture(autouse=True)
def toy_criterion():
    """The toy criterion is registered for this file's tests only (the registration is the one
    line a new criterion needs); other test files see the built-in criteria alone."""
    register_criterion("toy")(ToyCriterion)
    yield
    unregister_criterion("toy")
    assert "toy" not in list_criteria()


def _tiny():
    torch.manual_seed(0)
    return import_timm().create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=4, depth=2).eval()


def _images(n=8):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_a_registered_criterion_decides_the_kept_channels():
    model = _tiny()
    dense = copy.deepcopy(model)
    cfg = CorpConfig(mlp_sparsity=0.5, mlp_criterion="toy", target="mlp").validate()
    corp_prune(find_anatomy(model), lambda: [_images()], cfg, progress=False)
    for b_new, b_old in zip(model.blocks, dense.blocks):
        hidden = b_old.mlp.fc1.out_features
        k = b_new.mlp.fc1.out_features
        assert k == hidden // 2
        # the toy scores keep the last k channels: fc1's rows are those rows of the dense fc1
        assert torch.equal(b_new.mlp.fc1.weight, b_old.mlp.fc1.weight[hidden - k:])


def test_a_criterion_declares_the_statistics_collected():

    an = find_anatomy(_tiny())
    for name, mlp, positive in (("toy", False, False), ("magnitude", False, False), ("energy", True, False),
                                ("active", True, True)):
        req = statistics_request(CorpConfig(mlp_sparsity=0.5, mlp_criterion=name, target="mlp", compensation=False),
                                 an, 8, qk_grams=False)
        assert (req.mlp, req.mlp_active) == (mlp, positive), name


def test_unknown_names_are_user_errors_listing_the_known_ones():
    with pytest.raises(UserError) as e:
        CorpConfig(mlp_sparsity=0.5, mlp_criterion="nope").validate()
    assert all(n in str(e.value) for n in list_criteria("mlp")) and "toy" in str(e.value)
    with pytest.raises(UserError, match="V/O criterion 'active'"):
        get_criterion("active", "vo")  # registered, but not for V dims
    with pytest.raises(UserError) as e:
        CorpConfig(attn_sparsity=0.5, qk_solver="nope").validate()
    assert all(n in str(e.value) for n in ("auto", "direct", "cg"))


def test_a_registered_qk_solver_is_used_for_every_head():
    calls = []

    @register_qk_solver("counting")
    def counting(system, alpha):
        calls.append(len(system.keep))
        return solve_direct(system, alpha)

    try:
        ref, model = _tiny(), _tiny()
        x = _images()
        corp_prune(find_anatomy(ref), lambda: [x], CorpConfig.from_target("attn", 0.5, qk_solver="direct"),
                   progress=False)
        corp_prune(find_anatomy(model), lambda: [x], CorpConfig.from_target("attn", 0.5, qk_solver="counting"),
                   progress=False)
        assert len(calls) == sum(b.attn.num_heads for b in model.blocks) and set(calls) == {32}
        for k, v in ref.state_dict().items():
            assert torch.equal(v, model.state_dict()[k]), k
    finally:
        unregister_qk_solver("counting")
    assert "counting" not in list_qk_solvers()
    with pytest.raises(UserError):
        get_qk_solver("counting")


def test_one_prune_validates_its_config_once(monkeypatch):
    from edgeprune.api import prune

    cfg = CorpConfig.from_target("both", 0.5)
    count = []
    orig = CorpConfig.validate
    monkeypatch.setattr(CorpConfig, "validate", lambda self: count.append(1) or orig(self))
    prune(_tiny(), _images(), cfg, batch_size=4)
    assert count == []  # validated by from_target, unchanged since
    cfg.round_to = 16  # a changed config is checked again
    prune(_tiny(), _images(), cfg, batch_size=4)
    assert count == [1]
