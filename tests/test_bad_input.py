"""Bad input on the newer options and damaged run directories (issue 32): one line, exit 2, before
the work; no setting silently ignored; nothing half-written.

Each test names the case of the issue it covers. The small runs are random-init ``deit_tiny`` with
one block at 32 pixels (a few seconds each).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_one_line_error, run_cli

TINY = "deit_tiny_patch16_224"
ROOT = Path(__file__).resolve().parents[1]


def _image_folder(root: Path, n: int = 4, size: int = 32) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(n)
    (root / "cls").mkdir(parents=True)
    for i in range(n):
        Image.fromarray((torch.rand(size, size, 3, generator=g) * 255).byte().numpy()).save(root / "cls" / f"{i}.png")
    return root


def _checkpoint(folder: Path) -> Path:
    """A ViT-tiny (one block, 32 pixels) checkpoint of seeded random weights, as a user's file."""
    from edgeprune.atomic import atomic_save_safetensors
    from edgeprune.zoo.registry import get_model_spec

    ck = folder / "tiny.safetensors"
    if not ck.exists():
        m = get_model_spec(TINY, random_init=True, img_size=32, model_kwargs={"depth": 1}).create()
        atomic_save_safetensors(ck, {k: v.contiguous() for k, v in m.state_dict().items()})
    return ck


def _prune(tmp_path: Path, *extra, n: int = 4, out: str = "run"):
    calib = tmp_path / f"calib{n}"
    if not calib.exists():
        _image_folder(calib, n=n)
    return run_cli(["prune", "--quiet", "--no-eval", "--model", TINY, "--checkpoint", _checkpoint(tmp_path),
                    "--img-size", "32", "--model-kwargs", "depth=1", "--calib", calib, "--calib-size", str(n),
                    "-o", tmp_path / out, *extra])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A small saved run (mlp 0.5), copied by the tests that damage it."""
    tmp = tmp_path_factory.mktemp("tinyrun")
    r = _prune(tmp, "--target", "mlp", "--sparsity", "0.5")
    assert r.exit_code == 0, r.output
    return tmp / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def _edit_record(run: Path, **changes) -> None:
    rec = json.loads((run / "run.json").read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".", 1)
            rec[outer][inner] = value
        else:
            rec[key] = value
    (run / "run.json").write_text(json.dumps(rec))


# ---- run.json is user input -------------------------------------------------------------------


@pytest.mark.parametrize("changes, field", [
    ({"base_model": {}}, "base_model.name"),
    ({"base_model": []}, "base_model"),
    ({"base_model.name": 3}, "base_model.name"),
    ({"base_model.seed": "x"}, "base_model.seed"),
    ({"base_model.img_size": -3}, "base_model.img_size"),
    ({"base_model.model_kwargs": "depth=1"}, "base_model.model_kwargs"),
    ({"base_model.checkpoint_sha256": "nothex"}, "base_model.checkpoint_sha256"),
    ({"blocks": {}}, "blocks"),
    ({"blocks": [{"num_heads": 3}]}, "blocks[0].qk_dim"),
    ({"blocks": [{"num_heads": "3", "qk_dim": 64, "v_dim": 64, "mlp_hidden": 8}]}, "blocks[0].num_heads"),
    ({"head": [1, 2]}, "head"),
    ({"calibration": "x"}, "calibration"),
    ({"weights_sha256": 5}, "weights_sha256"),
])
def test_every_record_field_is_validated_with_one_line(tiny_run, tmp_path, changes, field):
    """issue 32: ``info`` on ``"base_model": {}`` raised KeyError 'name' (zoo/registry.py:309)."""
    run = _copy(tiny_run, tmp_path)
    _edit_record(run, **changes)
    for argv in (["info", run], ["eval", run, "--eval-data", tmp_path], ["export", run, "-o", tmp_path / "m.onnx"]):
        r = run_cli(argv)
        assert_one_line_error(r, repr(field))
        assert str(run / "run.json") in r.stderr


def test_a_record_that_is_not_an_object_is_one_line(tiny_run, tmp_path):
    run = _copy(tiny_run, tmp_path)
    (run / "run.json").write_text("[1, 2]")
    assert_one_line_error(run_cli(["info", run]), "not a run record")


# ---- damaged or altered weights ---------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "empty"])
def test_damaged_weights_name_the_file_exit_2(tiny_run, tmp_path, damage):
    """issue 32: a truncated / empty model.safetensors read like a full disk (exit 1, no file name).
    Both with the recorded weights hash and without it (a run of an older edgeprune)."""
    for old in (False, True):
        run = _copy(tiny_run, tmp_path / str(old))
        if old:
            rec = json.loads((run / "run.json").read_text())
            del rec["weights_sha256"]
            (run / "run.json").write_text(json.dumps(rec))
        w = run / "model.safetensors"
        data = w.read_bytes()
        w.write_bytes(data[: len(data) // 3] if damage == "truncate" else b"")
        for argv in (["info", run], ["eval", run, "--eval-data", tmp_path],
                     ["export", run, "-o", tmp_path / "m.onnx"]):
            r = run_cli(argv)
            assert_one_line_error(r, str(w))
            assert ("damaged" in r.stderr) and "free space" not in r.stderr


def test_run_records_its_weights_sha256_and_refuses_altered_weights(tiny_run, tmp_path):
    """issue 32: flipped bits in a run's model.safetensors gave eval rc 0 with 0% agreement."""
    import hashlib

    rec = json.loads((tiny_run / "run.json").read_text())
    assert rec["weights_sha256"] == hashlib.sha256((tiny_run / "model.safetensors").read_bytes()).hexdigest()
    run = _copy(tiny_run, tmp_path)
    w = run / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-100] ^= 0xFF  # a weight, not the header: the file still parses
    w.write_bytes(bytes(data))
    evald = _image_folder(tmp_path / "eval")
    for argv in (["info", run], ["eval", run, "--eval-data", evald], ["export", run, "-o", tmp_path / "m.onnx"],
                 ["heal", run, "--epochs", "1", "--calib", _image_folder(tmp_path / "hc", n=5),
                  "--eval-data", evald, "-o", tmp_path / "healed"]):
        r = run_cli(argv)
        assert_one_line_error(r, "changed since the run was saved")
    # a run of an older edgeprune (no weights_sha256) still loads
    del rec["weights_sha256"]
    (run / "run.json").write_text(json.dumps(rec))
    r = run_cli(["info", run])
    assert r.exit_code == 0, r.output


