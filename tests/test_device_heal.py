"""Devices for ``heal`` and ``derive`` (issue 13): ``device=`` / ``--device cpu|cuda|cuda:N|auto``.

CPU tests run everywhere and go through the same code (models moved to the device and back,
batches and targets moved per batch, the device resolved, printed and recorded) with
``device="cpu"``; ``--device cuda`` without CUDA is a one-line error before any work. The CUDA
tests compare a CUDA heal / derivation with the CPU one and skip without CUDA.

Tiny random timm ViTs keep the API tests fast; the CLI tests use fmnist-vit with a few images.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn as nn

from edgeprune.api import prune
from edgeprune.artifact import load_run, save_run
from edgeprune.errors import UserError
from edgeprune.heal import HealConfig, heal
from edgeprune.heal.runs import healed_record
from edgeprune.nuwa import svd_cache
from edgeprune.nuwa.config import DeriveConfig
from edgeprune.nuwa.derive import derive
from edgeprune.nuwa.skp import SKPConfig
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: compares a CUDA heal/derivation with the CPU one")


@pytest.fixture(autouse=True)
def _one_thread(tmp_path, monkeypatch):
    """One intra-op thread (tiny matmuls, shared machine) and a private SVD cache."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("EDGEPRUNE_CACHE", str(tmp_path / "cache"))
    svd_cache.clear_memory()
    yield
    svd_cache.clear_memory()
    torch.set_num_threads(n)


def _tiny(seed: int = 0) -> nn.Module:
    """2-block timm ViT: 16x16x1, patch 4 (17 tokens), width 32, 2 heads x 16, MLP 128, 6 classes."""
    from edgeprune._compat import import_timm

    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=16, patch_size=4, in_chans=1, num_classes=6, embed_dim=32, depth=2,
                              num_heads=2, mlp_ratio=4.0, qkv_bias=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) / math.sqrt(mod.in_features))
                mod.bias.copy_(0.3 * torch.randn(mod.bias.shape, generator=g))
    return model.eval()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _devices(model: nn.Module) -> set[str]:
    return {p.device.type for p in model.parameters()}


@pytest.fixture(scope="module")
def tiny_heal():
    """(dense, pruned at 0.5 uncompensated, 32 calibration images)."""
    torch.set_num_threads(1)
    dense = _tiny(0)
    calib = torch.randn(32, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    pruned = prune(dense, calib, target="both", sparsity=0.5, compensation=False).model
    return dense, pruned, calib


HEAL_KW = dict(epochs=2, batch_size=8, lr=1e-3, warmup_steps=0)


# ---- heal on the CPU, device given explicitly -------------------------------------------------------
def test_heal_on_cpu_explicitly_records_the_device_and_improves(tiny_heal, tmp_path):
    dense, pruned, calib = tiny_heal
    dense_before = _state(dense)
    res = heal(pruned, dense, calib, device="cpu", **HEAL_KW)
    assert res.config.device == "cpu" and res.info["device"] == "cpu" and res.info["config"]["device"] == "cpu"
    assert res.info["final_loss"] < res.info["initial_loss"]  # healing aligns (eq. 1)
    assert _devices(res.model) == {"cpu"} and _devices(dense) == {"cpu"}
    after = _state(dense)
    assert all(torch.equal(dense_before[k], after[k]) for k in after)  # the dense model is only read
    rec = healed_record({"method": "uncompensated"}, res, tmp_path / "in")
    assert rec["healing"]["device"] == "cpu"
    # the disk-cache target path (targets on the host, moved per batch) gives the same heal
    cached = heal(pruned, dense, calib, device="cpu", target_cache=tmp_path / "targets", **HEAL_KW)
    assert cached.info["targets"]["kind"] == "disk-cache"
    assert [h["loss"] for h in cached.history] == pytest.approx([h["loss"] for h in res.history], rel=1e-6)


def test_auto_resolves_to_cuda_only_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert HealConfig(device="auto").device == "cpu"
    cfg = DeriveConfig(device="auto")
    cfg.validate()
    assert cfg.device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert HealConfig(device="auto").device == "cuda"
    cfg = DeriveConfig(device="auto")
    cfg.validate()
    assert cfg.device == "cuda"


def test_bad_devices_are_user_errors_before_work(tiny_heal, monkeypatch):
    dense, pruned, calib = tiny_heal
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"CUDA is not available \(use --torch-device cpu\)"):
        HealConfig(device="cuda")
    with pytest.raises(UserError, match="unknown device 'tpu'"):
        HealConfig(device="tpu")
    import edgeprune.heal.trainer as trainer

    monkeypatch.setattr(trainer, "make_targets", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(UserError, match="CUDA is not available"):
        heal(pruned, dense, calib, device="cuda:0", epochs=1)
    nuwa_derive = importlib.import_module("edgeprune.nuwa.derive")  # the package re-exports derive()

    monkeypatch.setattr(nuwa_derive, "run_skp", lambda *a, **k: pytest.fail("SKP started"))
    x = torch.randn(40, 1, 16, 16)
    y = torch.arange(40) % 3
    with pytest.raises(UserError, match="CUDA is not available"):
        derive(_tiny(2), [0, 1], x, y, flops=0.8, config=DeriveConfig(device="cuda", val_size=8))


# ---- derive on the CPU, device given explicitly -----------------------------------------------------
def _derive_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 1, 16, 16, generator=g)
    y = torch.randint(0, 3, (96,), generator=g)
    return x, y


