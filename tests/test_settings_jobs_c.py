"""Issue 53 for ``edgeprune deploy`` (and ``eval``, ``export``, ``verify``): every option of deploy is one of its
declared settings (``edgeprune.deploy.settings``), one of the prune's declared settings it hands on
(``edgeprune.pruning.settings``) or one of the job's inputs, each parameter named as its field; the command modules
write no option by hand; a bad value is still one line, exit 2; the command and ``edgeprune.deploy(...)`` plan the
same stages. Deploy folders and recipes of the code before (``tests/fixtures/deploy_53``, its README says how they
were made) resume and load.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

import devices
import edgeprune
from edgeprune.cli.deploy_cmd import deploy_cmd
from edgeprune.cli.heal import heal_cmd
from edgeprune.cli.prune import prune_cmd
from edgeprune.cli.quantize import quantize_cmd
from edgeprune.cli.recipe import LEGACY_SECTIONS, section_of
from edgeprune.deploy import pipeline
from edgeprune.deploy.plan import plan
from edgeprune.deploy.settings import PRUNE_SETTINGS, deploy_declared
from edgeprune.deploy.state import hash_settings, setting_values
from edgeprune.pruning.settings import prune_declared
from edgeprune.settings import SettingError
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli
from tests.test_deploy import CPU_INT8, FAST
from tests.test_settings import _assert_each_setting_is_its_option

ROOT = Path(__file__).parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "deploy_53"
#: the deploys that made the fixtures' stages.json / stages-heal.json
HEALED = FAST + ["--sparsity", "0.5", "--precision", "fp32", "--device", "cpu", "--heal", "--heal-epochs", "1",
                 "--no-bench"]
PY_SETTINGS = {"model_name": "fmnist-vit", "calib_size": 32, "eval_size": 64, "bench_iterations": 2, "quiet": True,
               "sparsity": 0.5, "precision": "int8", "device": "cpu"}
#: deploy's job inputs: model, data, profile, torch device, folder, quiet (``edgeprune.cli.options``)
JOB = {"model_name", "model_file", "backbone", "checkpoint", "random_init", "num_classes", "img_size", "model_kwargs",
       "calib_dir", "calib_size", "seed", "batch_size", "eval_data", "eval_size", "device", "torch_device", "out",
       "quiet", "config", "help_all", "help"}


def test_every_deploy_option_is_a_declared_setting_a_prune_setting_or_a_job_option():
    own, handed = deploy_declared(), {n: prune_declared()[n] for n in PRUNE_SETTINGS}
    _assert_each_setting_is_its_option(deploy_cmd, own)
    _assert_each_setting_is_its_option(deploy_cmd, handed)
    names = {p.name for p in deploy_cmd.params}
    assert names - set(own) - set(handed) == JOB - {"help"}
    assert not (names & set(prune_declared())) - set(handed)  # only the prune settings deploy hands on
    where = section_of(deploy_cmd)
    assert where["precision"] == where["bench-iterations"] == "deploy" and where["heal-lr"] == "heal"
    assert where["sparsity"] == "budget" and where["tokens-merge"] == "method"  # as the recipes of a9f53a4 held them
    assert all(where[k] != s for s, keys in LEGACY_SECTIONS["deploy"].items() for k in keys)


@pytest.mark.parametrize("path", ["edgeprune/cli/deploy_cmd.py", "edgeprune/cli/deploy.py", "edgeprune/cli/evalinfo.py"])
def test_the_command_modules_write_no_option_by_hand(path):
    text = (ROOT / path).read_text()
    assert "click.option(" not in text and "click.Option(" not in text
    if path.endswith("deploy_cmd.py"):  # the job call: no forged click parameter sources
        assert len(text.splitlines()) <= 80 and "ParameterSource" not in text and "Sentinel" not in text


@pytest.mark.parametrize("args, pattern", [
    (["--heal-epochs", "2"], "--heal-epochs goes with --heal"),
    (["--no-heal", "--heal-lr", "1e-4"], "--heal-lr goes with --heal"),
    (["--heal", "--heal-lr", "0"], "--heal-lr (the heal's learning rate) must be > 0"),
    (["--heal", "--heal-epochs", "0"], "--heal-epochs"),
    (["--precision", "int4"], "int4"),
    (["--bench-iterations", "0"], "--bench-iterations"),
    (["--tokens-merge", "auto"], "--tokens-merge auto needs a --latency budget"),
    (["--sparsity", "nan"], "--sparsity"),
])
def test_a_bad_deploy_value_is_one_line_exit_2(args, pattern, tmp_path):
    base = [] if "--sparsity" in args else ["--sparsity", "0.5"]
    assert_one_line_error(run_cli(["deploy", *base, "--device", "cpu", *args, "-o", tmp_path / "out"]), pattern)
    assert not (tmp_path / "out").exists()


def test_python_names_a_bad_deploy_setting_by_its_keyword(tmp_path):
    with pytest.raises(SettingError, match=r"^heal_epochs goes with heal \("):
        edgeprune.deploy(tmp_path / "out", device="cpu", sparsity=0.5, heal_epochs=2)
    with pytest.raises(SettingError, match=r"^heal_lr \(the heal's learning rate\) must be > 0"):
        edgeprune.deploy(tmp_path / "out", device="cpu", sparsity=0.5, heal=True, heal_lr=-1.0)
    assert not (tmp_path / "out").exists()


def _planned(monkeypatch, run) -> dict:
    """``{stage: (settings hash, values)}`` that the deploy ``run()`` checks against its ``stages.json``; no stage
    runs."""
    seen: dict = {}

    def stages_only(o, state, recipe):
        for name, step in plan(o, recipe).items():
            if "settings" in step:
                seen[name] = (hash_settings(step["settings"]), setting_values(step["settings"]))

    monkeypatch.setattr(pipeline, "_deploy", stages_only)
    run()
    return seen


@pytest.mark.parametrize("record, args", [("stages.json", CPU_INT8), ("stages-heal.json", HEALED)])
def test_an_old_deploy_folder_is_resumed_with_nothing_redone(record, args, tmp_path, monkeypatch):
    """Each stage that the deploy of a9f53a4 finished is planned with the settings it recorded (so a rerun with the
    same options reuses it: its inputs and outputs are files, hashed as before)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "stages.json").write_text(_in_this_checkout(FIXTURES / record))
    written = (out / "stages.json").read_bytes()
    done = {n: e for n, e in json.loads((out / "stages.json").read_text())["stages"].items() if e["status"] == "done"}
    assert len(done) >= 4
    seen = _planned(monkeypatch, lambda: _ok(run_cli(["deploy", *args, "-o", out])))
    assert {n: seen[n] for n in done} == {n: (e["settings"], e["values"]) for n, e in done.items()}
    assert (out / "stages.json").read_bytes() == written