# ---- hints name something the command accepts -------------------------------------------------


def test_eval_of_a_run_without_a_checkpoint_hints_an_eval_option(tmp_path):
    """issue 32: eval of a run with "checkpoint": null said 'pass --checkpoint PATH', which
    ``eval RUN_DIR`` refuses."""
    r = _prune(tmp_path, "--target", "mlp", "--sparsity", "0.5")
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    _edit_record(run, **{"base_model.checkpoint": None})
    r = run_cli(["eval", run, "--eval-data", tmp_path / "calib4"])
    assert_one_line_error(r, "no checkpoint")
    assert "--model" in r.stderr  # the hint is a dense eval: eval --model NAME --checkpoint PATH
    # the hint itself is accepted by eval
    hinted = run_cli(["eval", "--model", TINY, "--checkpoint", tmp_path / "none.safetensors",
                      "--eval-data", tmp_path / "calib4"])
    assert "no such option" not in hinted.stderr and "not both" not in hinted.stderr


def test_bench_of_a_model_name_without_weights_hints_random_init(tmp_path):
    """issue 32: ``bench vit_tiny_patch16_224`` said 'pass --checkpoint PATH' (bench has none)."""
    r = run_cli(["bench", TINY, "--device", "cpu", "--iterations", "1", "--warmup", "0", "--batch-sizes", "1"])
    assert r.exit_code == 2, r.output
    assert "--checkpoint" not in r.stderr and "--random-init" in r.stderr, r.stderr
    assert "Traceback" not in r.output


# ---- --model-kwargs ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ['depth={"a":', "depth=[1,2", 'depth="abc', "depth={1}"])
def test_malformed_json_in_model_kwargs_is_named(text):
    """issue 32: ``--model-kwargs 'depth={"a":'`` was taken as a string (a TypeError text)."""
    r = run_cli(["info", "--model", TINY, "--model-kwargs", text])
    assert_one_line_error(r, "invalid JSON for depth")


