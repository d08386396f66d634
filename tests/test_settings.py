"""Settings declared once (issue 53 items 1-2): the sections of ``edgeprune.pruning.settings`` are the schema; the
prune command's options, its ``--help`` groups and essentials, its recipe tables, the Python keywords and the record
are views of them; a library error names the setting in the caller's spelling.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import ClassVar

import click
import pytest
import torch
from safetensors.torch import load_file
from click.testing import CliRunner

from edgeprune.budget.correction import Correction
from edgeprune.cli import generate
from edgeprune.cli.main import cli
from edgeprune.cli.prune import make_prune_command
from edgeprune.cli.recipe import LEGACY_SECTIONS, command_tables, recipe_params
from edgeprune.corp.config import CorpConfig
from edgeprune.errors import UserError
from edgeprune.record_schema import check_record
from edgeprune.pruning.settings import BUILT, INPUTS, PRUNE_SECTIONS, PruneSettings, prune_declared, prune_sections
from edgeprune.settings import Section, SettingError, declared_of, setting
from tests.conftest import assert_one_line_error, run_cli


@dataclasses.dataclass(frozen=True)
class ToySection(Section):
    """A setting added by a test: one declaration, no other line anywhere."""

    name: ClassVar[str] = "toy"
    title: ClassVar[str] = "Toy"

    toy_level: int = setting(3, "A toy setting of the test.", metavar="N")


@pytest.fixture
def toy():
    PRUNE_SECTIONS.register(ToySection.name, ToySection)
    try:
        yield make_prune_command()
    finally:
        PRUNE_SECTIONS.unregister(ToySection.name)


# ---- one declaration -----------------------------------------------------------------------------------------
def test_the_flat_config_is_a_view_of_the_declarations():
    """Every CorpConfig field is declared once in a prune section (or built from the budget section), with the same
    default unless the declaration's default is None ("auto", resolved while the config is built); every declared
    setting is a CorpConfig field or an input the config is built from."""
    declared = prune_declared()
    fields = {f.name: f for f in dataclasses.fields(CorpConfig)}
    for name, f in fields.items():
        if name in BUILT:
            continue
        assert name in declared, f"CorpConfig.{name} has no declaration in a prune section"
        if declared[name].default is not None:
            assert declared[name].default == f.default, name
    assert set(declared) - set(fields) == set(INPUTS)


def _assert_each_setting_is_its_option(cmd: click.Command, declared: dict) -> None:
    """Every command-line setting of ``declared`` is one option of ``cmd`` whose parameter is the field (no rename
    map between the option and the setting), spelled as declared."""
    settings = [p for p in cmd.params if p.name in declared]
    assert {p.name for p in settings} == {n for n, d in declared.items() if d.meta.cli}
    for p in settings:
        assert f"--{declared[p.name].spelling}" in p.opts


def test_every_prune_option_is_one_declared_setting_or_a_job_option():
    cmd = cli.commands["prune"]
    declared = prune_declared()
    _assert_each_setting_is_its_option(cmd, declared)
    job = {"model_name", "model_file", "backbone", "checkpoint", "random_init", "num_classes", "img_size",
           "model_kwargs", "calib_dir", "calib_size", "seed", "batch_size", "eval_data", "eval_size", "no_eval",
           "device", "torch_device", "out", "quiet", "config", "help_all", "help"}
    assert {p.name for p in cmd.params} - set(declared) <= job


def test_a_setting_declared_twice_or_without_setting_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Twice(Section):
        name: ClassVar[str] = "twice"
        round_to: int = setting(8, "again")

    with pytest.raises(TypeError, match="declared in"):
        declared_of(prune_sections() + (Twice,))

    @dataclasses.dataclass(frozen=True)
    class Bare(Section):
        name: ClassVar[str] = "bare"
        x: int = 1

    with pytest.raises(TypeError, match="not declared with"):
        Bare.declared()
    with pytest.raises(ValueError, match="immutable"):
        setting([1], "a list default")


def test_a_toy_setting_is_one_declaration_and_appears_everywhere(toy, tmp_path):
    """--help-all, the recipe (its own table), the Python keywords and the record show a setting added in one
    place."""
    res = CliRunner().invoke(toy, ["--help-all"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "--toy-level" in res.output and "Toy options" in res.output and "A toy setting of the test." in res.output
    assert command_tables(toy)["toy"] == ["toy-level"] and "toy-level" in recipe_params(toy)

    s = PruneSettings.from_keywords(toy_level=5)  # the Python keyword
    assert s.toy.toy_level == 5 and s.to_dict()["toy"] == {"toy_level": 5}
    assert s.config() == PruneSettings.from_keywords().config()  # not a CorpConfig field: no effect on the prune

    out = tmp_path / "run"
    res = CliRunner().invoke(toy, ["--toy-level", "7", "--calib-size", "16", "--no-eval", "--quiet",
                                   "--torch-device", "cpu", "-o", str(out)])
    assert res.exit_code == 0, res.output
    recipe = tomllib.loads((out / "recipe.toml").read_text())
    assert recipe["toy"] == {"toy-level": 7}
    assert json.loads((out / "run.json").read_text())["sections"]["toy"] == {"toy_level": 7}


def test_the_recipe_is_written_in_the_sections_and_old_layouts_still_load(tmp_path):
    cmd = cli.commands["prune"]
    tables = command_tables(cmd)
    assert tables["correction"] == ["verify-latency", "latency-tolerance", "latency-rounds"]
    assert "check-images" in tables["allocation"] and "tokens-merge" in tables["tokens"]
    # every key of 9c01182's [budget] / [method] is still read there
    for section, keys in LEGACY_SECTIONS["prune"].items():
        for key in keys:
            assert key in recipe_params(cmd), key
    old = tmp_path / "old.toml"
    old.write_text('[budget]\nsparsity = 0.3\nlatency-rounds = 2\n[method]\nround-to = 8\n')
    assert_one_line_error(run_cli(["prune", "--config", old, "-o", tmp_path / "o"]),
                          "--latency-rounds goes with --latency")


# ---- validation and spelling ------------------------------------------------------------------------------------
def test_validate_returns_a_new_section_and_never_mutates():
    from edgeprune.embed.settings import EmbedSection
    from edgeprune.tokens.settings import TokensSection

    e = EmbedSection(embed_sparsity="0.25")
    v = e.validate()
    assert v.embed_sparsity == 0.25 and e.embed_sparsity == "0.25" and v is not e
    assert v.validate() is v  # canonical: the same object
    t = TokensSection(tokens_merge="2,1,0")
    assert t.validate().tokens_merge == (2, 1, 0) and t.tokens_merge == "2,1,0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.embed_order = "last"  # type: ignore[misc]


def test_an_unknown_keyword_is_named_and_the_known_ones_listed():
    with pytest.raises(SettingError, match="unknown prune setting 'round_two'") as err:
        PruneSettings.from_keywords(round_two=8)
    assert "round_to" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SettingError, match="unknown correction setting 'rounds'"):
        Correction.from_mapping({"rounds": 3})
    assert PruneSettings.from_keywords(criterion="energy").corp.mlp_criterion == "energy"  # the old keyword


def test_an_error_names_the_setting_in_the_callers_spelling(tmp_path):
    with pytest.raises(UserError) as err:  # Python: the keyword
        Correction(correction_rounds=11).validate()
    assert str(err.value).startswith("correction_rounds must be an integer in [0, 10]")
    assert isinstance(err.value, SettingError)
    spelled = err.value.spelled(generate.spelling((Correction,)))
    assert str(spelled).startswith("--latency-rounds must be")  # the command line: the option
    res = run_cli(["prune", "--latency", "0.5", "--latency-table", tmp_path / "none.json", "--latency-rounds", "11",
                   "-o", tmp_path / "o"])
    assert_one_line_error(res, "--latency-rounds must be an integer in [0, 10]")
    r = tmp_path / "r.toml"  # a recipe: the option and the file's key
    r.write_text('[budget]\nlatency = "0.5"\nlatency-table = "none.json"\n[correction]\nlatency-rounds = 11\n')
    res = run_cli(["prune", "--config", r, "-o", tmp_path / "o"])
    assert_one_line_error(res, f"--latency-rounds must be an integer in [0, 10], got 11 (latency-rounds from {r})")


def test_the_generator_expresses_each_kind():
    declared = declared_of((Correction,))
    pair = generate.option_for(declared["verify_budget"], {"redo": "r", "made": "m", "reference": "x"})
    assert pair.opts == ["--verify-latency"] and pair.secondary_opts == ["--no-verify-latency"]
    assert pair.default is None  # not given: a setting given where nothing reads it is refused
    assert "bench the m model against the x one" in pair.help
    rounds = generate.option_for(declared["correction_rounds"], {"redo": "r"})
    assert isinstance(rounds.type, click.types.IntParamType) and rounds.name == "correction_rounds"
    neg = generate.option_for(prune_declared()["compensation"])
    assert neg.opts == ["--no-compensation"] and neg.flag_value is False and neg.default is True

    @dataclasses.dataclass(frozen=True)
    class NoSwitch(Section):
        name: ClassVar[str] = "noswitch"
        on: bool = setting(True, "a bool with no switch")

    with pytest.raises(TypeError, match="without a switch"):
        generate.option_for(NoSwitch.declared()[0])


# ---- old files still load --------------------------------------------------------------------------------------
FIXTURES = Path(__file__).parent / "fixtures" / "recipes_9c01182"


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_recipe_and_a_record_of_9c01182_load_and_replay_to_the_same_weights(name, tmp_path):
    """Recipes written before the settings had sections (every setting in ``[budget]`` / ``[method]``; written by
    2086ddc, the layout of 9c01182, one torch thread) still load, and replay to the same prune (structure, FLOPs,
    params and flat ``config`` of the record of then; the weights' per-tensor norms to 1e-4); the record of then
    passes the record schema."""
    src = FIXTURES / name
    old = json.loads((src / "run.json").read_text())
    check_record(old, src / "run.json")
    assert "[method]" in (src / "recipe.toml").read_text()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = run_cli(["prune", "--config", src / "recipe.toml", "-o", tmp_path / "new"])
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    new = json.loads((tmp_path / "new" / "run.json").read_text())
    # the same prune: structure, counts and flat config exactly; the weights to float round-off (the sha256 of then
    # is of an Intel Xeon run: another CPU's matmul kernels round differently, so bytes are not portable)
    for key in ("blocks", "flops", "params", "tokens_merge"):
        assert new.get(key) == old.get(key), key
    added = {k: v for k, v in new["config"].items() if k not in old["config"]}  # settings declared since: defaults
    assert {k: v for k, v in new["config"].items() if k in old["config"]} == old["config"]
    assert added == {k: getattr(CorpConfig(), k) for k in added}, added
    norms = json.loads((src / "weights_norms.json").read_text())["norms"]
    weights = load_file(str(tmp_path / "new" / "model.safetensors"))
    assert sorted(weights) == sorted(norms)
    for key, value in norms.items():
        # head.bias alone is set by round-off: the final LayerNorm's output x = g * xhat + beta has sum(xhat) = 0, so
        # the refit's weight and bias trade off exactly along W + u (1/g)^T, b - u sum(beta / g) (only b + W beta is
        # determined); the norms of then are of an AMD EPYC run, and an Intel Xeon's differ by 6.8% there
        tol = 0.1 if key == "head.bias" else 1e-4
        assert abs(float(weights[key].double().norm()) - value) <= tol * value + 1e-6, key
    replayed = tomllib.loads((tmp_path / "new" / "recipe.toml").read_text())  # written in the sections now
    assert "method" not in replayed and "budget" in replayed and "corp" in replayed


#: the command modules: every module of edgeprune/cli that defines a command (issue 53: all their setting options are
#: generated from declared settings, the job options come from the shared helpers of cli/options.py)
GENERATED_COMMANDS = tuple(sorted(str(p.relative_to(Path(__file__).parents[1]))
                                  for p in (Path(__file__).parents[1] / "edgeprune" / "cli").glob("*.py")
                                  if re.search(r"^\s*@click\.command\(", p.read_text(), re.M)))


def test_every_command_module_is_found():
    names = {Path(p).stem for p in GENERATED_COMMANDS}
    assert {"prune", "derive", "heal", "quantize", "latency_table", "deploy_cmd", "export", "verify", "build",
            "device", "evalinfo"} <= names, names


@pytest.mark.parametrize("path", GENERATED_COMMANDS)
def test_a_generated_command_writes_no_option_by_hand_and_is_short(path):
    text = (Path(__file__).parents[1] / path).read_text()
    assert "click.option(" not in text and "click.Option(" not in text
    assert len(text.splitlines()) <= 80, "a command module is the job call (about 40 lines of code)"


@pytest.mark.parametrize("kw, python, cli", [
    (dict(flops=0.5, sparsity=0.3), "flops replaces the sparsity: drop sparsity", "--flops replaces the sparsity: "
     "drop --sparsity"),
    (dict(allocation_check_images=8), "allocation_check_images goes with flops/params/latency",
     "--check-images goes with --flops/--params/--latency"),
    (dict(flops=0.5, verify_budget=False), "verify_budget=False goes with latency",
     "--no-verify-latency goes with --latency"),
    (dict(embed_order="last"), "embed_order goes with embed_sparsity S", "--embed-order goes with --embed-sparsity S"),
])
def test_a_setting_given_where_nothing_reads_it_is_refused_for_every_caller(kw, python, cli, tmp_path):
    """One check in the library (``edgeprune.option_checks``), the caller's spelling: the Python keyword, the option."""
    from edgeprune.pruning.config import corp_config

    with pytest.raises(SettingError) as err:
        corp_config(**kw)
    assert str(err.value).startswith(python), str(err.value)
    args = []
    for k, v in kw.items():
        opt = f"--{prune_declared()[k].spelling}"
        args += [opt.replace("--", "--no-") if v is False else opt] if isinstance(v, bool) else [opt, str(v)]
    assert_one_line_error(run_cli(["prune", *args, "-o", tmp_path / "o"]), cli)


def test_checking_a_config_never_changes_it():
    """Checks return the canonical config and leave the caller's object as it was (issue 53: the checks wrote what
    they checked: a budget dict turned into a Budget in place, the token candidates rewritten)."""
    from edgeprune.budget import Budget, make_budget
    from edgeprune.pruning.config import check_config

    given = CorpConfig(budget=make_budget(flops=0.5), target="all", tokens_merge="auto", tokens_candidates=[2, 0])
    before = repr(given)
    with pytest.raises(UserError, match="tokens_merge auto with a flops budget"):
        check_config(given)  # a flops budget cannot judge merges: refused, and nothing written meanwhile
    assert repr(given) == before
    ok = CorpConfig(budget={"kind": "flops", "value": 0.5}, target="all")
    checked = check_config(ok)
    assert isinstance(checked.budget, Budget) and isinstance(ok.budget, dict)
    assert check_config(checked) is checked  # canonical: the same object


def test_every_derive_option_is_one_declared_setting_or_a_job_option(tmp_path):
    """derive's options are its declared settings (``edgeprune.nuwa.settings``: budget, correction, nuwa), each
    parameter named as its field (a ``derive_run`` keyword), plus the job's own options; a recipe of 9c01182 (the
    settings in ``[method]`` / ``[runtime]`` / ``[budget]``) still loads."""
    from edgeprune.cli.recipe import section_of
    from edgeprune.nuwa.settings import DERIVE_SECTIONS, derive_declared

    cmd = cli.commands["derive"]
    declared = derive_declared()
    assert cmd.settings_sections == DERIVE_SECTIONS
    _assert_each_setting_is_its_option(cmd, declared)
    job = {"model_name", "model_file", "backbone", "checkpoint", "random_init", "num_classes", "img_size",
           "model_kwargs", "classes", "data",
           "train_data", "train_per_class", "calib_dir", "calib_size", "val_size", "eval_data", "eval_size",
           "no_eval", "seed", "threads", "device", "torch_device", "out", "quiet", "config", "help_all"}
    assert {p.name for p in cmd.params} - set(declared) == job
    where = section_of(cmd)
    assert where["skp-steps"] == where["no-cache"] == "nuwa" and where["flops"] == "budget"
    _assert_moved_keys_still_read(cmd, "derive", where)
    old = tmp_path / "old.toml"
    old.write_text('[model]\nclasses = "0,1"\n[budget]\nflops = "0.5"\nlatency-rounds = 3\n'
                   '[method]\nskp-steps = 5\nkey-bias = "augment"\n[runtime]\nno-cache = true\n')
    params = cmd.make_context("derive", ["--config", str(old)]).params
    assert (params["skp_steps"], params["key_bias"], params["no_cache"], params["flops"]) == (5, "augment", True,
                                                                                             "0.5")


def _assert_moved_keys_still_read(cmd, command: str, where: dict) -> None:
    """Every key a command's 9c01182 recipe held in another section is still read there (LEGACY_SECTIONS)."""
    for section, keys in LEGACY_SECTIONS[command].items():
        for key in keys:
            assert key in recipe_params(cmd) and where[key] != section, key


def test_every_heal_option_is_one_declared_setting_or_a_job_option(tmp_path):
    """heal's options are its declared settings (``edgeprune.heal.settings``: heal), each parameter named as its
    field (a ``heal_run`` keyword), plus the job's own options; a recipe of 9c01182 (the settings in ``[method]`` /
    ``[data]`` / ``[runtime]``) still loads."""
    from edgeprune.cli.recipe import section_of
    from edgeprune.heal.settings import HEAL_SECTIONS, heal_declared

    cmd = cli.commands["heal"]
    declared = heal_declared()
    assert cmd.settings_sections == HEAL_SECTIONS
    _assert_each_setting_is_its_option(cmd, declared)
    job = {"run_dir", "calib_dir", "calib_size", "seed", "batch_size", "eval_data", "eval_size", "no_eval", "device",
           "torch_device", "out", "quiet", "config", "help_all"}
    assert {p.name for p in cmd.params} - set(declared) == job
    where = section_of(cmd)
    assert where["epochs"] == where["holdout"] == where["cache-targets"] == where["keep-best"] == "heal"
    _assert_moved_keys_still_read(cmd, "heal", where)
    old = tmp_path / "old.toml"
    old.write_text('[data]\nholdout = 0.25\n[method]\nepochs = 3\nloss = "mse"\nkeep-best = false\n'
                   '[runtime]\nmemory-budget-mb = 64\n')
    params = cmd.make_context("heal", ["run", "--config", str(old)]).params
    assert (params["epochs"], params["loss"], params["keep_best"], params["holdout"],
            params["memory_budget_mb"]) == (3, "mse", False, 0.25, 64)
    assert cmd.make_context("heal", ["run", "--keep-last"]).params["keep_best"] is False
