"""Issue 53, ``edgeprune quantize`` and ``edgeprune latency-table``: each setting is declared once
(``edgeprune.jobs.quantize_settings``, ``edgeprune.latency.settings``) and is its option, its recipe key and the job's
keyword; the command modules write no option by hand; recipes of a9f53a4 (every setting in ``[method]`` /
``[runtime]``) still load and replay to the same job call; a bad value is still one line, exit 2."""

from __future__ import annotations

import inspect
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

import edgeprune
import edgeprune.cli.latency_table as latency_table_cli
import edgeprune.jobs.quantize as quantize_job
from edgeprune.cli.main import cli
from edgeprune.cli.recipe import LEGACY_SECTIONS
from edgeprune.jobs.latency_table_run import latency_table_run
from edgeprune.jobs.quantize_settings import QUANTIZE_SECTIONS, quantize_declared
from edgeprune.latency.settings import LATENCY_TABLE_SECTIONS, latency_table_declared
from tests.conftest import assert_one_line_error, run_cli
from tests.test_settings import _assert_each_setting_is_its_option

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "recipes_53_quantize"
_HELP = {"config", "help_all"}  # click adds --help itself
_MODEL = {"model_name", "model_file", "backbone", "checkpoint", "random_init", "num_classes", "img_size",
          "model_kwargs"}
