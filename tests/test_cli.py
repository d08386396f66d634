"""The CLI end to end on fmnist-vit, and one-line errors for bad input."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from edgeprune.cli.entry import main
from tests.conftest import needs_fmnist


def run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code, err, pattern):
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    assert pattern in lines[0], lines[0]


@needs_fmnist
def test_prune_info_eval_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err = run(["prune", "--calib-size", "64", "--eval-size", "300", "--quiet", "-o", str(out)], capsys)
    assert code == 0, err
    assert "dense" in stdout and "pruned" in stdout and "top-1" in stdout
    table = [ln for ln in stdout.splitlines() if ln.startswith("|")]  # a markdown table: every row as wide as its header
    assert len(table) == 4 and "agreement" in table[3], stdout
    assert {ln.count("|") for ln in table} == {table[0].count("|")}, stdout
    rec = json.loads((out / "run.json").read_text())
    assert rec["method"] == "corp" and rec["sparsity"] == {"mlp": 0.5, "attn": 0.5}
    assert rec["calibration"]["num_images"] == 64
    assert rec["base_model"]["name"] == "fmnist-vit"
    assert all(b["mlp_hidden"] == 256 and b["qk_dim"] == 32 for b in rec["blocks"])
    assert 0 <= rec["evaluation"]["pruned"]["top1"] <= 1
    code, stdout, _ = run(["info", str(out)], capsys)
    assert code == 0 and "| 0 | 2 | 64 | 32 | 64 | 256 |" in stdout
    code, stdout, _ = run(["eval", str(out), "--eval-size", "200", "--quiet"], capsys)
    assert code == 0 and "top-1" in stdout and "agreement" in stdout
    for cmd in ("eval", "info"):  # a run and a model at once: one-line error, not a silent choice
        code, _, err = run([cmd, str(out), "--model", "fmnist-vit"], capsys)
        assert_one_line_error(code, err, "either a run directory or --model")
    code, _, err = run(["eval", str(tmp_path / "missing")], capsys)
    assert_one_line_error(code, err, "run directory not found")


@needs_fmnist
@pytest.mark.parametrize("args,pattern", [
    (["--sparsity", "1.0"], "sparsity must be in [0, 1)"),
    (["--sparsity", "-0.2"], "sparsity must be in [0, 1)"),
    (["--sparsity", "0.9", "--round-to", "64"], "leaves no dims"),
    (["--calib-size", "0"], "calibration size must be >= 1"),
    (["--model", "resnet_nope"], "unknown model"),
    (["--round-to", "0"], "--round-to must be >= 1"),
])
def test_prune_bad_input(tmp_path, capsys, args, pattern):
    out = tmp_path / "run"
    code, _, err = run(["prune", "--quiet", "--calib-size", "8", "--no-eval", "-o", str(out), *args], capsys)
    assert_one_line_error(code, err, pattern)
    assert not out.exists()


@needs_fmnist
def test_prune_refuses_existing_output(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run(["prune", "--quiet", "-o", str(out)], capsys)
    assert_one_line_error(code, err, "already exists")
    assert (out / "keep.txt").read_text() == "mine"


def test_corrupt_calibration_data(tmp_path, capsys):
    bad = tmp_path / "fm"
    bad.mkdir()
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        with gzip.open(bad / f"{stem}.gz", "wb") as fh:
            fh.write(b"\x00\x00\x08\x03" + b"\x00\x00\x00\x05" * 3 + b"\x01\x02")  # truncated
    code, _, err = run(["prune", "--quiet", "--calib", str(bad), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "truncated")
    code, _, err = run(["prune", "--quiet", "--calib", str(tmp_path / "nothing"), "-o", str(tmp_path / "r2")], capsys)
    assert_one_line_error(code, err, "dataset-fashion-mnist")


def _image_folder(root, n=4, size=32):
    from PIL import Image

    (root / "cls").mkdir(parents=True)
    for i in range(n):
        Image.fromarray((torch.rand(size, size, 3) * 255).byte().numpy()).save(root / "cls" / f"{i}.png")
    return root


def test_checkpoint_that_does_not_fit(tmp_path, capsys):
    from safetensors.torch import save_file

    calib = _image_folder(tmp_path / "calib")
    ck = tmp_path / "wrong.safetensors"
    save_file({"head.weight": torch.zeros(3, 3)}, str(ck))
    code, _, err = run(["prune", "--quiet", "--no-eval", "--model", "deit_tiny_patch16_224", "--checkpoint", str(ck),
                        "--calib", str(calib), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "does not fit deit_tiny_patch16_224")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    code, _, err = run(["prune", "--quiet", "--no-eval", "--model", "deit_tiny_patch16_224", "--checkpoint",
                        str(corrupt), "--calib", str(calib), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "cannot read checkpoint")


def test_calibration_and_evaluation_must_be_disjoint(tmp_path, capsys):
    calib = _image_folder(tmp_path / "imgs")
    code, _, err = run(["prune", "--quiet", "--model", "deit_tiny_patch16_224", "--random-init",
                        "--calib", str(calib), "--eval-data", str(calib), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "overlap")


@needs_fmnist
def test_interrupted_prune_leaves_no_run_directory(tmp_path, capsys, monkeypatch):
    import edgeprune.pruning.stages

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(edgeprune.pruning.stages, "corp_prune", interrupted)  # the CORP stage's call
    out = tmp_path / "run"
    code, _, err = run(["prune", "--quiet", "--calib-size", "8", "-o", str(out)], capsys)
    assert code == 130 and "interrupted" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ---- one error handler: faults of the environment, checked before the work -------------------------
def _no_prune(monkeypatch):
    """Make any call of the pruning library fail the test: checks must come first."""
    import edgeprune.api

    def called(*a, **k):
        raise AssertionError("the pruning ran before the failing check")

    import edgeprune.pruning.stages

    monkeypatch.setattr(edgeprune.api, "prune", called)
    monkeypatch.setattr(edgeprune.pruning.stages, "corp_prune", called)


def _fast_prune(tmp_path, *extra):
    return ["prune", "--quiet", "--model", "fmnist-vit", "--random-init", "--calib-size", "8", "--no-eval",
            *extra]


def test_output_under_a_file_is_refused_before_pruning(tmp_path, capsys, monkeypatch):
    _no_prune(monkeypatch)
    (tmp_path / "afile").write_text("x")
    code, _, err = run(["prune", "--quiet", "-o", str(tmp_path / "afile" / "sub")], capsys)
    assert code == 2
    assert_one_line_error(code, err, "is a file, not a folder")


@pytest.mark.parametrize("errno_name,reason", [("EROFS", "Read-only file system"),
                                               ("EACCES", "Permission denied"),
                                               ("ENOSPC", "No space left on device")])
def test_unwritable_output_is_one_line_exit_1_before_pruning(tmp_path, capsys, monkeypatch, errno_name, reason):
    """A read-only / forbidden / full output location fails the probe write, before any work
    (simulated: the tests may run as root, for whom chmod 0o555 changes nothing)."""
    import errno
    import tempfile

    _no_prune(monkeypatch)
    code_ = getattr(errno, errno_name)

    def refuse(*a, dir=None, **k):
        raise OSError(code_, reason, str(dir))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    out = tmp_path / "runs" / "r"
    code, _, err = run(["prune", "--quiet", "-o", str(out)], capsys)
    assert code == 1
    assert_one_line_error(code, err, f"cannot write {out.parent}: {reason}")
    assert "choose a writable -o" in err
    assert not out.exists()


def test_read_only_folder_with_chmod(tmp_path, capsys, monkeypatch):
    import os

    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    _no_prune(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, _, err = run(["prune", "--quiet", "-o", str(ro / "run")], capsys)
    finally:
        ro.chmod(0o755)
    assert code == 1
    assert_one_line_error(code, err, "cannot write")


def test_disk_full_while_saving_leaves_nothing(tmp_path, capsys, monkeypatch):
    """ENOSPC in the middle of writing the weights: one line, exit 1, no run directory and no
    temporary directory left beside it."""
    import errno

    import edgeprune.atomic

    def full(path, tensors, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(edgeprune.atomic, "write_safetensors", full)
    out = tmp_path / "run"
    code, _, err = run(_fast_prune(tmp_path, "-o", str(out)), capsys)
    assert code == 1
    assert_one_line_error(code, err, f"cannot write {out}: No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_interrupt_while_saving_leaves_no_temporary_directory(tmp_path, capsys, monkeypatch):
    import edgeprune.atomic

    def interrupted(path, tensors, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(edgeprune.atomic, "write_safetensors", interrupted)
    code, out, err = run(_fast_prune(tmp_path, "-o", str(tmp_path / "run")), capsys)
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_missing_evaluation_data_is_refused_before_pruning(tmp_path, capsys, monkeypatch):
    _no_prune(monkeypatch)
    calib = _image_folder(tmp_path / "calib")
    code, _, err = run(["prune", "--quiet", "--model", "deit_tiny_patch16_224", "--random-init", "--calib",
                        str(calib), "--eval-data", str(tmp_path / "no_eval"), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "no_eval")
    assert not (tmp_path / "run").exists()


def test_oserror_of_a_command_is_one_line(tmp_path, capsys, monkeypatch):
    """Any write failure that reaches the handler: ``cannot write <path>: <reason>``, exit 1."""
    import errno

    import edgeprune.jobs.models

    def boom(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x")

    monkeypatch.setattr(edgeprune.jobs.models, "load_run_or_model", boom)
    code, _, err = run(["info", str(tmp_path)], capsys)
    assert code == 1
    assert_one_line_error(code, err, "cannot write /mnt/ro/x: Read-only file system (free space")


def test_a_bug_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    """An unexpected exception is a bug, not a user error: the handler does not hide it."""
    import edgeprune.jobs.models

    def bug(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(edgeprune.jobs.models, "load_run_or_model", bug)
    with pytest.raises(ZeroDivisionError):
        main(["info", str(tmp_path)])


@pytest.mark.parametrize("argv,pattern", [
    (["prune", "--no-such-option"], "No such option"),
    (["prune", "--target", "nope"], "Invalid value for '--target'"),
    (["prune", "--eval-size", "0"], "Invalid value for '--eval-size'"),
    (["nocommand"], "No such command"),
])
def test_usage_errors_are_one_line_exit_2(argv, pattern, capsys, monkeypatch):
    _no_prune(monkeypatch)
    code, _, err = run(argv, capsys)
    assert code == 2
    assert_one_line_error(code, err, pattern)


@pytest.mark.parametrize("cmd", ["prune", "eval", "heal", "derive"])
def test_cuda_without_cuda_is_refused_before_work(cmd, tmp_path, capsys, monkeypatch):
    _no_prune(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = {"prune": ["prune"], "eval": ["eval"], "heal": ["heal", str(tmp_path)],
            "derive": ["derive", "--classes", "0,1", "--flops", "0.5"]}[cmd]
    code, _, err = run([*args, "--torch-device", "cuda", "-o" if cmd != "eval" else "--quiet",
                        *([str(tmp_path / "o")] if cmd != "eval" else [])], capsys)
    assert code == 2
    assert_one_line_error(code, err, "CUDA is not available (use --torch-device cpu)")
    assert not (tmp_path / "o").exists()


def test_unknown_device_and_cpu_only_methods(tmp_path, capsys, monkeypatch):
    _no_prune(monkeypatch)
    code, _, err = run(["prune", "--device", "tpu", "-o", str(tmp_path / "o")], capsys)
    assert_one_line_error(code, err, "unknown device 'tpu'")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(["prune", "--torch-device", "cuda", "-o", str(tmp_path / "o")], capsys)
    assert_one_line_error(code, err, "CUDA is not available")  # refused before any work
    assert not (tmp_path / "o").exists()


def test_every_command_has_help_and_the_same_model_options(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for cmd in ("prune", "eval", "info", "heal", "derive", "export", "verify"):
        assert cmd in out
        code, text, err = run([cmd, "--help-all" if cmd in ("prune", "heal", "derive") else "--help"], capsys)
        assert code == 0, err
        if cmd != "heal":  # heal takes its model from the run record
            for opt in ("--model", "--checkpoint", "--random-init", "--num-classes", "--img-size", "--model-kwargs"):
                assert opt in text, (cmd, opt)
        if cmd in ("prune", "eval", "heal", "derive"):
            assert "--device" in text and "--quiet" in text


# ---- config objects and the run record ------------------------------------------------------------
def test_python_api_takes_a_corp_config_and_records_it():
    import dataclasses

    from edgeprune import CorpConfig, prune
    from edgeprune.errors import UserError
    from edgeprune.zoo.registry import get_model_spec

    spec = get_model_spec("fmnist-vit", random_init=True)
    torch.manual_seed(0)
    model = spec.create(pretrained=False)
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    cfg = CorpConfig.from_target("mlp", 0.5, ridge_alpha=1e-2)
    res = prune(model, x, cfg, spec=spec)
    rec = res.record
    assert rec["config"] == json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert rec["config"]["ridge_alpha"] == 1e-2 and rec["targets"] == "mlp"
    assert rec["sparsity"]["mlp"] == 0.5 and rec["sparsity"]["attn"] == 0.0
    assert rec["device"] == "cpu" and rec["edgeprune_version"] and rec["created"]
    assert all(b["mlp_hidden"] == 256 for b in rec["blocks"]) and all(b["qk_dim"] == 64 for b in rec["blocks"])
    # the keyword form builds the same config and the same model
    kw = prune(model, x, target="mlp", sparsity=0.5, ridge_alpha=1e-2, spec=spec)
    assert kw.record["config"] == rec["config"]
    for (k, a), (_, b) in zip(res.model.state_dict().items(), kw.model.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(UserError, match="not both"):
        prune(model, x, cfg, target="both")
    with pytest.raises(UserError, match="unknown CORP setting"):
        prune(model, x, target="both", sparsity=0.5, no_such_setting=1)


def _prune_record(tmp_path, capsys, *args) -> tuple[dict, str]:
    """Run a fast ``prune`` with ``args`` into tmp_path/run; (its run record, stdout)."""
    out = tmp_path / "run"
    code, stdout, err = run(_fast_prune(tmp_path, *args, "-o", str(out)), capsys)
    assert code == 0, err
    return json.loads((out / "run.json").read_text()), stdout


def test_cli_writes_the_config_into_the_record(tmp_path, capsys):
    # the device said (the default, auto, is cuda on a machine with a GPU)
    rec, stdout = _prune_record(tmp_path, capsys, "--target", "mlp", "--sparsity", "0.25", "--ridge-alpha", "0.01",
                                "--device", "cpu")
    cfg = rec["config"]
    assert cfg["mlp_sparsity"] == 0.25 and cfg["attn_sparsity"] == 0.0 and cfg["ridge_alpha"] == 0.01
    assert cfg["target"] == "mlp" and cfg["round_to"] == 8 and cfg["compensation"] is True
    assert rec["device"] == "cpu" and rec["calibration"]["seed"] == 0 and rec["calibration"]["batch_size"] == 32


# ---- progress display ------------------------------------------------------------------------------
def test_progress_is_plain_lines_off_a_terminal_and_silent_when_quiet(capsys):
    from edgeprune.progress import progress

    assert list(progress(range(8), "work", enabled=False)) == list(range(8))
    assert capsys.readouterr().err == ""
    assert list(progress(range(8), "work", unit="batch")) == list(range(8))  # stderr is captured: no tty
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "\r" not in err and 2 <= len(lines) <= 5, err
    assert lines[-1].startswith("work: 8/8 batch")
    bar = progress(None, "targets", total=4, unit="img")
    bar.update(4)
    bar.close()
    bar.close()
    assert capsys.readouterr().err.count("targets: 4/4 img") == 1


def test_eval_prints_progress_lines_unless_quiet(tmp_path, capsys):
    calib = _image_folder(tmp_path / "imgs", n=3)
    code, out, err = run(["eval", "--model", "deit_tiny_patch16_224", "--random-init", "--num-classes", "1",
                          "--eval-data", str(calib)], capsys)
    assert code == 0, err
    assert "eval: " in err and "\r" not in err
    code, out, err = run(["eval", "--model", "deit_tiny_patch16_224", "--random-init", "--num-classes", "1",
                          "--eval-data", str(calib), "--quiet"], capsys)
    assert code == 0 and err == ""


def test_random_init_run_is_evaluated_against_its_own_dense_model(tmp_path, capsys):
    """prune and eval rebuild the same seeded random-init dense model: a run pruned at sparsity 0
    agrees with it exactly (an unseeded rebuild would agree on ~1/10 of the images)."""
    calib = _image_folder(tmp_path / "calib", n=4)
    evald = _image_folder(tmp_path / "eval", n=4)
    out = tmp_path / "run"
    code, _, err = run(["prune", "--quiet", "--model", "deit_tiny_patch16_224", "--random-init", "--num-classes", "10",
                        "--sparsity", "0", "--calib", str(calib), "--calib-size", "4", "--no-eval", "-o", str(out)],
                       capsys)
    assert code == 0, err
    code, _, err = run(["eval", str(out), "--eval-data", str(evald), "--quiet", "--json", str(tmp_path / "m.json")],
                       capsys)
    assert code == 0, err
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["agreement"] == 1.0 and m["logit_mae"] < 1e-5


def test_v_and_head_options_reach_the_config(tmp_path, capsys):
    rec, _ = _prune_record(tmp_path, capsys, "--target", "mlp", "--sparsity", "0.25", "--head-sparsity", "0.5")
    assert rec["config"]["head_sparsity"] == 0.5 and rec["sparsity"] == {"mlp": 0.25, "attn": 0.0, "heads": 0.5}
    assert all(b["num_heads"] == 1 for b in rec["blocks"]) and rec["achieved_sparsity"]["heads"] == 0.5


def test_safetensors_io_error_is_one_line(tmp_path, capsys, monkeypatch):
    import safetensors

    import edgeprune.jobs.models

    def full(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(edgeprune.jobs.models, "load_run_or_model", full)
    code, _, err = run(["info", str(tmp_path)], capsys)
    assert code == 1
    assert_one_line_error(code, err, "safetensors file I/O failed: Error while serializing")


def test_api_without_spec_records_a_rebuildable_timm_model(tmp_path):
    """``edgeprune.prune(model, images)`` on a plain timm model (no spec=) still gives a run that
    ``load_run`` rebuilds; a model built with other kwargs is recorded by class name only."""
    from edgeprune import load_run, prune, save_run
    from edgeprune._compat import import_timm

    timm = import_timm()
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", num_classes=10).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    res = prune(model, x, target="mlp", sparsity=0.5)
    assert res.record["base_model"]["name"] == "deit_tiny_patch16_224"
    assert res.record["base_model"]["num_classes"] == 10
    save_run(tmp_path / "run", res.model, res.record)
    back, _ = load_run(tmp_path / "run")
    with torch.no_grad():
        torch.testing.assert_close(back(x), res.model(x))
    shallow = timm.create_model("deit_tiny_patch16_224", depth=1, num_classes=10).eval()
    from edgeprune.api import base_model_record

    assert base_model_record(shallow) == {"name": "VisionTransformer"}


def test_img_size_reaches_the_model(capsys):
    code, out, err = run(["info", "--model", "deit_tiny_patch16_224", "--random-init", "--img-size", "112"], capsys)
    assert code == 0, err
    assert "50 tokens" in out and "input (3, 112, 112)" in out  # (112 / 16)^2 patches + cls
    code, out, err = run(["info", "--model", "deit_tiny_patch16_224", "--random-init", "--img-size", "64",
                          "--model-kwargs", "depth=2,qkv_bias=true"], capsys)
    assert code == 0, err
    assert out.startswith("deit_tiny_patch16_224: 2 blocks") and "17 tokens" in out
    code, _, err = run(["info", "--model", "deit_tiny_patch16_224", "--model-kwargs", "depth"], capsys)
    assert_one_line_error(code, err, "--model-kwargs wants key=value pairs")


def test_unreadable_calibration_data_is_refused_before_pruning(tmp_path, capsys, monkeypatch):
    """A calibration folder that cannot be listed (simulated EACCES: root ignores chmod)."""
    import os

    _no_prune(monkeypatch)
    calib = _image_folder(tmp_path / "calib")
    real = os.listdir

    def forbidden(path="."):
        if str(path) == str(calib):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", forbidden)
    code, _, err = run(["prune", "--quiet", "--model", "deit_tiny_patch16_224", "--random-init", "--calib", str(calib),
                        "-o", str(tmp_path / "run")], capsys)
    assert code == 2
    assert_one_line_error(code, err, f"cannot read calibration data {calib}: Permission denied")
    assert not (tmp_path / "run").exists()
