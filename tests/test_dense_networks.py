"""Issue 55, item 1: a network with a timm ViT inside (``--model-file FILE.py:FUNC``, ``backbone=``), its outputs
compared whole, exported whole, and its bad input refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import edgeprune
from conftest import assert_one_line_error, run_cli
from edgeprune.allocation.outputs import output_error, output_tensor
from edgeprune.anatomy import UnsupportedModelError, find_anatomy
from edgeprune.artifact import load_run
from edgeprune.backbone import BackboneError, backbone_path, set_backbone, vit_paths
from edgeprune.flops import model_flops
from edgeprune.metrics.dense import PSNR_CAP, dense_fidelity
from exporters.onnx import export_onnx
from exporters.verify import verify_onnx
from nets import dense_nets

NETS = Path(dense_nets.__file__).resolve()
X = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def _calib(n=48):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _flat(y):
    out = output_tensor(y)
    return torch.cat([t.flatten(1) for t in out], 1) if isinstance(out, tuple) else out.flatten(1)


@pytest.mark.parametrize("builder", ["saliency_net", "dpt_net", "hook_net"])
def test_sparsity_zero_gives_identical_outputs(builder):
    net = getattr(dense_nets, builder)()
    ref = net(X)
    got = edgeprune.prune(net, _calib(), target="both", sparsity=0.0).model(X)
    assert torch.equal(_flat(got), _flat(ref))


@pytest.mark.parametrize("builder", ["saliency_net", "dpt_net", "hook_net"])
def test_half_sparsity_is_smaller_and_its_onnx_equals_pytorch(builder, tmp_path):
    net = getattr(dense_nets, builder)()
    res = edgeprune.prune(net, _calib(), target="both", sparsity=0.5)
    pruned = res.model
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in net.parameters())
    assert all(b["mlp_hidden"] < 256 for b in res.record["blocks"])
    out = pruned(X)
    assert type(out) is type(net(X))  # the head still runs on the pruned ViT: taps, hooks, dict keys
    if isinstance(out, dict):
        assert list(out) == ["depth", "features"]
    path = export_onnx(pruned, tmp_path / "net.onnx", (3, 32, 32))
    rep = verify_onnx(path, pruned, X, atol=1e-4)
    assert rep["passed"], rep
    import onnx

    names = [o.name for o in onnx.load(str(path)).graph.output]
    assert names == (["depth", "features"] if builder == "dpt_net" else
                     ["output_0", "output_1"] if builder == "hook_net" else ["output"])


def test_taps_read_the_pruned_blocks():
    """The DPT head's intermediate blocks and the hooks are the pruned ones: pruning only block 3's MLP changes the
    4th tap but leaves a head reading blocks 0..2 as it was."""
    net = dense_nets.dpt_net()
    taps = net.pretrained.forward_intermediates(X, indices=[0, 1, 2, 3], intermediates_only=True)
    res = edgeprune.prune(net, _calib(), target="mlp", sparsity=0.5, compensation=False)
    got = res.model.pretrained.forward_intermediates(X, indices=[0, 1, 2, 3], intermediates_only=True)
    assert all(not torch.allclose(a, b) for a, b in zip(got, taps))  # every block was pruned and is read
    hook = dense_nets.hook_net()
    ref = hook(X)[0]
    pruned = edgeprune.prune(hook, _calib(), target="mlp", sparsity=0.5).model
    assert pruned.vit.blocks[1]._forward_hooks and not torch.equal(pruned(X)[0], ref)


def test_two_vits_need_a_named_backbone():
    net = dense_nets.two_vit_net()
    assert vit_paths(net) == ["rgb.vit", "aux"]
    with pytest.raises(UnsupportedModelError, match=r"2 ViTs, at 'rgb.vit', 'aux'"):
        edgeprune.prune(net, _calib(), target="both", sparsity=0.5)
    before = net.rgb.vit.blocks[0].mlp.fc1.weight.clone()
    res = edgeprune.prune(net, _calib(), target="both", sparsity=0.5, backbone="aux")
    assert res.model.aux.blocks[0].mlp.fc1.out_features < 256
    assert torch.equal(res.model.rgb.vit.blocks[0].mlp.fc1.weight, before)  # the other ViT untouched
    assert backbone_path(res.model) == "aux"


def test_backbone_path_that_is_not_a_vit_is_refused():
    net = dense_nets.not_vit_path_net()
    with pytest.raises(BackboneError, match=r"NotViT.decoder is a Conv2d, not a timm ViT .*'vit'"):
        set_backbone(net, "decoder")
    with pytest.raises(BackboneError, match="no module at 'nope'"):
        set_backbone(net, "nope")


def test_network_checks_compare_every_output_equally():
    a, b = torch.ones(4, 3), torch.full((4, 100), 10.0)
    ref = output_tensor({"small": a, "big": b})
    out = output_tensor({"small": a * 1.1, "big": b})
    assert isinstance(ref, tuple) and len(ref) == 2
    assert output_error(out, ref) == pytest.approx(0.01 / 2)  # the mean of 0.01 and 0, not weighted by size


def test_flops_budget_counts_the_head_and_meets_it():
    net = dense_nets.dpt_net()
    an = find_anatomy(net)
    # 4 taps of a 4 x 4 grid: 1x1 convs 64 -> 16, a 3x3 conv 16 -> 1 on the grid, Linear 64 -> 8
    assert model_flops(an)["head"] == 4 * 2 * 64 * 16 * 16 + 2 * 16 * 9 * 16 + 2 * 64 * 8
    res = edgeprune.prune(net, _calib(), flops=0.6)
    assert res.record["flops"] / res.record["dense_flops"] <= 0.6 + 1e-9


def test_dense_fidelity_metrics():
    m = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    same = dense_fidelity([m, m[:, 0, 0]], [m, m[:, 0, 0]], ["map", "feat"])
    assert same["rel_error"] == 0 and same["psnr_db"] == PSNR_CAP and same["iou@0.5"] == 1.0
    worse = dense_fidelity([m.flip(0), m[:, 0, 0]], [m, m[:, 0, 0]], ["map", "feat"])
    assert worse["rel_error"] > 0 and worse["map.psnr_db"] < PSNR_CAP and worse["iou@0.5"] < 1.0
    assert worse["feat.rel_error"] == 0 and worse["rel_error"] == pytest.approx(worse["map.rel_error"] / 2)


def test_cli_prunes_a_network_file_and_the_run_reloads_exports_and_verifies(tmp_path):
    calib, ev = dense_nets.image_folder(tmp_path / "calib", 40, 0), dense_nets.image_folder(tmp_path / "eval", 8, 1)
    run = tmp_path / "run"
    res = run_cli(["prune", "--model-file", f"{NETS}:dpt_net", "--calib", calib, "--eval-data", ev,
                   "--target", "both", "--sparsity", "0.5", "-o", run])
    assert res.exit_code == 0, res.output
    assert "rel. error" in res.stdout and "top-1" not in res.stdout
    rec = json.loads((run / "run.json").read_text())
    assert rec["base_model"]["name"] == f"{NETS}:dpt_net" and rec["base_model"]["output_kind"] == "dense"
    assert rec["evaluation"]["pruned"]["rel_error"] > 0 and "depth.psnr_db" in rec["evaluation"]["pruned"]
    model, _ = edgeprune.load_run(run)
    res = run_cli(["export", run, "-o", tmp_path / "net.onnx"])
    assert res.exit_code == 0, res.output
    res = run_cli(["verify", tmp_path / "net.onnx", "--against", run, "--data", ev])
    assert res.exit_code == 0 and "PASS" in res.stdout, res.output
    assert set(model(X)) == {"depth", "features"}


@pytest.mark.parametrize("argv, pattern", [
    (["--model-file", f"{NETS}:two_vit_net"], "2 ViTs, at 'rgb.vit', 'aux'"),
    (["--model-file", f"{NETS}:two_vit_net", "--backbone", "rgb"], "TwoViTNet.rgb is a Module, not a timm ViT"),
    (["--model-file", f"{NETS}:raising_net"], "raising_net raised RuntimeError: weights file not found"),
    (["--model-file", f"{NETS}:not_a_module"], "returned int, not a torch nn.Module"),
    (["--model-file", f"{NETS}:string_net"], "the network returns str"),
    (["--model-file", f"{NETS}:missing"], "has no function 'missing'"),
    (["--model-file", f"{NETS}"], "FILE.py:FUNCTION"),
    (["--model-file", f"{NETS}:dpt_net", "--model", "fmnist-vit"], "not both"),
    (["--backbone", "encoder"], "--backbone goes with --model-file"),
    (["--model-file", f"{NETS}:dpt_net", "--num-classes", "3"], "--num-classes go with a timm model name"),
])
def test_bad_network_input_is_one_line_exit_2(argv, pattern):
    assert_one_line_error(run_cli(["info", *argv]), pattern)


def test_deploy_takes_a_network_file_and_reports_its_fidelity(tmp_path):
    """Issue 55: ``edgeprune deploy --model-file`` runs every stage on a network with a ViT inside, and its report
    gives the network's fidelity to the dense outputs (relative squared error, PSNR) where a classifier's table has
    top-1 and agreement."""
    calib, ev = dense_nets.image_folder(tmp_path / "calib", 40, 0), dense_nets.image_folder(tmp_path / "eval", 8, 1)
    out = tmp_path / "dep"
    res = run_cli(["deploy", "--model-file", f"{NETS}:dpt_net", "--calib", calib, "--eval-data", ev,
                   "--sparsity", "0.5", "--device", "cpu", "-o", out])
    assert res.exit_code == 0, res.output
    report = (out / "report.md").read_text()
    assert "| model | params | GFLOPs | rel. error vs dense | PSNR dB | predicted ms | measured ms |" in report
    assert "top-1 %" not in report and "(passed)" in report
    rec = json.loads((out / "run" / "run.json").read_text())
    row = json.loads((out / "report.json").read_text())["table"]["pruned"]
    assert row["rel_error"] == rec["evaluation"]["pruned"]["rel_error"] > 0
    assert f"| pruned | {rec['params']:,} |" in report and rec["params"] < rec["dense_params"]


def test_a_builder_takes_img_size_as_its_own_keyword(tmp_path):
    """Issue 55: ``--model-kwargs img_size=N`` goes to the builder (docs/dense.md's example), not through timm's
    refusal of ``img_size`` (``--img-size`` is the option of a timm name); the record keeps it and a load builds the
    same network at that size."""
    calib = dense_nets.image_folder(tmp_path / "calib", 16, 0)
    out = tmp_path / "run"
    res = run_cli(["prune", "--model-file", f"{NETS}:dpt_net", "--model-kwargs", "img_size=48", "--calib", calib,
                   "--sparsity", "0.5", "--no-eval", "--quiet", "-o", out])
    assert res.exit_code == 0, res.output
    base = json.loads((out / "run.json").read_text())["base_model"]
    assert base["model_kwargs"] == {"img_size": 48} and list(base["input_size"]) == [3, 48, 48]
    model, _ = load_run(out)
    assert model(torch.randn(1, 3, 48, 48))["depth"].shape == (1, 1, 48, 48)
    res = run_cli(["prune", "--model-file", f"{NETS}:dpt_net", "--img-size", "48", "--calib", calib,
                   "--sparsity", "0.5", "--no-eval", "--quiet", "-o", tmp_path / "r2"])
    assert res.exit_code == 2 and "not --model-file" in res.output