def test_model_kwargs_with_json_values_that_hold_commas():
    from edgeprune.cli.options import parse_model_kwargs

    assert parse_model_kwargs('depth=2,global_pool=token,x={"a":1,"b":[1,2]},y=[3,4]') == {
        "depth": 2, "global_pool": "token", "x": {"a": 1, "b": [1, 2]}, "y": [3, 4]}
    assert parse_model_kwargs("global_pool=avg") == {"global_pool": "avg"}


# ---- --img-size vs the patch ------------------------------------------------------------------


@pytest.mark.parametrize("size, pattern", [("8", "smaller than the patch size 16"),
                                           ("40", "not a multiple of the patch size 16")])
def test_img_size_is_checked_against_the_patch_before_work(tmp_path, monkeypatch, size, pattern):
    """issue 32: ``prune --random-init --img-size 8`` failed in the patch-embedding convolution."""
    import edgeprune.api

    monkeypatch.setattr(edgeprune.api, "prune", lambda *a, **k: pytest.fail("pruned before the check"))
    r = run_cli(["prune", "--quiet", "--model", TINY, "--random-init", "--img-size", size,
                 "--calib", _image_folder(tmp_path / "c"), "-o", tmp_path / "run"])
    assert_one_line_error(r, pattern)
    for cmd in (["info"], ["export", "-o", tmp_path / "m.onnx"]):
        assert_one_line_error(run_cli([*cmd, "--model", TINY, "--random-init", "--img-size", size]), pattern)
    assert_one_line_error(run_cli(["info", "--model", TINY, "--random-init", "--img-size", "16",
                                   "--model-kwargs", "patch_size=32"]), "smaller than the patch size 32")
    assert run_cli(["info", "--model", TINY, "--random-init", "--img-size", "48"]).exit_code == 0


# ---- budgets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [["--sparsity", "0.2"], ["--mlp-sparsity", "0.1"], ["--attn-sparsity", "0.1"],
                                   ["--v-sparsity", "0.1"], ["--head-sparsity", "0.5"],
                                   ["--sparsity", "0.2", "--mlp-sparsity", "0.1"]])
@pytest.mark.parametrize("budget", [["--flops", "0.5"], ["--params", "0.5"]])
def test_budget_with_a_sparsity_is_refused(tmp_path, monkeypatch, budget, extra):
    """issue 32: ``--flops 0.5 --sparsity 0.2 --mlp-sparsity 0.1`` ran and ignored both."""
    import edgeprune.api

    monkeypatch.setattr(edgeprune.api, "prune", lambda *a, **k: pytest.fail("pruned before the check"))
    r = _prune(tmp_path, *budget, *extra)
    assert_one_line_error(r, "replaces")
    assert budget[0] in r.stderr and extra[0] in r.stderr


def test_check_images_without_a_budget_is_refused(tmp_path, monkeypatch):
    """Same kind as the issue's case: an option that only a budget reads, given without one."""
    import edgeprune.api

    monkeypatch.setattr(edgeprune.api, "prune", lambda *a, **k: pytest.fail("pruned before the check"))
    assert_one_line_error(_prune(tmp_path, "--check-images", "4"), "--check-images goes with --flops/--params")


@pytest.mark.parametrize("budget", [["--flops", "100G"], ["--params", "20M"]])
def test_budget_above_the_dense_model_says_so(tmp_path, budget):
    """issue 32: nothing pruned, rc 0, and the note blamed --round-to."""
    r = _prune(tmp_path, *budget)
    assert_one_line_error(r, "above the dense model")
    assert "round-to" not in r.stderr and not (tmp_path / "run").exists()


# ---- output correction: bias correction and head refit ------------------------------------------


@pytest.mark.parametrize("extra", [["--head-refit"], ["--head-refit", "--bias-correction", "0"],
                                   ["--bias-correction", "1", "--head-refit"],
                                   ["--bias-correction", "2", "--head-refit"]])
def test_head_refit_without_enough_correction_images_is_refused(tmp_path, monkeypatch, extra):
    """issue 32: ``--head-refit`` without ``--bias-correction`` / with 1 image: rc 0, no refit, no word."""
    import edgeprune.api

    monkeypatch.setattr(edgeprune.api, "prune", lambda *a, **k: pytest.fail("pruned before the check"))
    r = _prune(tmp_path, "--target", "mlp", *extra)
    assert_one_line_error(r, "--head-refit")
    assert "--bias-correction" in r.stderr