def _derive_config(device: str, steps: int = 0) -> DeriveConfig:
    return DeriveConfig(skp=SKPConfig(steps=steps, eval_every=2), val_size=16, calib_size=32, rho=0.95,
                        cache=False, device=device)


def test_derive_on_cpu_explicitly_records_the_device(monkeypatch):
    nuwa_derive = importlib.import_module("edgeprune.nuwa.derive")  # the package re-exports derive()

    seen = []
    real = nuwa_derive.collect_statistics
    monkeypatch.setattr(nuwa_derive, "collect_statistics",
                        lambda *a, **k: seen.append(k.get("device")) or real(*a, **k))
    base = _tiny(4)
    before = _state(base)
    x, y = _derive_inputs()
    res = derive(base, [0, 1, 2], x, y, flops=0.7, config=_derive_config("cpu", steps=4))
    assert seen == ["cpu"]  # the calibration pass ran on the requested device
    assert res.record["device"] == "cpu" and res.record["config"]["device"] == "cpu"
    assert _devices(res.model) == {"cpu"} and _devices(res.anchor_model) == {"cpu"} and _devices(base) == {"cpu"}
    assert all(torch.equal(before[k], v) for k, v in _state(base).items())  # base not modified
    assert all(p.requires_grad for p in base.parameters())  # SKP restored the flags
    assert res.record["flops"] <= 0.7 * res.record["dense_flops"]


# ---- the CLI ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fmnist_run(tmp_path_factory):
    """An fmnist-vit run pruned at 0.5 (uncompensated) on 16 seeded noise images."""
    from edgeprune.zoo.registry import get_model_spec

    torch.set_num_threads(1)
    spec = get_model_spec("fmnist-vit")
    calib = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    res = prune(spec.create(pretrained=True), calib, target="both", sparsity=0.5, compensation=False, spec=spec)
    root = tmp_path_factory.mktemp("device_runs")
    save_run(root / "half", res.model, res.record)
    return root / "half"


