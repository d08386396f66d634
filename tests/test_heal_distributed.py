"""Data-parallel healing under torchrun (two gloo processes): the heal equals the one-process heal.

:mod:`edgeprune.heal.data_parallel`. One torchrun launch runs a worker that heals one small pruned
fmnist-vit run three ways: through the command line (``edgeprune heal``, batches of 6), through
the API with a disk target cache, a held-out fraction and 13 images in batches of 4 (the last
batch has one image, so rank 0's slice of it is empty), and through the API again with a
checkpoint directory where the first call stops after epoch 1 (callback) and the second resumes.
The same heals run single-process in the test process, one thread as under torchrun.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import HAS_FMNIST, assert_one_line_error, needs_fmnist, run_cli, torchrun_beside

HEAL_ARGS = ["--calib-size", "12", "--batch-size", "6", "--epochs", "2", "--lr", "3e-4", "--keep-last", "--no-eval",
             "--quiet"]
API_KW = dict(epochs=2, batch_size=4, lr=3e-4, holdout=0.25, keep_best=True)

WORKER = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors.torch import save_file
    import edgeprune
    from edgeprune.artifact import load_run
    from edgeprune.cli.main import main
    from edgeprune.distributed import process_group, rank
    from edgeprune.heal import heal
    from edgeprune.loading import load_base_model

    run, out, cli_args, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    spec = edgeprune.get_model_spec("fmnist-vit")
    calib = spec.calibration_source(13, seed=1)

    class Stop(Exception):
        pass

    def stop_after_one(epoch, stats):
        if epoch == 1:
            raise Stop

    with process_group("cpu"):
        main(["heal", run, *cli_args, "-o", out + "/cli"])
        pruned, rec = load_run(run)
        dense = load_base_model(rec)
        res = heal(pruned, dense, calib, target_cache=out + "/cache", **kw)
        save_file({k: v.contiguous() for k, v in res.model.state_dict().items()}, f"{out}/api-rank{rank()}.safetensors")
        try:
            heal(pruned, dense, calib, checkpoint_dir=out + "/ckpt", callback=stop_after_one, **kw)
        except Stop:
            pass
        res2 = heal(pruned, dense, calib, checkpoint_dir=out + "/ckpt", **kw)
        if rank() == 0:
            save_file({k: v.contiguous() for k, v in res2.model.state_dict().items()}, out + "/resumed.safetensors")
            json.dump({"api": res.info, "api_history": res.history, "resumed_history": res2.history},
                      open(out + "/info.json", "w"), default=str)
""")


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _close(a: float, b: float) -> bool:
    """Losses agree to float32 summation order: 1e-4 relative (the cosine loss 1 - cos is formed
    in float32, so near 0 it carries ~1e-7 absolute rounding per image)."""
    return abs(a - b) <= 1e-4 * abs(b) + 1e-7


def _compare(dist: dict, single: dict, start: dict) -> tuple[float, float]:
    """(worst |dist - single| / |single - start| over the trained tensors, smallest relative
    healing step |single - start| / |start|): the two heals differ by much less than what healing
    changed."""
    worst, step, changed = 0.0, float("inf"), 0
    for k, v in single.items():
        if torch.equal(v, start[k]):
            assert torch.equal(dist[k], v), k  # frozen: bit-identical
            continue
        change = (v.double() - start[k].double()).norm()
        worst = max(worst, float((dist[k].double() - v.double()).norm() / change))
        step = min(step, float(change / start[k].double().norm()))
        changed += 1
    assert changed > 0, "healing changed nothing: the comparison would be empty"
    return worst, step