@pytest.mark.parametrize("extra", [["--bias-correction", "2"], ["--flops", "0.5"]])
def test_two_calibration_images_degrade_to_the_bias_correction_with_a_note(tmp_path, extra):
    """issue 32: a singular matrix in solve/head_refit.py after the whole prune with 2 images.
    The refit needs 3 images: with 2 the bias correction alone is folded, and the record and the
    report say why."""
    r = _prune(tmp_path, *extra, n=2)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    bc = json.loads((tmp_path / "run" / "run.json").read_text())["bias_correction"]
    assert bc["kind"] == "bias" and bc["images"] == 2
    assert "3" in bc["note"] and "refit" in bc["note"]
    assert bc["note"] in r.stdout


def test_head_refit_still_runs_with_enough_images(tmp_path):
    """The refit still happens where it did: 8 images, the cross-validation sees every alpha."""
    r = _prune(tmp_path, "--target", "mlp", "--sparsity", "0.5", "--bias-correction", "8", n=8)
    assert r.exit_code == 0, r.output
    bc = json.loads((tmp_path / "run" / "run.json").read_text())["bias_correction"]
    assert bc["images"] == 8 and "note" not in bc and "cv_error" in bc and len(bc["cv_error"]) == 10


def test_fit_head_with_one_image_per_training_split_is_the_bias_correction():
    """Library level: fit_head on 2 images (each fold trains on one image, whose centred features
    are zero) gives the bias correction instead of a singular solve."""
    from edgeprune.solve.head_refit import fit_head, refit_statistics

    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(5, 7, generator=g)
    f, y = torch.randn(2, 7, generator=g), torch.randn(2, 5, generator=g)
    fit = fit_head(refit_statistics(f, y), w0)
    assert fit["alpha"] == float("inf") and torch.equal(fit["weight"], w0.double())
    assert torch.allclose(fit["bias"], (y.double() - f.double() @ w0.double().T).mean(0))
    # with 3 images the refit is one of the candidates again (finite errors for every alpha)
    f3, y3 = torch.randn(3, 7, generator=g), torch.randn(3, 5, generator=g)
    fit3 = fit_head(refit_statistics(f3, y3), w0)
    assert all(torch.isfinite(torch.tensor(e)) for e in fit3["cv_error"].values())


# ---- SIGTERM while saving; stale temporaries ------------------------------------------------------

_BLOCKED_SAVE = textwrap.dedent('''
    import os, sys, time
    import edgeprune.atomic as atomic

    def blocked(path, tensors, metadata=None):  # a save that is half done and then hangs
        with open(path, "wb") as fh:
            fh.write(b"partial weights")
        open(os.environ["EDGEPRUNE_TEST_READY"], "w").write("saving")
        while True:
            time.sleep(0.05)

    atomic.write_safetensors = blocked
    from edgeprune.cli.main import main
    main(sys.argv[1:])
''')


def test_sigterm_while_saving_cleans_up_says_one_line_and_exits_143(tmp_path):
    """issue 32: SIGTERM during the save left a hidden temporary folder with partial weights, rc
    143 without a word. The child blocks inside the save (deterministically, no timing luck)."""
    import time

    calib = _image_folder(tmp_path / "calib")
    outs = tmp_path / "outs"
    outs.mkdir()
    ready = tmp_path / "ready"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EDGEPRUNE_TEST_READY": str(ready),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_SAVE, "prune", "--quiet", "--no-eval", "--model", TINY,
                             "--checkpoint", _checkpoint(tmp_path), "--img-size", "32", "--model-kwargs", "depth=1",
                             "--target", "mlp", "--calib", calib, "-o", outs / "run"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the child never reached the save"
            time.sleep(0.1)
        assert any(outs.iterdir())  # the temporary folder is there, half written
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["terminated"], err
    assert list(outs.iterdir()) == []


