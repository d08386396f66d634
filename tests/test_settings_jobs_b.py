"""Issue 53, the device commands: ``export``, ``verify``, ``build`` and ``bench`` declare their settings once
(``exporters.export_settings``: ``[export]``, ``[verify]``; ``exporters.tensorrt_settings``: ``[build]``;
``runners.bench_settings``: ``[bench]``). Each command's options are its declared settings (the parameter is the
field) plus the job's own inputs; the command modules write no option by hand; a bad value is still one line, exit
2; the Python face of each job (``edgeprune.export`` ...) takes exactly those settings as keywords, with the same
defaults.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import edgeprune
from edgeprune.cli import generate
from edgeprune.cli.main import cli
from edgeprune.cli.options import IntList
from edgeprune.errors import UserError
from exporters.export_settings import EXPORT_SECTIONS, VERIFY_SECTIONS, export_declared, verify_declared
from exporters.tensorrt_settings import BUILD_SECTIONS, build_declared
from runners.bench import resolve_config
from runners.bench_settings import BENCH_SECTIONS, BenchSection, bench_declared
from tests.conftest import assert_one_line_error, run_cli
from tests.test_settings import _assert_each_setting_is_its_option
from tests.test_tensorrt import make_onnx

MODEL = {"model_name", "checkpoint", "random_init", "num_classes", "img_size", "model_kwargs"}

#: command -> (its declared settings, the job's own CLI options, the job function, the job's own Python keywords)
COMMANDS = {
    "export": (export_declared, MODEL | {"run_dir", "model_file", "backbone", "output", "force"}, "export",
               MODEL | {"output", "run_dir", "force", "echo"}),
    "verify": (verify_declared, MODEL | {"onnx_file", "run_dir", "model_file", "backbone", "data", "json_out",
                                         "device", "torch_device"}, "verify",
               MODEL | {"onnx_file", "run_dir", "data", "json_out", "device", "torch_device", "echo"}),
    "build": (build_declared, {"onnx_path", "device", "output", "print_trtexec"}, "build",
              {"onnx_path", "device", "output", "print_trtexec", "echo"}),
    "bench": (bench_declared, {"a", "vs", "device", "json_out", "md_out", "plot_out"}, "bench",
              {"a", "vs", "device", "json_out", "md_out", "plot_out", "argv", "echo"}),
}

#: the modules of these commands (tests/test_settings.py's GENERATED_COMMANDS style: no option written by hand)
MODULES = ("edgeprune/cli/export.py", "edgeprune/cli/verify.py", "edgeprune/cli/build.py", "edgeprune/cli/device.py",
           "edgeprune/cli/devices.py")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_is_one_declared_setting_or_a_job_option(command):
    declared_of, job, _fn, _py = COMMANDS[command]
    cmd = cli.commands[command]
    declared = declared_of()
    _assert_each_setting_is_its_option(cmd, declared)
    assert {p.name for p in cmd.params} - set(declared) == job


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_python_face_takes_exactly_the_declared_settings_with_their_defaults(command):
    """``edgeprune.<job>``'s keywords are the declared settings plus the job's own inputs: a setting dropped from its
    section (or a keyword added to the job without a declaration) fails here; the defaults are the declared ones."""
    declared_of, _job, fn, own = COMMANDS[command]
    job = getattr(edgeprune, fn)
    assert job is getattr(importlib.import_module(f"edgeprune.jobs.{fn}"), fn)
    params = inspect.signature(job).parameters
    declared = declared_of()
    assert set(params) - own == set(declared)
    for name, d in declared.items():
        assert params[name].default == d.default, name


@pytest.mark.parametrize("path", MODULES)
def test_the_device_command_modules_write_no_option_by_hand_and_are_short(path):
    text = (Path(__file__).parents[1] / path).read_text()
    assert "click.option(" not in text and "click.Option(" not in text
    assert len(text.splitlines()) <= 80


@pytest.mark.parametrize("argv, pattern", [
    (["bench", "m.onnx", "--batch-sizes", "1,x"], "'--batch-sizes': expected comma-separated integers, got '1,x'"),
    (["bench", "m.onnx", "--batch-sizes", "2,0"], "'--batch-sizes': batch sizes must be positive integers"),
    (["bench", "m.onnx", "--min-block-ms", "-1"], "'--min-block-ms': -1.0 is not in the range x>=0"),
    (["bench", "m.onnx", "--min-block-ms", "nan"], "'--min-block-ms': 'nan' is not a finite number"),
    (["bench", "m.onnx", "--warmup", "-1"], "'--warmup': -1 is not in the range x>=0"),
    (["bench", "m.onnx", "--iterations", "0"], "'--iterations': 0 is not in the range x>=1"),
    (["bench", "m.onnx", "--backend", "nope"], "'--backend': 'nope' is not one of 'auto'"),
    (["bench", "m.onnx", "--precision", "int4"], "'--precision': 'int4' is not one of 'fp32', 'fp16'"),
    (["export", "-o", "x.onnx", "--attention", "flat"], "'--attention': 'flat' is not one of 'fusible', 'packed'"),
    (["export", "-o", "x.onnx", "--opset", "x"], "'--opset': 'x' is not a valid integer"),
    (["verify", "m.onnx", "--n", "0"], "'--n': 0 is not in the range x>=1"),
    (["verify", "m.onnx", "--atol", "inf"], "'--atol': 'inf' is not a finite number"),
    (["verify", "m.onnx", "--batch-size", "0"], "'--batch-size': 0 is not in the range x>=1"),
    (["build", "m.onnx", "--device", "orin-nx", "--precision", "int4"], "'--precision': 'int4' is not one of"),
])
def test_a_bad_setting_is_one_line_exit_2(argv, pattern):
    assert_one_line_error(run_cli(argv), pattern)


def test_a_job_input_keeps_its_checks():
    assert_one_line_error(run_cli(["build", "m.onnx"]), "--device")
    assert_one_line_error(run_cli(["export", "--model", "fmnist-vit"]), "-o")


def test_the_cli_and_the_python_face_build_the_same_engine_command(tmp_path):
    """The same settings given as options and as keywords: the same trtexec line (no TensorRT needed)."""
    onnx = make_onnx(tmp_path / "tiny.onnx")
    cache = tmp_path / "t.cache"
    res = run_cli(["build", onnx, "--device", "orin-nx", "--precision", "fp32", "--timing-cache", cache,
                   "--print-trtexec"])
    assert res.exit_code == 0, res.output
    out = edgeprune.build(onnx, device="orin-nx", precision="fp32", timing_cache=cache, print_trtexec=True,
                          echo=lambda *a, **k: None)
    assert res.stdout.strip() == out.trtexec and "--timingCacheFile" in out.trtexec and str(cache) in out.trtexec


def test_the_bench_settings_are_resolve_configs_keywords():
    """Every bench setting but ``memory`` (the job's own step) is a keyword of :func:`runners.bench.resolve_config`;
    the declared defaults mean "the profile's"."""
    values = {k: v for k, v in BenchSection().items() if k != "memory"}
    cfg, profile = resolve_config("cpu", **values)
    assert profile.name == "cpu" and cfg.backend == "auto" and cfg.batch_sizes == tuple(profile.bench.batch_sizes)
    assert cfg.sources["iterations"] == "profile"
    cfg, _ = resolve_config("cpu", **{**values, "batch_sizes": (1, 8), "iterations": 3})
    assert cfg.batch_sizes == (1, 8) and cfg.sources["iterations"] == "option"


def test_a_python_setting_is_checked_by_the_job(tmp_path):
    with pytest.raises(UserError, match="^static_batch must be >= 1"):  # the keyword, not the option (issue 53)
        edgeprune.export(tmp_path / "x.onnx", model_name="fmnist-vit", static_batch=0)
    r = run_cli(["export", "--model", "fmnist-vit", "--static-batch", "0", "-o", str(tmp_path / "y.onnx")])
    assert r.exit_code == 2 and "--static-batch must be >= 1" in r.output, r.output


def test_verify_names_max_drop_in_the_callers_spelling(tmp_path):
    """Issue 53: one library error, two spellings -- ``max_drop`` / ``atol`` for Python, ``--max-drop`` / ``--atol``
    on the command line (``edgeprune.cli.help.SettingsCommand``)."""
    from tests.conftest import export_fmnist_vit

    path = export_fmnist_vit(tmp_path)
    with pytest.raises(UserError, match="^max_drop applies to quantized files; dense.onnx is float \\(use atol/rtol"):
        edgeprune.verify(path, model_name="fmnist-vit", max_drop=1.0, n=4)
    r = run_cli(["verify", str(path), "--model", "fmnist-vit", "--max-drop", "1", "--n", "4"])
    assert_one_line_error(r, "--max-drop applies to quantized files; dense.onnx is float (use --atol/--rtol")


def test_a_comma_list_of_integers_is_a_generated_kind():
    """``tuple[int, ...]`` settings become a comma-list option (``--batch-sizes 1,8`` -> ``(1, 8)``); a recipe's or a
    default's list passes through."""
    d = bench_declared()["batch_sizes"]
    opt = generate.option_for(d)
    assert isinstance(opt.type, IntList) and opt.type.min == 1 and opt.name == "batch_sizes"
    assert opt.type.convert("1, 8", opt, None) == (1, 8) and opt.type.convert([4, 2], opt, None) == (4, 2)


def test_the_sections_are_the_commands_generated_groups():
    assert generate.section_table(EXPORT_SECTIONS) == {"export": ["opset", "static-batch", "no-check", "attention"]}
    assert generate.section_table(VERIFY_SECTIONS) == {"verify": ["n", "atol", "rtol", "batch-size", "max-drop"]}
    assert generate.section_table(BUILD_SECTIONS) == {"build": ["precision", "force-device", "timing-cache"]}
    assert generate.section_table(BENCH_SECTIONS)["bench"][:3] == ["backend", "provider", "batch-sizes"]
    assert cli.commands["bench"].callback.__module__ == "edgeprune.cli.device"
