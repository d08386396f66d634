"""``derive`` and ``latency-table`` as library functions (issue 53 item 3, "every job a library function"):
``edgeprune.derive_run`` writes the run ``edgeprune derive`` writes and says the lines it prints; a bad input from
Python is one ``UserError`` line before any work; ``edgeprune.latency_table_run`` builds a table (a fake, counting
backend: nothing timed for real, no timing asserted) and resumes it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import edgeprune
from edgeprune.budget.correction import Correction
from edgeprune.errors import UserError
from edgeprune.latency.table import LatencyTable
from tests.conftest import needs_fmnist, run_cli
from tests.test_latency_table import _Counting, _fake_timer

#: a small, fast derivation of the embedded fmnist-vit (no SKP steps, few images, no on-disk SVD cache)
DERIVE = {"classes": "0,Bag", "flops": "0.6", "skp_steps": 0, "train_per_class": 30, "val_size": 12,
          "calib_size": 16, "eval_size": 64, "rho": 0.95, "no_cache": True, "quiet": True}


def _flags(settings: dict) -> list[str]:
    out = []
    for k, v in settings.items():
        flag = f"--{k.replace('_', '-')}"
        out += [flag] if v is True else [flag, str(v)]
    return out


def _said() -> tuple[list, object]:
    lines: list = []
    return lines, lambda message="", err=False: lines.append((message, err))


def test_the_public_names_are_lazy():
    code = ("import sys, edgeprune; assert {'derive_run', 'latency_table_run'} <= set(edgeprune.__all__) "
            "<= set(dir(edgeprune)); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_fmnist
def test_derive_run_writes_the_run_the_command_writes(tmp_path):
    lines, echo = _said()
    recipes = []
    res = edgeprune.derive_run(tmp_path / "py", echo=echo, write_recipe=lambda *a: recipes.append(a), **DERIVE)
    cli = run_cli(["derive", *_flags(DERIVE), "-o", tmp_path / "cli"])
    assert cli.exit_code == 0, cli.output
    py_rec, cli_rec = (json.loads((tmp_path / d / "run.json").read_text()) for d in ("py", "cli"))
    for key in ("weights_sha256", "params", "flops", "dense_params", "dense_flops", "blocks", "evaluation"):
        assert py_rec[key] == cli_rec[key], key
    assert res.out == tmp_path / "py" and res.record["params"] == py_rec["params"]
    assert py_rec["derivation"]["classes"] == [0, 8]
    # the recipe is the caller's (the CLI writes one; Python, given no writer, none)
    assert not (tmp_path / "py" / "recipe.toml").exists() and (tmp_path / "cli" / "recipe.toml").exists()
    assert [(p, v) for p, v, _ in recipes] == [(tmp_path / "py" / "recipe.toml", {"out": str(tmp_path / "py")})]
    # the lines said are the lines printed (but the output's name, the timings and where the SVD factors came from:
    # the second derivation in this process finds the first one's in memory)
    def same(text: str) -> list[str]:
        return [re.sub(r"SVD factors: \w+", "SVD factors: ?", t) for t in text.split("\n")
                if not t.startswith(("time:", "saved "))]

    assert same("\n".join(m for m, _ in lines)) == same(cli.stdout.rstrip("\n"))
    assert lines[-1] == (f"saved {tmp_path / 'py'}", False) and not any(err for _, err in lines)


@pytest.mark.parametrize("kw, message", [
    ({"flops": None}, "give exactly one budget"),
    ({"flops": None, "latency": "0.5"}, "edgeprune latency-table"),
    ({"flops": "fast"}, "--flops must be a fraction of the dense model"),
    ({"train_per_class": 0}, "train_per_class must be >= 1, got 0"),
    ({"skp_steps": -1}, "SKP steps must be >= 0"),
    ({"correction_rounds": 11}, "correction_rounds goes with latency"),  # given where nothing reads it
    ({"correction": Correction(), "correction_rounds": 2}, "give correction= or its keywords, not both"),
    ({"rho": 2.0}, "rho must be in [0, 1]"),
    ({"out": "exists"}, "already exists"),
])
def test_derive_run_bad_input_is_one_line_before_any_work(tmp_path, monkeypatch, kw, message):
    import edgeprune.jobs.derive_run as job

    monkeypatch.setattr(job, "make_spec", lambda *a, **k: pytest.fail("the model was made"))
    (tmp_path / "exists").mkdir()
    kw = {**DERIVE, "out": tmp_path / "new", **kw}
    if kw["out"] == "exists":
        kw["out"] = tmp_path / "exists"
    lines, echo = _said()
    with pytest.raises(UserError) as err:
        edgeprune.derive_run(echo=echo, **kw)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert lines == [] and not (tmp_path / "new").exists()


@pytest.fixture
def fake_backend():
    """The counting fake backend of tests/test_latency_table.py (every module costs a known function of its shape),
    taken off the registry afterwards."""
    from edgeprune.latency.measure import unregister_timer

    _fake_timer()
    _Counting.reset()
    yield _Counting
    _Counting.reset()
    unregister_timer("fake-count")


#: a 2-block vit_tiny at 32 px (the fake backend's dense shape) on a small grid, one timed run per entry
TABLE = {"model_name": "vit_tiny_patch16_224", "random_init": True, "img_size": 32, "model_kwargs": {"depth": 2},
         "backend": "fake-count", "threads": 1, "batch": 2, "warmup": 0, "iterations": 1, "clock": "wall",
         "interleave": False, "repeats": 1, "grid": {"max_mlp": 3, "max_dims": 2, "max_heads": 2}, "quiet": True}


def test_latency_table_run_builds_reports_and_resumes(tmp_path, fake_backend):
    out = tmp_path / "t.json"
    lines, echo = _said()
    recipes: list = []
    res = edgeprune.latency_table_run(out, echo=echo, write_recipe=recipes.append, **TABLE)
    assert res.out == out and recipes == [out] and fake_backend.calls
    table = LatencyTable.load(out)
    assert table.complete and table.unverified is None and res.table.key == table.key
    assert table.key["backend"] == "fake-count" and table.key["batch"] == 2 and table.key["depth"] == 2
    assert [err for _, err in lines] == [False, False]
    assert lines[0][0].startswith(f"{out}: ") and " entries on fake-device (fake-count 1, batch 2" in lines[0][0]
    assert lines[1][0].startswith("self-check (predicted / measured whole): dense ")
    fake_backend.calls = []
    again = edgeprune.latency_table_run(str(out), echo=echo, **TABLE)
    assert fake_backend.calls == [] and again.table.key == table.key  # the same key: resumed, nothing to time


@pytest.mark.parametrize("kw, message", [
    ({"model_name": None}, "model_name is required"),
    ({"spread": 0.1}, "spread goes with the spread check, which repeats 1 turns off"),
    ({"tokens": ["x"]}, "--tokens: 'x' is not an integer"),
    ({"batch": 0}, "--batch must be >= 1"),
    ({"device": "nope"}, "unknown device 'nope'"),
    ({"out": "folder"}, "is a folder"),
])
def test_latency_table_run_bad_input_is_one_line_before_any_timing(tmp_path, fake_backend, kw, message):
    out = tmp_path if kw.pop("out", None) == "folder" else tmp_path / "t.json"
    with pytest.raises(UserError) as err:
        edgeprune.latency_table_run(out, echo=lambda *a, **k: pytest.fail("said something"), **{**TABLE, **kw})
    assert message in str(err.value) and "\n" not in str(err.value)
    assert fake_backend.calls == [] and not Path(tmp_path / "t.json").exists()