def test_stale_temporaries_of_killed_runs_are_removed_on_the_next_write(tmp_path):
    """issue 32: a killed save's temporary stays; the next write in the same folder removes those
    of dead processes of this host -- not a live process's, another host's, or a foreign file."""
    from edgeprune.atomic import _host_tag, atomic_write_text, temp_prefix

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        host = _host_tag()
        stale_dir = tmp_path / f".run.ep{host}-{dead}.abcd_123.tmp"
        stale_dir.mkdir()
        (stale_dir / "model.safetensors").write_bytes(b"partial")
        stale_file = tmp_path / f".m.onnx.ep{host}-{dead}.zyxw9876.tmp"
        stale_file.write_bytes(b"partial")
        keep = [tmp_path / f".run2.ep{host}-{live.pid}.abcd_123.tmp", tmp_path / f".run3.epdeadbeef-{dead}.abcd_123.tmp",
                tmp_path / ".term.x8f2k1ab.tmp", tmp_path / "notes.txt"]
        for k in keep:
            k.mkdir() if k.suffix == ".tmp" else k.write_text("mine")
        if host == "deadbeef":
            keep.remove(keep[1])
        atomic_write_text(tmp_path / "report.md", "x")
        assert not stale_dir.exists() and not stale_file.exists()
        assert all(k.exists() for k in keep)
        assert temp_prefix(tmp_path / "a").startswith(f".a.ep{host}-{os.getpid()}.")
    finally:
        live.kill()
        live.wait()


# ---- torchrun: one message, checked before the rendezvous ---------------------------------------


def test_bad_input_under_torchrun_env_is_checked_before_the_process_group(tmp_path, monkeypatch):
    """A missing calibration folder fails before ``init_process_group`` (a patched process group
    would fail the test), and only rank 0 prints it; every rank exits 2."""
    import contextlib
    import importlib

    import edgeprune.distributed

    @contextlib.contextmanager
    def no_group(*a, **k):
        pytest.fail("the process group was started before the input was checked")
        yield

    monkeypatch.setattr(edgeprune.distributed, "process_group", no_group)
    cli_main = importlib.import_module("edgeprune.cli.main")  # the module (edgeprune.cli.main is also a function)
    monkeypatch.setattr(cli_main, "QUIET_RANK_GRACE_S", 0.0)  # rank 1's wait for rank 0's message: its own test below
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    argv = ["prune", "--quiet", "--no-eval", "--model", TINY, "--random-init", "--calib", tmp_path / "missing",
            "-o", tmp_path / "run"]
    monkeypatch.setenv("RANK", "1")
    r = run_cli(argv)
    assert r.exit_code == 2 and r.stderr == "", r.output
    monkeypatch.setenv("RANK", "0")
    assert_one_line_error(run_cli(argv), "missing")


def test_torchrun_with_a_bad_argument_prints_the_error_once(tmp_path):
    """issue 32: each rank printed the error. Now rank 0 alone does; torchrun then prints its own
    ChildFailedError report (its traceback and exit status 1 are torchrun's, docs/distributed.md),
    whose root cause carries edgeprune's exit status 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           sys.executable, "-m", "edgeprune.cli", "prune", "--quiet", "--no-eval", "--sparsity", "2",
           "-o", str(tmp_path / "run")]
    p = subprocess.run([*cmd[:6], "--no-python", *cmd[6:]], env=env, capture_output=True, text=True, timeout=240,
                       cwd=ROOT)
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "sparsity must be" in errors[0], p.stdout + p.stderr
    assert "exitcode  : 2" in p.stderr
    assert not (tmp_path / "run").exists()


def test_a_quiet_rank_waits_for_rank_0_to_say_the_error(monkeypatch, capsys):
    """Under load, rank 1 exited on the bad argument before rank 0 printed it, and torchrun killed rank 0: the job
    failed with no ``error:`` line (a second CPU-bound process running). A rank other than 0 now waits
    (``QUIET_RANK_GRACE_S``, ended by torchrun's SIGTERM) before it exits, silently; rank 0 does not wait."""
    import importlib

    cli_main = importlib.import_module("edgeprune.cli.main")  # the module (edgeprune.cli.main is also a function)
    slept = []
    monkeypatch.setattr(cli_main.time, "sleep", lambda s: slept.append(s))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, waits in (("1", True), ("0", False)):
        monkeypatch.setenv("RANK", rank)
        slept.clear()
        with pytest.raises(SystemExit) as ex:
            cli_main.main(["prune", "--quiet", "--no-eval", "--sparsity", "2", "-o", "never"])
        err = capsys.readouterr().err
        assert ex.value.code == 2
        assert slept == ([cli_main.QUIET_RANK_GRACE_S] if waits else [])
        assert ("error: " in err) == (not waits)
