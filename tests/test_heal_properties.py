"""STARFISH healing, method-level properties on the trained fmnist-vit (issue 17):

* healing lowers the alignment loss (eq. 1) by a margin, measured independently of the trainer
  (``measure_alignment`` on the calibration images and on held-out images);
* keep-best: when a later epoch is worse, the returned weights are the best epoch's and they
  reproduce the reported loss.
"""

from __future__ import annotations

import pytest
import torch

import edgeprune
from edgeprune.heal import heal, measure_alignment

from conftest import needs_fmnist

pytestmark = needs_fmnist


@pytest.fixture(scope="module")
def models():
    spec = edgeprune.get_model_spec("fmnist-vit")
    dense = spec.create().eval()
    x = torch.cat([b for b, _ in spec.calibration_source(256, seed=0).batches(256)])   # train split
    held = torch.cat([b for b, _ in spec.eval_source(n=128).batches(128)])             # test split
    calib = x[:128]
    plain = edgeprune.prune(dense, calib, target="both", sparsity=0.7, compensation=False).model
    return {"dense": dense, "calib": calib, "held": held, "plain": plain}


def test_heal_lowers_alignment_loss_by_a_margin(models):
    m = models
    before_held = measure_alignment(m["plain"], m["dense"], m["held"])
    r = heal(m["plain"], m["dense"], m["calib"], epochs=2, batch_size=32, lr=6e-4, keep_best=False)
    before, after = r.info["initial_loss"], r.info["final_loss"]
    assert after < 0.8 * before, (before, after)
    # measured independently of the trainer, on the calibration images and on held-out images
    assert measure_alignment(r.model, m["dense"], m["calib"]) == pytest.approx(after, rel=1e-4)
    after_held = measure_alignment(r.model, m["dense"], m["held"])
    assert after_held < 0.8 * before_held, (before_held, after_held)   # it generalises


def test_heal_restores_the_best_epoch_and_its_loss(models):
    """Epoch 1 heals; then the callback wrecks the trainable weights, so epoch 2 is worse:
    keep-best must return epoch 1's weights, whose measured loss is the reported one."""
    m = models
    import copy

    work = copy.deepcopy(m["plain"])
    trained = {}

    def wreck(epoch, _stats):
        if epoch == 1:
            with torch.no_grad():
                g = torch.Generator().manual_seed(0)
                for name, p in work.named_parameters():
                    if p.requires_grad:
                        trained[name] = p.detach().clone()
                        p.add_(torch.randn(p.shape, generator=g) * 3 * p.abs().mean())

    r = heal(work, m["dense"], m["calib"][:64], epochs=2, batch_size=32, lr=6e-4, keep_best=True,
             callback=wreck, inplace=True)
    evals = [h["eval_loss"] for h in r.history]
    assert len(evals) == 2 and min(evals[1:]) > evals[0], evals   # the construction worked
    assert r.info["best_epoch"] == 1
    assert r.info["final_loss"] == pytest.approx(evals[0], rel=1e-6)
    measured = measure_alignment(r.model, m["dense"], m["calib"][:64])
    assert measured == pytest.approx(evals[0], rel=1e-4), (measured, evals)
    assert measured < evals[-1]
    # the returned weights are exactly epoch 1's
    params = dict(r.model.named_parameters())
    assert trained
    for name, t in trained.items():
        torch.testing.assert_close(params[name].detach(), t, rtol=0, atol=0)


def test_heal_keeps_the_input_when_every_epoch_is_worse(models):
    m = models
    import copy

    work = copy.deepcopy(m["plain"])
    before = measure_alignment(work, m["dense"], m["calib"][:64])
    original = {n: p.detach().clone() for n, p in work.named_parameters()}
    # an absurd learning rate makes every epoch worse than the input
    r = heal(work, m["dense"], m["calib"][:64], epochs=1, batch_size=64, lr=5.0, warmup_steps=0,
             keep_best=True, inplace=True)
    assert r.history[0]["eval_loss"] > before
    assert r.info["best_epoch"] == 0
    assert r.info["final_loss"] == pytest.approx(before, rel=1e-6)
    for n, p in r.model.named_parameters():
        torch.testing.assert_close(p.detach(), original[n], rtol=0, atol=0)
