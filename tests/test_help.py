"""Help a newcomer can read (issue 42 item 3) and one meaning of ``--device`` (item 4).

``--help`` of the commands that make something shows the essential options (at most 15, the help
options included) and the names of the other groups; ``--help-all`` shows every option, by group;
every default is a value or one short rule. ``--device`` is a deployment profile; the torch device
is ``--torch-device``; the old ``--device cuda`` still works with a one-line warning.
"""

from __future__ import annotations

import re

import pytest
import torch

from edgeprune.cli.help import ESSENTIALS
from edgeprune.cli.main import cli
from edgeprune.cli.recipe import recipe_params
from tests.conftest import assert_one_line_error, run_cli

COMMANDS = ("prune", "heal", "derive", "quantize", "latency-table")
_ROW = re.compile(r"^│\s{1,6}\*?\s{0,4}(--[a-z][a-z0-9-]*)")  # the first column (not a wrapped help line)


def _shown(text: str) -> list[str]:
    """The options of a rich help text: the first option name of each row of a panel."""
    return [m.group(1) for line in text.splitlines() if (m := _ROW.match(line))]


def _essentials(command: str) -> list[str]:
    """The keys a command's --help shows first (its own essentials and its declared settings marked essential)."""
    return [k for k in cli.commands[command].essentials() if k not in ("config", "help-all", "help")]


def _options(command: str) -> set[str]:
    cmd = cli.commands[command]
    return {[o for o in p.opts if o.startswith("--")][0] for p in cmd.params
            if p.param_type_name == "option" and not p.hidden} | {"--help"}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_the_essentials_and_the_group_names(command):
    res = run_cli([command, "--help"])
    assert res.exit_code == 0, res.output
    shown = _shown(res.stdout)
    assert 5 <= len(shown) <= 15, shown
    assert len(shown) == len(set(shown))
    assert set(shown[: len(_essentials(command))]) == {f"--{k}" for k in _essentials(command)}  # essentials first
    assert {"--config", "--help-all", "--help"} <= set(shown)
    assert "Essential options" in res.stdout
    left_out = _options(command) - set(shown)
    assert left_out, "nothing left for --help-all"
    for group in cli.commands[command].groups():  # every group named (prune's: its settings' sections)
        assert group in res.stdout.split("More options:")[1].replace("\n", " ").replace("  ", " ")
    assert f"edgeprune {command} --help-all" in res.stdout.replace("\n", " ").replace("  ", " ")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_all_shows_every_option_once_in_its_group(command):
    res = run_cli([command, "--help-all"])
    assert res.exit_code == 0, res.output
    shown = _shown(res.stdout)
    assert set(shown) == _options(command), set(shown) ^ _options(command)
    assert len(shown) == len(set(shown))
    group = "CORP options" if command == "prune" else "Method options"
    assert "Essential options" in res.stdout and group in res.stdout
    assert res.stdout.index("Essential options") < res.stdout.index(group)


def test_prune_help_at_most_15_options():
    assert len(_shown(run_cli(["prune", "--help"]).stdout)) <= 15
    assert len(_shown(run_cli(["prune", "--help-all"]).stdout)) >= 40


@pytest.mark.parametrize("command", COMMANDS + ("eval", "verify"))
def test_every_default_is_a_value_or_one_short_rule(command):
    for p in cli.commands[command].params:
        help_text = getattr(p, "help", None) or ""
        for default in re.findall(r"\[([^\[\]]*)\]\s*\.?\s*$", help_text):
            assert len(default) <= 60 and default.count(";") <= 1, (command, p.name, default)


def test_essentials_are_options_of_their_command():
    for command in ESSENTIALS:
        keys = _essentials(command)
        assert set(keys) <= set(recipe_params(cli.commands[command])), command
        assert len(keys) + 3 <= 15, command  # + --config, --help-all, --help


# ---- --device: a deployment profile; --torch-device: where the torch passes run ---------------
@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("cmd", ["prune", "eval", "heal", "derive"])
def test_old_device_cuda_warns_then_fails_as_before_without_cuda(cmd, tmp_path, no_cuda):
    args = {"prune": ["prune"], "eval": ["eval"], "heal": ["heal", tmp_path],
            "derive": ["derive", "--classes", "0,1", "--flops", "0.5"]}[cmd]
    res = run_cli([*args, "--device", "cuda", *(["-o", tmp_path / "o"] if cmd != "eval" else [])])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in res.output, res.stderr
    assert lines[0].startswith("warning: --device cuda is a torch device: use --torch-device cuda")
    assert lines[1] == "error: CUDA is not available (use --torch-device cpu)"
    assert not (tmp_path / "o").exists()


def test_torch_device_cuda_without_cuda_is_one_line(tmp_path, no_cuda):
    assert_one_line_error(run_cli(["prune", "--torch-device", "cuda", "-o", tmp_path / "o"]), "CUDA is not available")
    assert_one_line_error(run_cli(["prune", "--device", "orin-nx", "--torch-device", "cuda:0", "-o", tmp_path / "o"]),
                          "CUDA is not available")


def test_bad_device_values_and_conflicts_are_one_line(tmp_path):
    o = ["-o", tmp_path / "o"]
    assert_one_line_error(run_cli(["prune", "--device", "tpu", *o]), "unknown device 'tpu': not a device profile")
    assert_one_line_error(run_cli(["prune", "--device", "cuda:x", *o]), "unknown device 'cuda:x'")
    assert_one_line_error(run_cli(["prune", "--torch-device", "tpu", *o]), "unknown device 'tpu' (--torch-device")
    assert_one_line_error(run_cli(["prune", "--torch-device", "orin-nx", *o]), "unknown device 'orin-nx'")
    assert_one_line_error(run_cli(["prune", "--device", tmp_path / "none.toml", *o]), "none.toml")
    res = run_cli(["prune", "--device", "cuda", "--torch-device", "cpu", *o])
    assert res.exit_code == 2 and res.stderr.strip().splitlines()[-1] == (
        "error: --device cuda (the old spelling of --torch-device) and --torch-device cpu: give --torch-device only")
    assert not (tmp_path / "o").exists()


def test_profile_chooses_the_default_torch_device(monkeypatch):
    from edgeprune.jobs.models import torch_device_of

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert torch_device_of("cpu", None, "auto") == "cpu"  # the CPU profile: the CPU
    assert torch_device_of("orin-nx", None, "auto") == "cuda"  # a GPU profile: auto
    assert torch_device_of(None, None, "auto") == "cuda"
    assert torch_device_of(None, None, "cpu") == "cpu"  # eval / verify: cpu unless asked
    assert torch_device_of("cpu", "cuda", "auto") == "cuda"  # --torch-device wins
    assert torch_device_of("cuda", None, "cpu") == "cuda"  # the old spelling


def test_build_and_bench_keep_device_as_a_profile():
    for name in ("build", "bench", "latency-table"):
        text = run_cli([name, "--help-all" if name == "latency-table" else "--help"]).stdout
        assert "--device" in text and "--torch-device" not in text
