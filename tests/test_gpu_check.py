"""``benchmarks/gpu_check.py`` (issue 43, item 4): the GPU check in one command.

The dry run (the same steps on the CPU with tiny sizes) runs as a user runs it, in a subprocess; the
pieces that only matter on a GPU are tested here without one: the profile written for the GPU is a valid
GPU profile the torch timer accepts at fp16 / batch 256, a failing or overrunning check is recorded and
the others go on, the deadline stops starting checks, the CUDA tests are found by their decorators, and
bad options are one-line errors before any work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import gpu_check
from edgeprune.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
NAMES = [n for n, _ in gpu_check.CHECKS]


def test_dry_run_exercises_every_check_and_writes_both_reports(tmp_path):
    out = tmp_path / "tmp"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    doc = json.loads((out / "gpu_check.json").read_text())
    checks = doc["checks"]
    failed = {n: (c["number"], c["details"].get("traceback", "")[-1500:]) for n, c in checks.items()
              if c["status"] == "fail"}
    assert not failed, failed  # every step runs on the CPU: a failure here is a broken step
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(checks) == NAMES and doc["mode"] == "dry-run"
    assert all(c["status"] in gpu_check.STATUSES and c["number"] for c in checks.values())
    # one summary line per check, in order: name, status, the number
    lines = [line for line in proc.stdout.splitlines() if line.split(":")[0] in NAMES]
    assert [line.split(":")[0] for line in lines] == NAMES
    assert all(f"{n}: {checks[n]['status']} -- " in line for n, line in zip(NAMES, lines))
    # the steps really ran: the CUDA tests were found and collected, the table was built and used, the
    # latency loop measured, the speed-up table has both models at both batch sizes
    cuda = checks["cuda_tests"]["details"]
    assert len(cuda["tests"]) >= 5 and sum(cuda["counts"].values()) >= len(cuda["tests"])
    if not torch.cuda.is_available():
        assert checks["cuda_tests"]["status"] == "skipped" and set(cuda["counts"]) == {"skipped"}
    table = checks["latency_table"]["details"]
    assert table["complete"] and table["entries"] > 0 and table["key"]["backend"] == "torch"
    lat = checks["latency_prune"]["details"]["latency_check"]
    assert lat["measured"]["dense_ms"] > 0 and lat["measured"]["pruned_ms"] > 0 and lat["rounds"]
    rows = checks["speedup"]["details"]["rows"]
    lat_model = next(r["model"] for r in rows if r["model"].startswith("latency "))
    assert float(lat_model.split()[1]) >= gpu_check.DRY.speedup_latency
    assert sorted((r["model"], r["batch"]) for r in rows) == sorted(
        (m, b) for m in ("flops 0.5", lat_model) for b in gpu_check.DRY.bench_batches)
    assert all(r["speedup"] > 0 for r in rows)
    assert checks["heal_resume"]["details"]["resumed_from_epoch"] == 1
    # the markdown: every check's row, each table row with the header's number of cells ("|" escaped)
    md = (out / "gpu_check.md").read_text()
    table_rows = [line for line in md.splitlines() if line.startswith("| ") and "|---" not in line]
    for n in NAMES:
        assert any(line.startswith(f"| {n} | {checks[n]['status']} |") for line in table_rows), n
    assert "dry-run" in md and "no number here is a GPU measurement" in md
    header_cells = None
    for line in md.splitlines():
        if not line.startswith("|"):
            header_cells = None
            continue
        cells = len(line.replace("\\|", "").split("|"))
        header_cells = header_cells or cells
        assert cells == header_cells, line


def _fake_plan(monkeypatch, budgets: dict) -> None:
    monkeypatch.setattr(gpu_check, "DRY", dataclasses.replace(gpu_check.DRY, budgets=budgets))


def test_a_failing_or_overrunning_check_is_recorded_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    def boom(ctx, d):
        d["partial"] = 1
        raise ValueError("planted\nsecond line")

    def slow(ctx, d):
        d["rows"] = ["measured before the budget ran out"]
        time.sleep(30)
        return "pass", "never"

    def fine(ctx, d):
        return "pass", "42"

    monkeypatch.setattr(gpu_check, "CHECKS", (("cuda_tests", boom), ("runner_modes", slow), ("heal_resume", fine)))
    _fake_plan(monkeypatch, {"cuda_tests": 30, "runner_modes": 1, "heal_resume": 30})
    t0 = time.perf_counter()
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    assert time.perf_counter() - t0 < 20  # the sleeping check was cut at its budget
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert checks["cuda_tests"]["status"] == "fail" and checks["cuda_tests"]["number"] == "ValueError: planted"
    assert "planted" in checks["cuda_tests"]["details"]["traceback"] and checks["cuda_tests"]["details"]["partial"] == 1
    assert checks["runner_modes"]["status"] == "fail" and "time budget of 1 s" in checks["runner_modes"]["number"]
    assert checks["runner_modes"]["details"]["rows"] == ["measured before the budget ran out"]
    assert checks["heal_resume"] == {**checks["heal_resume"], "status": "pass", "number": "42"}
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" -- ")[0] for line in out] == ["cuda_tests: fail", "runner_modes: fail", "heal_resume: pass"]
    assert "ValueError: planted" in (tmp_path / "gpu_check.md").read_text()


def test_the_deadline_stops_starting_checks(tmp_path, monkeypatch):
    def nap(ctx, d):
        time.sleep(1.5)
        return "pass", "slept"

    monkeypatch.setattr(gpu_check, "CHECKS", (("cuda_tests", nap), ("runner_modes", nap)))
    monkeypatch.setattr(gpu_check, "MIN_START_S", 1.0)
    _fake_plan(monkeypatch, {"cuda_tests": 30, "runner_modes": 30})
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--deadline", "2"]) == 0
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert checks["cuda_tests"]["status"] == "pass"
    assert checks["runner_modes"]["status"] == "skipped" and "not started" in checks["runner_modes"]["number"]


def test_only_runs_the_named_checks_in_order(tmp_path, monkeypatch):
    seen = []
    fakes = tuple((n, lambda ctx, d, n=n: seen.append(n) or ("pass", n)) for n in NAMES)
    monkeypatch.setattr(gpu_check, "CHECKS", fakes)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "prune_cost,cuda_tests"]) == 0
    assert seen == ["cuda_tests", "prune_cost"]
    assert list(json.loads((tmp_path / "gpu_check.json").read_text())["checks"]) == seen


def test_cuda_tests_are_found_by_their_decorators(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest, torch\n"
        "needs = pytest.mark.skipif(not torch.cuda.is_available(), reason='cuda')\n"
        "no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason='checks the refusal')\n"
        "@needs\ndef test_a(): pass\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='cuda')\n"
        "@pytest.mark.parametrize('p', [1, 2])\ndef test_b(p): pass\n"
        "@pytest.mark.gpu\ndef test_c(): pass\n"
        "@no_cuda\ndef test_refusal(): pass\n"
        "@pytest.mark.skipif(torch.cuda.is_available(), reason='x')\ndef test_inverse(): pass\n"
        "def test_plain():\n    if not torch.cuda.is_available():\n        pass\n"
        "@needs\ndef helper(): pass\n")
    (tmp_path / "tests" / "helper.py").write_text("@needs\ndef test_not_a_test_file(): pass\n")
    assert gpu_check.cuda_test_ids(tmp_path) == ["tests/test_x.py::test_a", "tests/test_x.py::test_b",
                                                 "tests/test_x.py::test_c"]
    real = gpu_check.cuda_test_ids()
    assert {"tests/test_device_heal.py::test_cuda_resume_is_bit_identical",
            "tests/test_runners.py::test_torch_runner_cuda_precisions",
            "tests/test_device.py::test_prune_on_cuda_matches_cpu"} <= set(real)
    assert "tests/test_bench_cli.py::test_torch_precisions_refused_cleanly_without_cuda" not in real


class _Reached(BaseException):
    """Raised in place of the timing: the command got past every check of its options."""


def _fake_h100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_the_gpu_profile_is_a_gpu_profile_the_torch_timer_takes_at_fp16_batch_256(tmp_path, monkeypatch):
    from devices import load_profile
    from edgeprune.latency.build import BuildOptions, settings_for

    _fake_h100(monkeypatch)
    plan = gpu_check.GPU
    profile = load_profile(str(gpu_check.write_profile(plan, tmp_path)))
    assert profile.uses_tensorrt and profile.bench.cuda_graphs
    rules = profile.pruning
    assert (rules.mlp_round_to, rules.head_dim_round_to, rules.qk_equals_v) == (64, 16, True)
    opts = BuildOptions(batch=plan.table_batch, precision=plan.precision, backend="torch", warmup=plan.table_warmup,
                        iterations=plan.table_iterations, max_seconds=plan.table_max_seconds)
    _timer, s, batch = settings_for(profile, opts, plan.model)
    assert (s.device, s.precision, s.cuda_graphs, batch) == ("cuda", "fp16", True, 256)
    dry = load_profile(str(gpu_check.write_profile(gpu_check.DRY, tmp_path / "dry")))
    assert not dry.uses_tensorrt and (dry.pruning.mlp_round_to, dry.pruning.qk_equals_v) == (64, True)


def test_every_todo_names_known_checks_or_why_not():
    for doc, phrase, check in gpu_check.TODOS:
        assert (ROOT / doc).is_file(), doc
        assert check.startswith("- (") or set(check.split(", ")) <= set(NAMES), (doc, check)
    answered = {c for _d, _p, check in gpu_check.TODOS if not check.startswith("-") for c in check.split(", ")}
    assert answered == set(NAMES)  # every check answers some TODO of the docs


@pytest.mark.parametrize("argv,match", [
    (["--dry-run", "--only", "nope"], "--only: unknown check nope"),
    (["--dry-run", "--only", ","], r"--only: unknown check \(none given\)"),
    (["--dry-run", "--deadline", "0"], "--deadline must be a positive number"),
    (["--dry-run", "--deadline", "nan"], "--deadline must be a positive number"),
    (["--dry-run", "--deadline", "inf"], "--deadline must be a positive number"),
])
def test_bad_options_are_one_line_errors_before_any_work(argv, match, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "CHECKS", (("cuda_tests", lambda ctx, d: pytest.fail("work started")),))
    with pytest.raises(UserError, match=match) as err:
        gpu_check.main([*argv, "--out", str(tmp_path / "o")])
    assert "\n" not in str(err.value)
    assert not (tmp_path / "o").exists()


def test_out_a_file_and_no_gpu_without_dry_run_are_refused(tmp_path, monkeypatch):
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(UserError, match="is a file"):
        gpu_check.main(["--dry-run", "--out", str(f)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no CUDA GPU here .* add --dry-run"):
        gpu_check.main(["--out", str(tmp_path / "o")])



def test_the_command_line_error_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """What ``python benchmarks/gpu_check.py --only nope`` does (its ``__main__``: ``common.run_main(main)``)."""
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--only", "nope", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as exc:
        gpu_check.common.run_main(gpu_check.main)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --only: unknown check nope (one of {', '.join(NAMES)})"]
    assert "common.run_main(main)" in (ROOT / "benchmarks" / "gpu_check.py").read_text()


def test_the_gpu_commands_pass_the_clis_checks(tmp_path, monkeypatch):
    """The latency-table and bench command lines the GPU run gives get through the real CLIs' option checks
    (with a GPU faked present) to the timing, with the settings meant: torch on CUDA, fp16, batch 256,
    interleaved table, CUDA graphs."""
    import edgeprune.cli.device as device_cli  # noqa: F401
    import edgeprune.jobs.bench as bench_job
    import edgeprune.jobs.latency_table_run as table_job
    from runners.bench import check_available

    _fake_h100(monkeypatch)
    ctx = gpu_check.Ctx(plan=gpu_check.GPU, folder=tmp_path)
    ctx.profile = gpu_check.write_profile(ctx.plan, tmp_path)
    seen = {}

    def build_table(anatomy, profile, opts, out, show_progress):
        seen["table"] = (profile, opts)
        raise _Reached

    def run_bench(a, b, cfg, profile, memory=False):
        check_available(cfg, profile, (a,))
        seen["bench"] = (cfg, profile)
        raise _Reached

    monkeypatch.setattr(table_job, "build_table", build_table)
    monkeypatch.setattr(bench_job, "run_bench", run_bench)
    for argv in (gpu_check.table_argv(ctx, tmp_path / "t.json"), gpu_check.bench_argv(ctx, tmp_path / "b.json")):
        with pytest.raises(_Reached):
            gpu_check.run_cli(argv)
    profile, opts = seen["table"]
    assert profile.uses_tensorrt and (opts.backend, opts.precision, opts.batch, opts.interleave) == (
        "torch", "fp16", 256, True)
    cfg, bench_profile = seen["bench"]
    assert bench_profile.uses_tensorrt and (cfg.backend, cfg.precision, cfg.cuda_graphs, cfg.batch_sizes) == (
        "torch", "fp16", True, (1,))
