"""Recipe files (issue 42 item 2): ``--config FILE.toml`` of prune, heal, derive, quantize and
latency-table; the resolved ``recipe.toml`` every run writes; a replay reproduces a run byte for byte.

Most tests parse the command line only (``make_context``: no model is built); the replay runs two
fmnist-vit prunes on 32 calibration images.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import click
import pytest
from click.core import ParameterSource

from edgeprune.cli.main import cli
from edgeprune.cli.recipe import command_tables, recipe_params, recipe_text, section_of
from edgeprune.cli.recipe_toml import toml_value as _toml_value
from edgeprune.errors import UserError
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli

COMMANDS = ("prune", "heal", "derive", "quantize", "latency-table")


def _ctx(command: str, args: list) -> click.Context:
    """The parsed context of ``edgeprune COMMAND ARGS`` (no work is done)."""
    cmd = cli.commands[command]
    return cmd.make_context(command, [str(a) for a in args])


def _recipe(tmp_path: Path, text: str, name: str = "r.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_one_section_and_the_table_names_only_options(command):
    cmd = cli.commands[command]
    keys = set(recipe_params(cmd))
    table = [k for ks in command_tables(cmd).values() for k in ks]  # the job's table + the declared sections'
    assert len(table) == len(set(table)), f"a key in two sections: {sorted(k for k in table if table.count(k) > 1)}"
    assert set(table) == keys, (f"options without a section: {sorted(keys - set(table))}; "
                                f"keys that are no option: {sorted(set(table) - keys)}")
    assert "--config" in {o for p in cmd.params for o in getattr(p, "opts", [])}


def test_the_file_gives_values_and_the_command_line_overrides_them(tmp_path):
    r = _recipe(tmp_path, '[budget]\nsparsity = 0.3\ntarget = "mlp"\n[data]\ncalib-size = 48\nseed = 3\n'
                          '[model]\nmodel-kwargs = {depth = 1}\n[runtime]\ntorch-device = "cpu"\n')
    ctx = _ctx("prune", ["--config", r, "--seed", "5"])
    p = ctx.params
    assert (p["sparsity"], p["target"], p["calib_size"], p["model_kwargs"]) == (0.3, "mlp", 48, {"depth": 1})
    assert p["seed"] == 5 and ctx.get_parameter_source("seed") == ParameterSource.COMMANDLINE
    assert ctx.get_parameter_source("calib_size") == ParameterSource.DEFAULT_MAP
    assert p["torch_device"] == "cpu"


def test_a_budget_typed_on_the_command_line_replaces_the_files(tmp_path):
    r = _recipe(tmp_path, '[budget]\nflops = "0.5"\n')
    p = _ctx("prune", ["--config", r, "--params", "0.4"]).params
    assert p["flops"] is None and p["params"] == "0.4"
    r = _recipe(tmp_path, '[budget]\nsparsity = 0.3\nmlp-sparsity = 0.2\n')
    p = _ctx("prune", ["--config", r, "--flops", "0.6"]).params
    assert (p["sparsity"], p["mlp_sparsity"], p["flops"]) == (None, None, "0.6")  # None: not given (the default)


def test_other_commands_read_their_recipes(tmp_path):
    r = _recipe(tmp_path, '[model]\nmodel = "run.onnx"\n[method]\nprecision = "int8"\nexclude = ["*head*"]\n'
                          '[output]\noutput = "q.onnx"\n')
    p = _ctx("quantize", ["--config", r]).params
    assert (str(p["model"]), p["precision"], p["exclude"], str(p["output"])) == ("run.onnx", "int8", ("*head*",),
                                                                                  "q.onnx")
    r = _recipe(tmp_path, '[model]\nrun-dir = "runs/x"\n[method]\nepochs = 2\nkeep-best = false\n')
    p = _ctx("heal", ["--config", r]).params
    assert (p["run_dir"], p["epochs"], p["keep_best"]) == ("runs/x", 2, False)
    r = _recipe(tmp_path, '[model]\nclasses = "0,1"\n[budget]\nflops = 0.6\n')
    p = _ctx("derive", ["--config", r]).params
    assert (p["classes"], p["flops"]) == ("0,1", "0.6")  # a number for a budget string is its text
    r = _recipe(tmp_path, '[runtime]\ndevice = "cpu"\nthreads = 1\n[output]\nout = "t.json"\n')
    p = _ctx("latency-table", ["--config", r]).params
    assert (p["device"], p["threads"], p["out"]) == ("cpu", 1, "t.json")


BAD = [
    ("[data]\ncalib_sise = 3\n", "[data] calib_sise: unknown key for edgeprune prune (did you mean calib-size?)"),
    ("[budget]\ncalib-size = 3\n", "[budget] calib-size: belongs in [data]"),
    ("[training]\nepochs = 3\n", "unknown section [training]"),
    ("seed = 3\n", "seed = ...: keys go into a section ([data] ...)"),
    ("data = 3\n", "data must be a section ([data]), not a value"),
    ('[data]\ncalib-size = "x"\n', '[data] calib-size = "x": wants an integer'),
    ("[data]\ncalib-size = 2.5\n", "[data] calib-size = 2.5: wants an integer"),
    ("[data]\nseed = true\n", "[data] seed = true: wants a number, not true/false"),
    ("[budget]\nsparsity = nan\n", "[budget] sparsity = nan: not a finite number"),
    ("[budget]\nsparsity = inf\n", "[budget] sparsity = inf: not a finite number"),
    ('[budget]\nsparsity = "half"\n', '[budget] sparsity = "half": wants a number'),
    ('[method]\ncriterion = "nope"\n', "[method] criterion = \"nope\": 'nope' is not one of"),
    ("[method]\ncriterion = 3\n", "[method] criterion = 3: wants a string"),
    ("[method]\nsequential = 1\n", "[method] sequential = 1: wants true or false"),
    ("[model]\nnum-classes = 0\n", "[model] num-classes = 0: 0 is not in the range x>=1"),
    ("[model]\nmodel-kwargs = [1]\n", "[model] model-kwargs = [1]: wants a table"),
    ("[budget]\nflops = \"0.5\"\nparams = 0.4\n", "[budget] flops and params: two budgets (keep one)"),
    ("[budget]\nlatency = 0.5\nflops = 0.4\n", "[budget] flops and latency: two budgets"),
    ("[budget]\nsparsity = 0.3\nflops = 0.4\n", "[budget] flops and sparsity: two budgets"),
    ("[budget]\nhead-sparsity = 0.3\nparams = 0.4\n", "[budget] params and head-sparsity: two budgets"),
    ("[budget\n", "not valid TOML: Expected ']'"),
]


@pytest.mark.parametrize("text,pattern", BAD, ids=[b[1][:40] for b in BAD])
def test_a_bad_recipe_is_one_line_naming_the_key_and_the_file(text, pattern, tmp_path):
    r = _recipe(tmp_path, text)
    res = run_cli(["prune", "--config", r, "-o", tmp_path / "out"])
    assert_one_line_error(res, pattern)
    assert str(r) in res.stderr
    assert not (tmp_path / "out").exists()


def test_bad_recipes_of_the_other_commands(tmp_path):
    r = _recipe(tmp_path, '[method]\nexclude = "*head*"\n')
    assert_one_line_error(run_cli(["quantize", "m.onnx", "--precision", "int8", "-o", tmp_path / "q.onnx",
                                   "--config", r]), "[method] exclude = \"*head*\": wants a list")
    r = _recipe(tmp_path, '[method]\nexclude = [true]\n')
    assert_one_line_error(run_cli(["quantize", "m.onnx", "--config", r]),
                          "[method] exclude = true: wants a string, not true/false")
    r = _recipe(tmp_path, '[method]\nepochs = 2\nsparsity = 0.5\n')
    assert_one_line_error(run_cli(["heal", "x", "--config", r]), "[method] sparsity: unknown key for edgeprune heal")
    r = _recipe(tmp_path, '[budget]\nflops = 0.5\nparams = 0.5\n')
    assert_one_line_error(run_cli(["derive", "--classes", "0,1", "--config", r]), "two budgets")
    r = _recipe(tmp_path, '[method]\nstatistic = "p99"\n')
    assert_one_line_error(run_cli(["latency-table", "--model", "x", "-o", "t.json", "--config", r]),
                          "[method] statistic = \"p99\": 'p99' is not one of")
    r = _recipe(tmp_path, '[runtime]\ndevice = "nano"\n')
    assert_one_line_error(run_cli(["prune", "--config", r, "-o", tmp_path / "o"]), "unknown device 'nano'")


def test_missing_recipe_file_and_conflicts_found_later_name_the_file(tmp_path):
    assert_one_line_error(run_cli(["prune", "--config", tmp_path / "none.toml"]), "none.toml: no such file")
    r = _recipe(tmp_path, "[budget]\nverify-latency = false\n")  # goes with --latency only
    res = run_cli(["prune", "--config", r, "-o", tmp_path / "o"])
    assert_one_line_error(res, f"(verify-latency from {r})")
    r = _recipe(tmp_path, "[budget]\nsparsity = 1.5\n")  # the range is checked by the CORP config
    assert_one_line_error(run_cli(["prune", "--config", r, "-o", tmp_path / "o"]), f"(sparsity from {r})")


def test_a_key_at_its_default_counts_as_no_key(tmp_path):
    """The resolved recipe of a budget run holds ``sparsity = 0.5`` (the default): replaying it is
    not "two budgets", and ``verify-latency = true`` without a latency budget is not refused."""
    r = _recipe(tmp_path, '[budget]\nsparsity = 0.5\nverify-latency = true\nflops = "0.5"\n')
    ctx = _ctx("prune", ["--config", r])
    assert ctx.get_parameter_source("sparsity") == ParameterSource.DEFAULT
    assert ctx.params["flops"] == "0.5"


def test_toml_writer_round_trips_every_kind_of_value():
    values = [True, False, 0, -3, 0.5, 1e-06, 123456.75, "a \"quoted\" \\ path\n", "ünï", [1, 2], ["x", "y"],
              {"depth": 6, "drop path": 0.0, "x": {"a": [1]}}]
    for v in values:
        assert tomllib.loads(f"k = {_toml_value(v)}")["k"] == v, v
    with pytest.raises(ValueError):
        _toml_value(float("nan"))


def test_resolved_recipe_names_every_option_and_replays_the_same_values(tmp_path):
    ctx = _ctx("prune", ["--flops", "0.5", "--calib-size", "16", "--model-kwargs", "depth=1", "-o", tmp_path / "x"])
    text = recipe_text(ctx)
    data = tomllib.loads(text)
    sections = section_of(cli.commands["prune"])
    for key, section in sections.items():  # every option: a key, or a comment when unset
        assert f"\n{key} = " in text or f"\n# {key} = (not set)" in text, key
        if key in data.get(section, {}):
            assert data[section][key] is not None
    assert data["budget"]["flops"] == "0.5" and data["model"]["model-kwargs"] == {"depth": 1}
    assert "# sparsity = (not set)" in text  # not given: 0.5 without a budget (edgeprune.pruning.config)
    r = _recipe(tmp_path, text)
    again = _ctx("prune", ["--config", r]).params
    assert {k: v for k, v in again.items()} == {k: v for k, v in ctx.params.items()}


@needs_fmnist
def test_prune_config_recipe_toml_reproduces_the_run_byte_for_byte(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    res = run_cli(["prune", "--calib-size", "32", "--seed", "1", "--sparsity", "0.25", "--no-eval", "--quiet",
                   "--torch-device", "cpu", "-o", a])
    assert res.exit_code == 0, res.output
    assert (a / "recipe.toml").is_file() and (a / "run.json").is_file()
    rec = tomllib.loads((a / "recipe.toml").read_text())
    assert rec["data"]["calib-size"] == 32 and rec["data"]["seed"] == 1 and rec["output"]["out"] == str(a)
    res = run_cli(["prune", "--config", a / "recipe.toml", "-o", b])
    assert res.exit_code == 0, res.output
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    ra, rb = (tomllib.loads((d / "recipe.toml").read_text()) for d in (a, b))
    ra["output"].pop("out"), rb["output"].pop("out")
    assert ra == rb


def test_recipe_errors_are_user_errors():
    """The loader raises UserError (exit 2 through the CLI's handler), never a click exception."""
    from edgeprune.cli.recipe import load_recipe

    cmd = cli.commands["prune"]
    with pytest.raises(UserError):
        load_recipe("/nonexistent/recipe.toml", cmd, click.Context(cmd))