@pytest.fixture(scope="module")
def heals(tmp_path_factory):
    """(pruned run, torchrun out dir, its stdout, single-process results)."""
    if not HAS_FMNIST:
        pytest.skip("Fashion-MNIST not installed")
    import edgeprune
    from edgeprune.artifact import load_run
    from edgeprune.heal import heal
    from edgeprune.loading import load_base_model

    base = tmp_path_factory.mktemp("hd")
    run = base / "run"
    result = run_cli(["prune", "--model", "fmnist-vit", "--sparsity", "0.5", "--no-compensation", "--calib-size", "16",
                      "--no-eval", "--quiet", "-o", run])  # uncompensated: healing has much to do
    assert result.exit_code == 0, result.output
    out = base / "dist"
    out.mkdir()
    script = base / "worker.py"
    script.write_text(WORKER)
    single: dict = {}

    def one_process() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            r = run_cli(["heal", run, *HEAL_ARGS, "-o", base / "single-cli"])
            assert r.exit_code == 0, r.output
            pruned, rec = load_run(run)
            dense = load_base_model(rec)
            spec = edgeprune.get_model_spec("fmnist-vit")
            res = heal(pruned, dense, spec.calibration_source(13, seed=1), **API_KW)
            single.update(api=res, start=dict(pruned.state_dict()))
        finally:
            torch.set_num_threads(threads)

    _, stdout = torchrun_beside([script, run, out, json.dumps(HEAL_ARGS), json.dumps(API_KW)], one_process)
    return base, out, stdout, single


@needs_fmnist
def test_two_process_heal_equals_one_process_api(heals):
    """API heal with a target cache, holdout and an empty slice: loss history within 1e-5
    relative, trained weights differ by < 1% of the healing step (float32 summation order only),
    frozen weights bit-identical, and the two ranks hold bit-identical models."""
    base, out, _, single = heals
    info = json.loads((out / "info.json").read_text())
    assert info["api"]["world_size"] == 2 and info["api"]["backend"] == "gloo"
    ref = single["api"]
    assert info["api"]["targets"] is not None and "cache" in json.dumps(info["api"]["targets"]).lower()
    for a, b in zip(info["api_history"], ref.history):
        assert _close(a["loss"], b["loss"]) and _close(a["eval_loss"], b["eval_loss"]), (a, b)
    assert info["api"]["best_epoch"] == ref.info["best_epoch"]
    r0, r1 = _load(out / "api-rank0.safetensors"), _load(out / "api-rank1.safetensors")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    worst, step = _compare(r0, {k: v.detach() for k, v in ref.model.state_dict().items()}, single["start"])
    print(f"two processes vs one: worst difference {worst:.2e} of the healing step (step >= {step:.2e} relative)")
    assert step > 1e-4  # healing really moved the weights
    assert worst < 1e-2


@needs_fmnist
def test_two_process_heal_resumes_from_rank0_checkpoint(heals):
    """A two-process heal stopped after epoch 1 resumes from rank 0's checkpoint: the same epochs
    and the same weights as the uninterrupted two-process heal."""
    _, out, _, _ = heals
    info = json.loads((out / "info.json").read_text())
    assert [h["epoch"] for h in info["resumed_history"]] == [1, 2]
    for a, b in zip(info["resumed_history"], info["api_history"]):
        assert a["loss"] == b["loss"]
    resumed, whole = _load(out / "resumed.safetensors"), _load(out / "api-rank0.safetensors")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


@needs_fmnist
def test_two_process_heal_command_line(heals):
    """``edgeprune heal`` under torchrun: one report, the record says world_size and backend, and
    the healed weights match the one-process command within 1% of the healing step."""
    from safetensors.torch import load_file

    base, out, stdout, _ = heals
    assert stdout.count("saved ") == 1
    rec = json.loads((out / "cli" / "run.json").read_text())
    ref = json.loads((base / "single-cli" / "run.json").read_text())
    assert rec["healing"]["world_size"] == 2 and rec["healing"]["backend"] == "gloo"
    assert "world_size" not in ref["healing"]
    assert rec["healing"]["calibration"]["num_images"] == 12
    for a, b in zip(rec["healing"]["history"], ref["healing"]["history"]):
        assert _close(a["loss"], b["loss"]), (a, b)
    start = load_file(str(base / "run" / "model.safetensors"))
    worst, step = _compare(load_file(str(out / "cli" / "model.safetensors")),
                           load_file(str(base / "single-cli" / "model.safetensors")), start)
    print(f"command line, two processes vs one: worst difference {worst:.2e} of the healing step")
    assert worst < 1e-2


@needs_fmnist
def test_heal_with_world_size_but_no_torchrun_env(heals, monkeypatch, tmp_path):
    """WORLD_SIZE > 1 without torchrun's other variables: one line naming the launcher, before
    any work, and no output directory."""
    base = heals[0]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    result = run_cli(["heal", base / "run", "-o", tmp_path / "healed"])
    assert_one_line_error(result, "torchrun --nproc-per-node 2")
    assert not (tmp_path / "healed").exists()