#: command -> (its declared settings, the job's own options)
COMMANDS = {
    "quantize": (quantize_declared, {"model", "output", "calib_dir", "calib_size", "seed", "eval_data", "eval_size",
                                     "force", "json_out"} | _HELP),
    "latency-table": (latency_table_declared, _MODEL | {"device", "out", "force", "quiet"} | _HELP),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_one_declared_setting_or_a_job_option(command):
    cmd = cli.commands[command]
    declared_of, job = COMMANDS[command]
    declared = declared_of()
    _assert_each_setting_is_its_option(cmd, declared)
    assert {p.name for p in cmd.params} - set(declared) == job


@pytest.mark.parametrize("path", ["edgeprune/cli/quantize.py", "edgeprune/cli/latency_table.py"])
def test_the_command_module_writes_no_option_by_hand_and_is_short(path):
    text = (ROOT / path).read_text()
    assert "click.option(" not in text and "click.Option(" not in text
    assert len(text.splitlines()) <= 80, "a command module is the job call"


@pytest.mark.parametrize("job, declared", [(quantize_job.quantize, quantize_declared),
                                           (latency_table_run, latency_table_declared)])
def test_each_setting_is_a_keyword_of_the_job_with_the_declared_default(job, declared):
    params = inspect.signature(job).parameters
    for name, d in declared().items():
        assert name in params and params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        if params[name].default is not inspect.Parameter.empty:  # quantize's precision: required, no default
            assert params[name].default == d.default, name


def test_the_choices_are_the_quantizers():
    from exporters.quantization import config

    choices = {d.name: tuple(d.meta.choice_list()) for d in quantize_declared().values() if d.meta.choices}
    assert choices["precision"] == config.PRECISIONS and choices["mode"] == config.MODES
    assert choices["calib_method"] == config.CALIB_METHODS
    assert set(choices["recipe"]) - {"auto"} <= set(config.RECIPES.names())


# ---- recipes of a9f53a4 (written by `edgeprune quantize` / `latency-table` before the sections) ----------------
#: fixture -> command; job_keywords.json: the job call a9f53a4's command made of each (its model path, outputs and
#: every setting), captured with the job replaced
RECIPES = {"static.onnx.recipe.toml": "quantize", "dynamic.onnx.recipe.toml": "quantize",
           "latency_table.json.recipe.toml": "latency-table"}


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _replay(monkeypatch, command: str, recipe: Path, tmp_path: Path) -> tuple[dict, Path]:
    """The job call of ``edgeprune COMMAND --config RECIPE`` (the job replaced) and the recipe it would write."""
    calls: dict[str, Any] = {}
    written = tmp_path / "written.recipe.toml"

    def fake(*args: Any, echo: Any, write_recipe: Any, **kw: Any) -> None:
        calls.update(args=[_plain(a) for a in args], kw={k: _plain(v) for k, v in kw.items()})
        if command == "quantize":
            write_recipe(written, {})
        else:
            write_recipe(tmp_path / "written")

    if command == "quantize":
        monkeypatch.setattr(edgeprune, "quantize", fake)  # the public name the command calls when it runs
    else:
        monkeypatch.setattr(latency_table_cli, "latency_table_run", fake)
    res = run_cli([command, "--config", recipe])
    assert res.exit_code == 0, res.output
    return calls, written


def _tables(text: str) -> dict[str, set[str]]:
    """``{table: keys}`` of a written recipe, the keys commented out as not set included."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("["):
            table = out.setdefault(line.strip("[]"), set())
        elif out and " = " in line:
            table.add(line.lstrip("# ").split(" = ")[0])
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_of_a9f53a4_loads_and_replays_to_the_same_job_call(name, monkeypatch, tmp_path):
    command, old = RECIPES[name], FIXTURES / name
    assert "[method]" in old.read_text()
    expected = json.loads((FIXTURES / "job_keywords.json").read_text())[name]
    calls, written = _replay(monkeypatch, command, old, tmp_path)
    assert calls == expected
    new = tomllib.loads(written.read_text())  # written in the sections now, and it replays to the same call
    assert "method" not in new and ("runtime" in new) == (command == "latency-table")  # latency-table: --device
    tables = _tables(written.read_text())
    for s in (QUANTIZE_SECTIONS if command == "quantize" else LATENCY_TABLE_SECTIONS):  # set or not, in its table
        assert {d.spelling for d in s.declared() if d.meta.cli} <= tables[s.name], s.name
    again, _ = _replay(monkeypatch, command, written, tmp_path / "again")
    assert again == expected


@pytest.mark.parametrize("command", COMMANDS)
def test_every_moved_key_is_still_read_where_a9f53a4_put_it(command):
    declared = COMMANDS[command][0]()
    legacy = {k for keys in LEGACY_SECTIONS[command].values() for k in keys}
    assert {d.spelling for d in declared.values() if d.meta.cli} == legacy


def test_a_key_in_the_wrong_new_section_names_its_section(tmp_path):
    r = tmp_path / "r.toml"
    r.write_text('[quantize]\nthreads = 2\n')
    assert_one_line_error(run_cli(["quantize", "m.onnx", "--precision", "int8", "-o", tmp_path / "q.onnx",
                                   "--config", r]), "[quantize] threads: belongs in [evaluation]")
    r.write_text('[timing]\nstatistic = "p99"\n')
    assert_one_line_error(run_cli(["latency-table", "--model", "x", "-o", tmp_path / "t.json", "--config", r]),
                          "[timing] statistic = \"p99\": 'p99' is not one of")


# ---- a bad value: one line, exit 2 (parsed by the generated options, or refused by the job) -------------------
QUANTIZE_BAD = [
    ([], "Missing option '--precision'"),
    (["--precision", "int4"], "Invalid value for '--precision'"),
    (["--precision", "int8", "--mode", "fast"], "Invalid value for '--mode'"),
    (["--precision", "int8", "--recipe", "trt"], "Invalid value for '--recipe'"),
    (["--precision", "int8", "--weight-rounding", "up"], "Invalid value for '--weight-rounding'"),
    (["--precision", "int8", "--auto-exclude", "-1"], "Invalid value for '--auto-exclude'"),
    (["--precision", "int8", "--smooth-alpha", "nan"], "not a finite number"),
    (["--precision", "int8", "--max-drop", "inf"], "not a finite number"),
    (["--precision", "int8", "--threads", "0"], "Invalid value for '--threads'"),
    (["--precision", "int8", "--smooth-alpha", "2"], "--smooth-alpha must be in [0, 1], got 2.0"),
    (["--precision", "int8", "--recipe", "ort", "--weight-rounding", "nearest"],
     "--weight-rounding applies to static int8 with the tensorrt recipe"),
]


@pytest.mark.parametrize("args, match", QUANTIZE_BAD, ids=[m for _, m in QUANTIZE_BAD])
def test_a_bad_quantize_value_is_one_line(args, match, tmp_path):
    res = run_cli(["quantize", tmp_path / "m.onnx", "-o", tmp_path / "q.onnx", *args])
    assert_one_line_error(res, match)
    assert not list(tmp_path.iterdir())


LATENCY_BAD = [
    (["--max-seconds", "0"], "Invalid value for '--max-seconds'"),
    (["--spread", "inf"], "not a finite number"),
    (["--statistic", "p99"], "Invalid value for '--statistic'"),
    (["--clock", "gpu"], "Invalid value for '--clock'"),
    (["--precision", "int4"], "Invalid value for '--precision'"),
    (["--batch", "x"], "Invalid value for '--batch'"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--repeats", "1", "--spread", "0.1"], "--spread goes with the spread check"),
    (["--tokens", "a,b"], "--tokens"),
]


@pytest.mark.parametrize("args, match", LATENCY_BAD, ids=[m for _, m in LATENCY_BAD])
def test_a_bad_latency_table_value_is_one_line(args, match, tmp_path):
    res = run_cli(["latency-table", "--model", "vit_tiny_patch16_224", "--random-init", "-o", tmp_path / "t.json",
                   *args])
    assert_one_line_error(res, match)
    assert not list(tmp_path.iterdir())