def _in_this_checkout(path: Path) -> str:
    """The fixture ``stages.json`` as this checkout would have written it: the bench stage records the profile's
    source file, an absolute path of the checkout that made the fixture (/work/main), so a clone elsewhere (CI's)
    reads the path of its own ``devices/`` and the stage's settings hash of those values."""
    d = json.loads(path.read_text())
    bench = d["stages"].get("bench") or {}
    source = ((bench.get("values") or {}).get("profile") or {}).get("source")
    if source:
        bench["values"]["profile"]["source"] = str(Path(devices.__file__).parent / Path(source).name)
        bench["settings"] = hash_settings(bench["values"])
    return json.dumps(d, indent=2) + "\n"


def _ok(result) -> None:
    assert result.exit_code == 0, result.output


def test_the_command_and_python_plan_the_same_stages(tmp_path, monkeypatch):
    cli = _planned(monkeypatch, lambda: _ok(run_cli(["deploy", *CPU_INT8, "-o", tmp_path / "cli"])))
    py = _planned(monkeypatch, lambda: edgeprune.deploy(tmp_path / "py", **PY_SETTINGS))
    assert cli == py and set(cli) == {"prune", "export", "verify", "quantize", "bench"}


def test_the_declared_defaults_are_the_python_defaults(tmp_path, monkeypatch):
    keywords = inspect.signature(pipeline.deploy).parameters
    assert {n: keywords[n].default for n in deploy_declared()} == {n: d.default for n, d in deploy_declared().items()}
    cli = _planned(monkeypatch, lambda: _ok(run_cli(["deploy", "--sparsity", "0.5", "--device", "cpu", "-o",
                                                     tmp_path / "cli"])))
    py = _planned(monkeypatch, lambda: edgeprune.deploy(tmp_path / "py", device="cpu", sparsity=0.5))
    assert cli == py and "bench" in cli