@pytest.mark.parametrize("cmd", ["heal", "derive"])
def test_cli_cuda_without_cuda_is_one_line_error(cmd, fmnist_run, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a CUDA machine
    args = ([cmd, fmnist_run] if cmd == "heal" else [cmd, "--classes", "0,1", "--flops", "0.6"])
    result = run_cli([*args, "--torch-device", "cuda", "-o", tmp_path / "out", "--quiet"])
    assert_one_line_error(result, "CUDA is not available (use --torch-device cpu)")
    assert not (tmp_path / "out").exists()
    result = run_cli([*args, "--torch-device", "cuda:x", "-o", tmp_path / "out", "--quiet"])
    assert_one_line_error(result, "unknown device 'cuda:x'")


@pytest.mark.parametrize("cmd", ["heal", "derive"])
def test_cli_device_defaults_to_auto(cmd):
    result = run_cli([cmd, "--help-all"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.replace("│", " ").split())
    assert "cuda:N or auto" in text and "[cpu with a CPU profile, else auto]" in text


@needs_fmnist
def test_cli_derive_prints_and_records_the_device(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # default "auto" -> cpu here
    out = tmp_path / "derived"
    result = run_cli(["derive", "--classes", "0,1", "--flops", "0.7", "--skp-steps", "0", "--train-per-class", "20",
                      "--val-size", "8", "--calib-size", "8", "--rho", "0.95", "--no-eval", "--no-cache",
                      "--quiet", "-o", out])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].endswith("; device cpu")
    model, rec = load_run(out)
    assert rec["device"] == "cpu" and rec["config"]["device"] == "cpu" and _devices(model) == {"cpu"}


@needs_fmnist
def test_cli_heal_prints_and_records_the_device(fmnist_run, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # default "auto" -> cpu here
    out = tmp_path / "healed"
    result = run_cli(["heal", fmnist_run, "--calib-size", 8, "--epochs", 1, "--batch-size", 8, "--no-eval",
                      "--quiet", "-o", out])
    assert result.exit_code == 0, result.output
    assert " on cpu: calibration" in result.stdout
    model, rec = load_run(out)
    assert rec["healing"]["device"] == "cpu" and rec["healing"]["config"]["device"] == "cpu"
    assert _devices(model) == {"cpu"}


# ---- CUDA against the CPU (skipped without CUDA) ------------------------------------------------------
def _trajectory(res) -> list[float]:
    return ([res.info["initial_loss"]] + [h[k] for h in res.history for k in ("loss", "eval_loss")]
            + [res.info["final_loss"]])


@needs_cuda
def test_cuda_heal_matches_the_cpu_heal(tiny_heal, tmp_path):
    dense, pruned, calib = tiny_heal
    cpu = heal(pruned, dense, calib, device="cpu", **HEAL_KW)
    gpu = heal(pruned, dense, calib, device="cuda", **HEAL_KW)
    assert gpu.info["device"] == "cuda" and gpu.config.device == "cuda"
    assert _devices(gpu.model) == {"cpu"} and _devices(dense) == {"cpu"}  # moved back
    for a, b in zip(_trajectory(cpu), _trajectory(gpu)):
        assert abs(a - b) <= 1e-3 * abs(a), (_trajectory(cpu), _trajectory(gpu))
    sc, sg = _state(cpu.model), _state(gpu.model)
    assert max(_rel(sg[k], sc[k]) for k in sc) <= 1e-3
    # disk cache (host) + checkpoint (host copies) on CUDA: the same heal as on-the-fly targets
    cached = heal(pruned, dense, calib, device="cuda", target_cache=tmp_path / "t",
                  checkpoint_dir=tmp_path / "ck", **HEAL_KW)
    assert cached.info["targets"]["kind"] == "disk-cache"
    assert cached.info["final_loss"] == pytest.approx(gpu.info["final_loss"], rel=1e-5)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ck" / "checkpoint.safetensors"), framework="pt") as fh:
        assert fh.keys()  # written from host copies
    # resuming the finished checkpoint on the CPU is accepted (same settings and inputs)
    resumed = heal(pruned, dense, calib, device="cpu", target_cache=tmp_path / "t",
                   checkpoint_dir=tmp_path / "ck", **HEAL_KW)
    assert resumed.info["resumed_from_epoch"] == HEAL_KW["epochs"]


@needs_cuda
def test_cuda_derive_matches_the_cpu_derive():
    x, y = _derive_inputs()
    base = _tiny(5)
    cpu = derive(base, [0, 1, 2], x, y, flops=0.7, config=_derive_config("cpu"))
    gpu = derive(base, [0, 1, 2], x, y, flops=0.7, config=_derive_config("cuda"))
    assert gpu.record["device"] == "cuda" and _devices(gpu.model) == {"cpu"} and _devices(base) == {"cpu"}
    assert gpu.record["blocks"] == cpu.record["blocks"]
    sc, sg = _state(cpu.model), _state(gpu.model)
    assert sc.keys() == sg.keys()
    worst = max(_rel(sg[k], sc[k]) for k in sc)
    assert worst <= 1e-4, worst  # folded fc2 weights: statistics on CUDA, float64 re-fit on the CPU
    skp = derive(base, [0, 1, 2], x, y, flops=0.7, config=_derive_config("cuda", steps=4))  # SKP on CUDA
    assert skp.record["device"] == "cuda" and _devices(skp.model) == {"cpu"}


# ---- determinism on CUDA (issue 29, item 3) ---------------------------------------------------------------
def _global_settings() -> dict:
    """The process-wide settings heal's determinism contexts touch."""
    import os

    cuda = torch.backends.cuda
    return {"deterministic": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn.deterministic": torch.backends.cudnn.deterministic, "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "sdpa": (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()),
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def test_cuda_determinism_is_applied_inside_and_restored_after(monkeypatch):
    """On CUDA the heal runs with deterministic algorithms (errors, not warnings), cuDNN
    deterministic, the math SDPA backend only and a deterministic cuBLAS workspace; every setting is
    the caller's again afterwards, also after an exception. The flags can be set without a GPU."""
    from edgeprune.heal.determinism import CUBLAS_ENV, cuda_deterministic, seeded

    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    prev_alg, prev_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    prev_cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    try:  # a caller with non-default settings: warn-only determinism, cuDNN benchmark on
        torch.use_deterministic_algorithms(False, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
        before = _global_settings()
        with cuda_deterministic("cuda:0"):
            inside = _global_settings()
        assert inside == {"deterministic": True, "warn_only": False, "cudnn.deterministic": True,
                          "cudnn.benchmark": False, "sdpa": (False, False, True), "cublas": ":4096:8"}
        assert _global_settings() == before
        with pytest.raises(ZeroDivisionError), cuda_deterministic("cuda"):
            1 / 0
        assert _global_settings() == before
        with cuda_deterministic("cpu"):  # the CPU heal is untouched by the CUDA settings
            assert _global_settings() == before
        with seeded(0, "cpu"):  # the loop on every device: deterministic algorithms, no warn_only
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert _global_settings() == before
        monkeypatch.setenv(CUBLAS_ENV, ":16:8")  # the user's deterministic choice is kept
        with cuda_deterministic("cuda"):
            assert _global_settings()["cublas"] == ":16:8"
        assert _global_settings()["cublas"] == ":16:8"
        monkeypatch.setenv(CUBLAS_ENV, ":0:0")  # a non-deterministic one is refused before work
        with pytest.raises(UserError, match="CUBLAS_WORKSPACE_CONFIG=:0:0"), cuda_deterministic("cuda"):
            pytest.fail("entered")
    finally:
        torch.use_deterministic_algorithms(prev_alg, warn_only=prev_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev_cudnn


def test_heal_enters_the_cuda_determinism_on_cuda_only(tiny_heal, monkeypatch):
    """heal() wraps its work (dense targets and loop) in cuda_deterministic(device); on the CPU
    that is a no-op, so the CPU heal's arithmetic is unchanged."""
    import contextlib

    import edgeprune.heal.trainer as trainer

    dense, pruned, calib = tiny_heal
    seen = []

    @contextlib.contextmanager
    def spy(device):
        seen.append(str(device))
        yield

    monkeypatch.setattr(trainer, "cuda_deterministic", spy)
    heal(pruned, dense, calib[:8], device="cpu", epochs=1, batch_size=8, measure=False, keep_best=False)
    assert seen == ["cpu"]


@needs_cuda
def test_cuda_resume_is_bit_identical(tiny_heal, tmp_path):
    """Issue 29, item 3: on CUDA an interrupted heal resumed from its checkpoint equals the
    uninterrupted heal exactly, and two heals are identical (deterministic kernels)."""
    dense, pruned, calib = tiny_heal
    full = heal(pruned, dense, calib, device="cuda", **HEAL_KW)
    again = heal(pruned, dense, calib, device="cuda", **HEAL_KW)

    class _Stop(Exception):
        pass

    def stop(epoch, stats):
        raise _Stop

    with pytest.raises(_Stop):
        heal(pruned, dense, calib, device="cuda", checkpoint_dir=tmp_path / "ck", callback=stop, **HEAL_KW)
    resumed = heal(pruned, dense, calib, device="cuda", checkpoint_dir=tmp_path / "ck", **HEAL_KW)
    assert resumed.info["resumed_from_epoch"] == 1
    sf, sa, sr = _state(full.model), _state(again.model), _state(resumed.model)
    for k in sf:
        assert torch.equal(sf[k], sa[k]), k
        assert torch.equal(sf[k], sr[k]), k
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
