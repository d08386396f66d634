"""Output bias correction (edgeprune/solve/output_bias.py, ``CorpConfig.bias_correction_images``).

Properties:
* the fold adds exactly the mean output difference to the classifier bias;
* after a real prune with the correction, the pruned model's mean output over the first k
  calibration images equals the dense model's, and its summed squared output error there is the
  uncorrected prune's minus k ||c||^2 (the constant correction is the least-squares optimum);
  nothing but the classifier bias differs from the uncorrected prune;
* pruning nothing changes nothing (the shift is exactly zero);
* only images with index < k are summed, also for a rank's share starting at ``first_image``;
* a headless model is left as it is (the record says why); bad values are one-line errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import edgeprune
from edgeprune.errors import UserError
from edgeprune.solve.output_bias import classifier_head, fold_output_bias, output_sums

from tests.conftest import assert_one_line_error, needs_fmnist, run_cli, tiny_vit

K = 24


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def test_fold_adds_the_mean_output_difference():
    head = nn.Linear(4, 3)
    b0 = head.bias.detach().clone()
    dense = torch.tensor([3.0, -6.0, 9.0], dtype=torch.float64)
    pruned = torch.tensor([1.0, 0.0, 12.0], dtype=torch.float64)
    shift = fold_output_bias(head, dense, pruned, 3)
    assert torch.equal(shift, torch.tensor([2 / 3, -2.0, -1.0], dtype=torch.float64))
    assert torch.allclose(head.bias.double(), b0.double() + shift, atol=1e-7)
    with pytest.raises(ValueError, match="at least one image"):
        fold_output_bias(head, dense, pruned, 0)
    with pytest.raises(ValueError, match="3 outputs"):
        fold_output_bias(head, dense[:2], pruned[:2], 2)


def test_output_sums_count_only_the_first_k_images_of_the_set():
    model = tiny_vit()
    x = _images(10)
    with torch.no_grad():
        ref = model(x).double()
    batches = [x[i:i + 3] for i in range(0, 10, 3)]  # 3, 3, 3, 1 images
    sums, count = output_sums(model, batches, 5)
    assert count == 5 and torch.allclose(sums, ref[:5].sum(0), atol=1e-5)
    # a share starting at image 4 of the set holds one of the first 5 images
    sums, count = output_sums(model, [x[4:7], x[7:10]], 5, first_image=4)
    assert count == 1 and torch.allclose(sums, ref[4], atol=1e-5)
    sums, count = output_sums(model, [x[6:9]], 5, first_image=6)
    assert count == 0


def _prune(k: int, sparsity: float = 0.6, model=None):
    model = model if model is not None else tiny_vit()
    calib = _images(64)
    return model, calib, edgeprune.prune(model, calib, target="both", sparsity=sparsity, batch_size=16,
                                         bias_correction_images=k, head_refit=False)


def test_correction_matches_the_dense_mean_and_removes_k_c_squared_of_the_error():
    dense, calib, plain = _prune(0)
    _, _, corrected = _prune(K, model=dense)
    assert "bias_correction" not in plain.record
    rec = corrected.record["bias_correction"]
    assert rec["images"] == K
    # nothing but the classifier bias differs
    a, b = plain.model.state_dict(), corrected.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        if key != "head.bias":
            assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["head.bias"], b["head.bias"])
    x = calib[:K]
    with torch.no_grad():
        yd, yp, yc = (m(x).double() for m in (dense, plain.model, corrected.model))
    assert torch.allclose(yc.mean(0), yd.mean(0), atol=1e-5)
    c = yd.mean(0) - yp.mean(0)
    assert float(c.norm()) > 1e-3  # a real shift to correct
    assert rec["shift_norm"] == pytest.approx(float(c.norm()), rel=1e-4)
    err_plain = float(((yd - yp) ** 2).sum())
    err_corr = float(((yd - yc) ** 2).sum())
    assert err_corr == pytest.approx(err_plain - K * float((c ** 2).sum()), rel=1e-4)
    assert err_corr < err_plain


def test_pruning_nothing_changes_nothing():
    dense, _, res = _prune(K, sparsity=0.0)
    assert res.record["bias_correction"]["shift_norm"] == 0.0
    assert torch.equal(res.model.head.bias, dense.head.bias)


def test_a_headless_model_is_left_alone():
    model = tiny_vit()
    model.reset_classifier(0)
    assert classifier_head(model) is None
    _, _, res = _prune(K, model=model)
    assert res.record["bias_correction"] == {"images": 0, "skipped": "the model has no affine classifier head"}


def test_bad_values_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="bias correction images"):
        edgeprune.CorpConfig(bias_correction_images=-1).validate()
    r = run_cli(["prune", "--bias-correction", "-3", "--no-eval", "-o", str(tmp_path / "r")])
    assert r.exit_code == 2 and "--bias-correction" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "r").exists()


@needs_fmnist
def test_cli_records_the_correction(tmp_path):
    r = run_cli(["prune", "--sparsity", "0.5", "--calib-size", "64", "--bias-correction", "32", "--no-head-refit",
                 "--no-eval", "--quiet", "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert "output bias correction: mean output shift" in r.output and "over 32 calibration images" in r.output
    _, record = edgeprune.load_run(tmp_path / "run")
    assert record["bias_correction"]["images"] == 32 and record["config"]["bias_correction_images"] == 32
    assert record["bias_correction"]["kind"] == "bias" and "cv_error" not in record["bias_correction"]
    assert_one_line_error(run_cli(["prune", "--bias-correction", "8", "--no-eval", "-o", str(tmp_path / "run")]),
                          "exists")


def test_the_calibration_pass_sums_equal_a_separate_pass():
    """The dense side comes from CORP's own calibration pass (a hook on the model's output)."""
    from edgeprune.anatomy import find_anatomy
    from edgeprune.calibration.collect import collect_statistics

    model = tiny_vit()
    x = _images(20)
    batches = [x[i:i + 6] for i in range(0, 20, 6)]
    stats = collect_statistics(find_anatomy(model), batches, qk=False, progress=False, output_images=K - 10)
    sums, count = output_sums(model, batches, K - 10)
    assert stats.output_count == count == K - 10
    assert torch.allclose(stats.output_sum, sums, rtol=1e-12, atol=1e-12)
    # a share that starts after the first K - 10 images sums nothing, but holds the right width
    later = collect_statistics(find_anatomy(model), batches, qk=False, progress=False, output_images=K - 10,
                               first_image=K)
    assert later.output_count == 0 and torch.equal(later.output_sum, torch.zeros(5, dtype=torch.float64))


def test_sequential_calibration_is_corrected_too():
    dense = tiny_vit()
    calib = _images(32)
    res = edgeprune.prune(dense, calib, target="both", sparsity=0.6, batch_size=16, sequential=True,
                          bias_correction_images=16)
    with torch.no_grad():
        yd, yc = dense(calib[:16]).double(), res.model(calib[:16]).double()
    assert res.record["bias_correction"]["images"] == 16
    assert torch.allclose(yc.mean(0), yd.mean(0), atol=1e-5)


def test_auto_default_corrects_budgeted_prunes_only():
    from edgeprune.corp import ALL_IMAGES, CorpConfig, bias_correction_used

    assert bias_correction_used(CorpConfig()) == 0
    assert bias_correction_used(CorpConfig(budget={"kind": "flops", "value": 0.5})) == ALL_IMAGES
    assert bias_correction_used(CorpConfig(budget={"kind": "flops", "value": 0.5}, bias_correction_images=0)) == 0
    dense = tiny_vit()
    calib = _images(40)
    uniform = edgeprune.prune(dense, calib, target="both", sparsity=0.5, batch_size=16)
    assert "bias_correction" not in uniform.record and uniform.record["settings"]["bias_correction"] == "auto"
    budgeted = edgeprune.prune(dense, calib, flops=0.7, batch_size=16, allocation_check_images=8)
    assert budgeted.record["bias_correction"]["images"] == 40  # every calibration image
    with torch.no_grad():
        assert torch.allclose(budgeted.model(calib).double().mean(0), dense(calib).double().mean(0), atol=1e-5)