def test_old_recipes_load():
    params = deploy_cmd.make_context("deploy", ["--config", str(FIXTURES / "deploy.toml"), "-o", "x"]).params
    assert (params["precision"], params["bench_iterations"], params["bench"], params["heal"], params["sparsity"],
            params["device"], params["calib_size"]) == ("int8", 2, True, False, 0.5, "cpu", 32)
    params = prune_cmd.make_context("prune", ["--config", str(FIXTURES / "run-recipe.toml")]).params
    assert (params["calib_size"], params["eval_size"], params["torch_device"]) == (32, 64, "cpu")
    assert params["sparsity"] is None  # 0.5 is the prune's default: the key counts as not given (LEGACY_DEFAULTS)
    params = heal_cmd.make_context("heal", ["--config", str(FIXTURES / "healed-recipe.toml")]).params
    assert (params["epochs"], params["run_dir"]) == (1, "/tmp/d53/oldheal/run")
    params = quantize_cmd.make_context("quantize", ["--config", str(FIXTURES / "model-int8.onnx.recipe.toml")]).params
    assert (params["precision"], params["mode"], params["recipe"]) == ("int8", "dynamic", "auto")


def test_a_recipe_in_the_deploy_tables_loads(tmp_path):
    new = tmp_path / "new.toml"
    new.write_text('[budget]\nsparsity = 0.5\n[deploy]\nprecision = "fp16"\nbench = false\n[heal]\nheal = true\n'
                   'heal-epochs = 3\n[runtime]\ndevice = "cpu"\n')
    params = deploy_cmd.make_context("deploy", ["--config", str(new), "-o", "x"]).params
    assert (params["precision"], params["bench"], params["heal"], params["heal_epochs"]) == ("fp16", False, True, 3)


@needs_fmnist
def test_a_deploy_writes_the_stage_recipes_of_the_code_before(tmp_path):
    out = tmp_path / "out"
    args = [a for a in HEALED if a not in ("fp32", "--no-bench")]
    args[args.index("--precision") + 1:args.index("--precision") + 1] = ["int8"]
    _ok(run_cli(["deploy", *args, "--no-bench", "-o", out]))
    for mine, old in (("run/recipe.toml", "run-recipe.toml"), ("healed/recipe.toml", "healed-recipe.toml")):
        before = re.sub(r"/tmp/d53/old(heal)?", str(out), (FIXTURES / old).read_text())
        assert (out / mine).read_text() == before, mine
    # quantize's own tables are quantize's (edgeprune.cli.quantize): its recipe replays the same options
    old = tmp_path / "old.toml"
    old.write_text(re.sub(r"/tmp/d53/old", str(out), (FIXTURES / "model-int8.onnx.recipe.toml").read_text()))
    params = [quantize_cmd.make_context("quantize", ["--config", str(p)]).params
              for p in (old, out / "model-int8.onnx.recipe.toml")]
    assert params[0] == params[1] and params[0]["precision"] == "int8"
    r = run_cli(["deploy", *args, "--no-bench", "-o", out])
    assert r.exit_code == 0 and r.stdout.count("unchanged, reused") == 5, r.output  # prune ... quantize
