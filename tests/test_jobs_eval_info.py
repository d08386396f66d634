"""``eval`` and ``info`` as library functions (issue 53, "every job a library function"): ``edgeprune.eval_run``
returns the metrics ``edgeprune eval`` prints and writes as JSON, ``edgeprune.info_run`` the structure ``edgeprune
info`` prints (and says the same lines); a bad input is one ``UserError`` line from Python, one ``error:`` line and
exit 2 from the command.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import edgeprune
from edgeprune.errors import UserError
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli


def _said() -> tuple[list, object]:
    lines: list = []
    return lines, lambda message="", err=False: lines.append((message, err))


@pytest.fixture(scope="module")
def budgeted_run(tmp_path_factory) -> Path:
    """A small budgeted fmnist-vit run (random weights, a FLOPs budget: the record holds an allocation)."""
    out = tmp_path_factory.mktemp("evalinfo") / "run"
    r = run_cli(["prune", "--quiet", "--model", "fmnist-vit", "--random-init", "--calib-size", "16", "--no-eval",
                 "--flops", "0.7", "-o", out])
    assert r.exit_code == 0, r.output
    return out


def test_the_public_names_are_lazy():
    code = ("import sys, edgeprune, edgeprune.jobs; assert {'eval_run', 'info_run'} <= set(edgeprune.__all__) "
            "<= set(dir(edgeprune)); assert {'eval_run', 'info_run'} <= set(edgeprune.jobs.__all__); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cli_modules_are_thin_faces():
    text = (Path(__file__).parents[1] / "edgeprune" / "cli" / "evalinfo.py").read_text()
    assert len(text.splitlines()) <= 80 and "click.option(" not in text
    assert "eval_run(" in text and "info_run(" in text


@needs_fmnist
def test_info_run_returns_what_info_prints(budgeted_run):
    lines, echo = _said()
    info = edgeprune.info_run(budgeted_run, echo=echo)
    cli = run_cli(["info", budgeted_run])
    assert cli.exit_code == 0, cli.output
    assert [m for m, _ in lines] == cli.stdout.rstrip("\n").split("\n") and not any(e for _, e in lines)
    rec = json.loads((budgeted_run / "run.json").read_text())
    assert info["name"] == str(budgeted_run) and info["num_blocks"] == len(rec["blocks"])
    assert info["run"] == {"method": rec.get("method"), "targets": rec.get("targets"),
                           "sparsity": rec.get("sparsity"), "calibration": rec["calibration"].get("source")}
    assert info["allocation"] and all(line in cli.stdout.splitlines() for line in info["allocation"])
    # the totals are the printed ones
    total = re.search(r"^total: ([\d,]+) params, ([\d.]+) GFLOPs per image \(patch embedding ([\d.]+), "
                      r"head ([\d.]+)\)$", cli.stdout, re.M)
    assert total is not None, cli.stdout
    t = info["total"]
    assert t["params"] == int(total[1].replace(",", "")) == rec["params"]
    assert f"{t['gflops']:.3f}" == total[2] and f"{t['flops'] / 1e9:.3f}" == total[2]
    assert (f"{t['patch_embed_gflops']:.3f}", f"{t['head_gflops']:.3f}") == (total[3], total[4])
    # every block's row is its dict
    allocated = {b["index"]: b["dims"] for b in rec["allocation"]["blocks"]}
    for blk in info["blocks"]:
        assert blk["mlp_hidden"] == allocated[blk["index"]]["mlp"]
        row = [ln for ln in cli.stdout.splitlines() if ln.startswith(f"| {blk['index']} |")][0]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells == [str(blk["index"]), str(blk["num_heads"]), str(blk["head_dim"]), str(blk["qk_dim"]),
                         str(blk["v_dim"]), str(blk["mlp_hidden"]), f"{blk['params']:,}", f"{blk['mflops']:.1f}"]


def test_info_run_of_a_dense_model_is_info_model():
    lines, echo = _said()
    info = edgeprune.info_run(model_name="fmnist-vit", echo=echo)
    cli = run_cli(["info", "--model", "fmnist-vit"])
    assert cli.exit_code == 0, cli.output
    assert [m for m, _ in lines] == cli.stdout.rstrip("\n").split("\n")
    assert info["name"] == "fmnist-vit" and info["run"] is None and info["allocation"] == []
    assert edgeprune.info_run(echo=lambda *a, **k: None) == info  # neither: fmnist-vit
    assert sum(b["params"] for b in info["blocks"]) < info["total"]["params"]  # the blocks, inside the total
    assert info["num_blocks"] == len(info["blocks"]) and not info["merged"]


@needs_fmnist
def test_eval_run_of_a_run_equals_the_eval_json(budgeted_run, tmp_path):
    lines, echo = _said()
    m = edgeprune.eval_run(budgeted_run, eval_size=48, quiet=True, json_out=tmp_path / "py.json", echo=echo)
    cli = run_cli(["eval", budgeted_run, "--eval-size", "48", "--quiet", "--json", tmp_path / "cli.json"])
    assert cli.exit_code == 0, cli.output
    cli_m = json.loads((tmp_path / "cli.json").read_text())
    assert m == json.loads((tmp_path / "py.json").read_text()) == cli_m
    assert {"top1", "agreement"} <= set(m) and 0 <= m["top1"] <= 1 and 0 <= m["agreement"] <= 1
    assert [msg for msg, _ in lines] == cli.stdout.rstrip("\n").split("\n")
    assert lines[0][0].startswith(f"{budgeted_run}: ") and "top-1" in lines[0][0] and "agreement" in lines[0][0]


@pytest.mark.parametrize("job, kw, pattern, cli_pattern", [
    ("eval", {"model_name": "fmnist-vit"}, "either a run directory or --model", None),
    ("info", {"model_name": "fmnist-vit"}, "either a run directory or --model", None),
    # issue 53: Python is told its keywords, the command line its options
    ("info", {"img_size": 32}, "img_size/model_kwargs go with model_name", "--img-size/--model-kwargs go with --model"),
    ("eval", {"torch_device": "tpu"}, "unknown device 'tpu'", None),
])
def test_a_bad_input_is_a_user_error_and_one_line_exit_2(job, kw, pattern, cli_pattern, tmp_path):
    run = tmp_path / "run"
    run.mkdir()  # refused before it is read
    fn = edgeprune.eval_run if job == "eval" else edgeprune.info_run
    with pytest.raises(UserError) as err:
        fn(run, echo=lambda *a, **k: None, **kw)
    assert pattern in str(err.value) and "\n" not in str(err.value)
    flags = {"model_name": ["--model", "fmnist-vit"], "img_size": ["--img-size", "32"],
             "torch_device": ["--torch-device", "tpu"]}
    cli = run_cli([job, run, *[f for k in kw for f in flags[k]]])
    assert_one_line_error(cli, cli_pattern or pattern)
    if "torch_device" not in kw and cli_pattern is None:  # (--torch-device: checked while parsing, its own words)
        assert cli.stderr.strip() == f"error: {err.value}"


def test_a_missing_run_is_a_user_error(tmp_path):
    for fn, job in ((edgeprune.eval_run, "eval"), (edgeprune.info_run, "info")):
        with pytest.raises(UserError, match="run directory not found"):
            fn(tmp_path / "missing", echo=lambda *a, **k: None)
        assert_one_line_error(run_cli([job, tmp_path / "missing"]), "run directory not found")
