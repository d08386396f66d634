"""``edgeprune deploy``, issue 52: a damaged ``stages.json`` is one line naming the file and the field, and
its advice works; the ``edgeprune build`` / ``bench`` lines of a deploy stopped before ``build`` are in
report.md and report.json; refused settings leave no folder (and an earlier deploy as it was); a redone
stage says why; each rule of the resume record (``cli/deploy_state.py``) and each column of the
per-model memory table (``runners/memory.py``, ``runners/memory_child.py``) has a test that fails
without it.

One deploy of fmnist-vit (32 calibration images, 64 evaluation images, --sparsity 0.5, fp32, no bench)
is made once per module; the tests work on copies of its folder. The resume-rule and memory tests
work on small files and records of their own (no model).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgeprune.deploy.report import report_data, report_markdown
from edgeprune.deploy.state import DeployState, hash_paths, hash_settings
from edgeprune.errors import UserError
from runners.memory import memory_markdown, probe_memory
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli
from tests.test_deploy import _copy, _stages
from tests.test_deploy_more import _matmul_onnx as _onnx

FAST = ["--model", "fmnist-vit", "--calib-size", "32", "--eval-size", "64", "--bench-iterations", "2"]
FP32 = FAST + ["--sparsity", "0.5", "--precision", "fp32", "--device", "cpu", "--no-bench"]


def _mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deploy52") / "out"
    r = run_cli(["deploy", *FP32, "--quiet", "-o", out])
    assert r.exit_code == 0, r.output
    return out


# -- case 1: stages.json is checked like the other records -------------------------------------------------

_DONE = {"status": "done", "settings": "a" * 64, "inputs": "b" * 64, "outputs": {"run": "c" * 64}, "seconds": 1.0}


@pytest.mark.parametrize("stages, field", [
    ({"prune": "done"}, "'stages.prune' must be an object, got \"done\""),
    ({"prune": {**_DONE, "status": "finished"}}, "'stages.prune.status' must be one of"),
    ({"prune": {**_DONE, "seconds": "x"}}, "'stages.prune.seconds' must be a finite number >= 0"),
    ({"prune": {**_DONE, "outputs": ["run"]}}, "'stages.prune.outputs' must be an object"),
    ({"prune": {**_DONE, "outputs": {"../../elsewhere": "c" * 64}}}, "'stages.prune.outputs' must name files inside"),
    ({"prune": {k: v for k, v in _DONE.items() if k != "outputs"}}, "'stages.prune.outputs' is missing"),
    ({"polish": {"status": "skipped"}}, "'stages.polish' is not a deploy stage"),
    (["prune"], "'stages' must be an object"),
])
def test_a_damaged_stage_entry_is_one_line_naming_the_file_and_the_field(stages, field, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stages.json").write_text(json.dumps({"version": 1, "stages": stages}))
    r = run_cli(["deploy", *FP32, "--quiet", "-o", out])  # the fast settings: a deploy that runs anyway is quick
    assert_one_line_error(r, f"{out / 'stages.json'}: field {field}")
    assert f"remove {out / 'stages.json'} and rerun" in r.stderr


@pytest.mark.parametrize("text", ["{not json", "null", "[1, 2]", '{"stages": {}, "version": 7}'])
def test_a_stages_json_that_is_not_a_record_is_one_line(text, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stages.json").write_text(text)
    r = run_cli(["deploy", *FP32, "--quiet", "-o", out])
    assert_one_line_error(r, f"{out / 'stages.json'}")
    assert f"remove {out / 'stages.json'} and rerun" in r.stderr


def test_what_the_state_records_loads_back(tmp_path):
    """The schema accepts every entry deploy writes (done with values and per-input hashes, skipped, pending)."""
    state = DeployState(tmp_path)
    state.record("prune", {**_DONE, "values": {"sparsity": 0.5}, "input_hashes": {"--calib": "d" * 64},
                           "what": "prune", "redone": "settings changed"})
    state.record("build", {"status": "pending", "why": "left to do", "command": "edgeprune build x"})
    state.record("heal", {"status": "skipped", "why": "not asked"})
    assert DeployState(tmp_path).stages == state.stages


# -- case 2: the advice of the damaged-record line works ---------------------------------------------------

@needs_fmnist
def test_following_the_advice_for_a_damaged_stages_json_gives_a_deploy_that_runs(deployed, tmp_path):
    out = _copy(deployed, tmp_path)
    state = json.loads((out / "stages.json").read_text())
    state["stages"]["prune"] = "done"
    (out / "stages.json").write_text(json.dumps(state))
    r = run_cli(["deploy", *FP32, "--quiet", "-o", out])
    assert_one_line_error(r, "field 'stages.prune'")
    advice = re.search(r"remove (\S+) and rerun", r.stderr)
    assert advice, r.stderr
    Path(advice.group(1)).unlink()  # what the line says to do, literally
    r = run_cli(["deploy", *FP32, "-o", out])
    assert r.exit_code == 0, r.output
    assert "its files are a deploy's: every stage is redone" in r.stderr
    assert "unchanged, reused" not in r.stdout and "== prune: prune fmnist-vit" in r.stdout
    assert {n: e["status"] for n, e in _stages(out).items()}["verify"] == "done"
    r = run_cli(["deploy", *FP32, "--quiet", "-o", out])
    assert r.exit_code == 0 and r.stdout.count("unchanged, reused") == 3  # prune, export, verify


def test_a_folder_without_stages_json_is_a_deploys_only_by_its_files(tmp_path):
    from edgeprune.deploy.state import is_deploy_folder

    d = tmp_path / "d"
    (d / "run").mkdir(parents=True)
    (d / "run" / "run.json").write_text("{}")
    (d / "model.onnx").write_text("x")
    (d / "report.md").write_text("x")
    assert is_deploy_folder(d)
    (d / "notes.txt").write_text("mine")  # a user's file: not a deploy folder
    assert not is_deploy_folder(d)
    assert_one_line_error(run_cli(["deploy", *FP32, "--quiet", "-o", d]), "not a deploy folder")
    (d / "notes.txt").unlink()
    shutil.rmtree(d / "run")  # no prune record: only names a deploy writes, but nothing says it was one
    assert not is_deploy_folder(d)
    assert_one_line_error(run_cli(["deploy", *FP32, "--quiet", "-o", d]), "not a deploy folder")
    assert sorted(os.listdir(d)) == ["model.onnx", "report.md"]


# -- case 3: the device lines are in the report ------------------------------------------------------------

@needs_fmnist
def test_a_deploy_stopped_before_build_has_the_build_and_bench_lines_in_its_report(deployed, tmp_path, monkeypatch):
    import edgeprune.deploy.plan as deploy_mod

    monkeypatch.setattr(deploy_mod, "backend_available", lambda name: "tensorrt is not installed")
    out = _copy(deployed, tmp_path)
    args = FAST + ["--sparsity", "0.5", "--device", "orin-nx", "--torch-device", "cpu", "--quiet"]
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 0, r.output
    build = f"edgeprune build {out / 'model-fp16.onnx'} --device orin-nx -o {out / 'model.engine'}"
    bench = (f"edgeprune bench {out / 'model.engine'} --vs {out / 'dense.onnx'} --device orin-nx --iterations 2 "
             f"--json {out / 'bench.json'} --markdown {out / 'bench.md'}")
    last = r.stdout.strip().splitlines()[-1]
    assert build in last and bench in last  # the terminal's line
    rep = json.loads((out / "report.json").read_text())
    assert rep["left"] == ["build", "bench"] and rep["on_device"] == [build, bench]
    assert {s["stage"]: s.get("command") for s in rep["stages"] if s["status"] == "pending"} == {
        "build": build, "bench": bench}
    md = (out / "report.md").read_text()
    assert f"\n{build}\n{bench}\n" in md and "line below" not in md and "line deploy printed" not in md
    assert _stages(out)["bench"]["command"] == bench
    r = run_cli(["deploy", *args, "--no-bench", "-o", out])  # no bench asked: only the build is left
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "report.json").read_text())
    assert rep["left"] == ["build"] and rep["on_device"] == [build]
    assert _stages(out)["bench"] == {"status": "skipped", "why": "--no-bench"}


# -- case 4: refused settings leave no folder --------------------------------------------------------------

@needs_fmnist
@pytest.mark.parametrize("args, pattern", [
    (["--sparsity", "1"], "sparsity must be in [0, 1)"),
    (["--latency", "0.5"], "--latency needs a latency table"),
    (["--flops", "0"], "--flops must be > 0"),
    (["--params", "2G"], "above the dense model"),
])
def test_refused_settings_leave_no_folder(args, pattern, tmp_path):
    out = tmp_path / "a" / "b" / "out"
    r = run_cli(["deploy", *FAST, "--quiet", "--device", "cpu", "--no-bench", *args, "-o", out])
    assert_one_line_error(r, pattern)
    assert os.listdir(tmp_path) == []  # not out, nor the folders made for it
    mine = tmp_path / "mine"
    mine.mkdir()  # the user's own empty folder: kept, and left empty
    assert_one_line_error(run_cli(["deploy", *FAST, "--quiet", "--device", "cpu", *args, "-o", mine]), pattern)
    assert mine.is_dir() and os.listdir(mine) == []


@needs_fmnist
def test_refused_settings_leave_an_earlier_deploy_as_it_was(deployed, tmp_path):
    out = _copy(deployed, tmp_path)
    before, record = _mtimes(out), (out / "stages.json").read_bytes()
    r = run_cli(["deploy", *[a if a != "0.5" else "1" for a in FP32], "--quiet", "-o", out])
    assert_one_line_error(r, "sparsity must be in [0, 1)")
    assert _mtimes(out) == before and (out / "stages.json").read_bytes() == record  # run/ is still there
    r = run_cli(["deploy", *FP32, "--quiet", "-o", out])
    assert r.exit_code == 0 and r.stdout.count("unchanged, reused") == 3


# -- case 5: a redone stage says why -----------------------------------------------------------------------

@needs_fmnist
def test_a_redone_stage_says_why(deployed, tmp_path):
    out = _copy(deployed, tmp_path)
    (out / "dense.onnx").unlink()  # export redone; its model.onnx is the same bytes: verify is redone as the later stage
    r = run_cli(["deploy", *FP32, "-o", out])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert "export: redone (output missing: dense.onnx)" in lines
    assert "verify: redone (an earlier stage was redone (export))" in lines
    assert r.stdout.count("unchanged, reused") == 1 and "prune: redone" not in r.stderr
    assert _stages(out)["export"]["redone"] == "output missing: dense.onnx"
    verify = json.loads((out / "verify.json").read_text())
    (out / "verify.json").write_text(json.dumps({**verify, "passed": True, "max_abs_diff": 0.0}))
    r = run_cli(["deploy", *FP32, "--quiet", "-o", out])  # --quiet: redone all the same, nothing on stderr
    assert r.exit_code == 0, r.output
    assert r.stdout.count("unchanged, reused") == 2 and "redone" not in r.stderr
    assert _stages(out)["verify"]["redone"] == "output changed or damaged: verify.json"
    assert "(redone: output changed or damaged: verify.json)" in (out / "report.md").read_text()


def test_the_reason_names_the_changed_settings_and_inputs(tmp_path):
    from edgeprune.deploy.state import settings_change

    assert settings_change({"sparsity": 0.3, "calib_size": 32}, {"sparsity": 0.5, "calib_size": 32}) == (
        "settings changed: sparsity 0.3 -> 0.5")
    assert settings_change({"precision": "int8"}, {"precision": "fp16", "mode": "static"}) == (
        "settings changed: mode none -> static, precision int8 -> fp16")
    assert settings_change({"profile": {"bench": {"iterations": 50}}}, {"profile": {"bench": {"iterations": 20}}}) == (
        "settings changed: profile.bench.iterations 50 -> 20")
    assert settings_change(None, {"sparsity": 0.5}) == "settings changed"  # an older record: no values kept
    many = settings_change({f"k{i}": 0 for i in range(5)}, {f"k{i}": 1 for i in range(5)})
    assert many.endswith("and 2 more") and many.count("->") == 3
    state = _state_with(tmp_path, "export", inputs={"run/": "run-v1", "--calib": "c"})
    assert state.stale("export", hash_settings(SETTINGS), hash_paths(["run-v2"]),
                       input_hashes=lambda: {"run/": hash_paths(["run-v2"]), "--calib": hash_paths(["c"])}) == (
        "input changed: run/")


# -- case 6: each rule of the resume record ----------------------------------------------------------------

SETTINGS = {"sparsity": 0.5}


def _state_with(tmp_path: Path, name: str = "export", inputs: dict | None = None, outputs=("model.onnx",)):
    """A deploy folder with stage ``name`` done: settings SETTINGS, the given input paths, outputs written."""
    for o in outputs:
        if not (tmp_path / o).exists():
            (tmp_path / o).write_text(f"{o} v1")
    inputs = inputs or {"run/": "run-v1"}
    state = DeployState(tmp_path)
    state.record(name, {"status": "done", "settings": hash_settings(SETTINGS), "values": SETTINGS,
                        "inputs": hash_paths(list(inputs.values())),
                        "input_hashes": {k: hash_paths([v]) for k, v in inputs.items()},
                        "outputs": state.outputs_hash(list(outputs)), "seconds": 1.0})
    return DeployState(tmp_path)  # as a rerun loads it


def _same(name: str = "export", inputs=("run-v1",)):
    return name, hash_settings(SETTINGS), hash_paths(list(inputs))


def test_rule_an_unchanged_stage_is_reused(tmp_path):
    state = _state_with(tmp_path)
    assert state.stale(*_same()) is None and state.reusable(*_same())


def test_rule_changed_settings_redo_the_stage(tmp_path):
    state = _state_with(tmp_path)
    _, _, inputs = _same()
    assert state.stale("export", hash_settings({"sparsity": 0.6}), inputs, {"sparsity": 0.6}) == (
        "settings changed: sparsity 0.5 -> 0.6")
    assert not state.reusable("export", hash_settings({"sparsity": 0.6}), inputs)


def test_rule_changed_inputs_redo_the_stage(tmp_path):
    state = _state_with(tmp_path)
    name, settings, _ = _same()
    assert state.stale(name, settings, hash_paths(["run-v2"])) == "input changed"
    assert not state.reusable(name, settings, hash_paths(["run-v2"]))


def test_rule_a_missing_output_redoes_the_stage(tmp_path):
    state = _state_with(tmp_path, outputs=("model.onnx", "dense.onnx"))
    (tmp_path / "dense.onnx").unlink()
    assert state.stale(*_same()) == "output missing: dense.onnx" and not state.reusable(*_same())


def test_rule_a_changed_output_redoes_the_stage(tmp_path):
    state = _state_with(tmp_path, outputs=("model.onnx", "dense.onnx"))
    st = (tmp_path / "model.onnx").stat()
    (tmp_path / "model.onnx").write_text("model.onnx v2")  # same size, other bytes, the same time
    os.utime(tmp_path / "model.onnx", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert state.stale(*_same()) == "output changed or damaged: model.onnx" and not state.reusable(*_same())


def test_rule_a_changed_file_inside_an_output_folder_redoes_the_stage(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    state = _state_with(tmp_path, "prune", outputs=("run",))
    assert state.reusable(*_same("prune"))
    (tmp_path / "run" / "run.json").rename(tmp_path / "run" / "old.json")  # same bytes, another name
    assert state.stale(*_same("prune")) == "output changed or damaged: run"


@pytest.mark.parametrize("how", ["forget", "set_aside"])
def test_rule_a_redone_stage_redoes_every_later_one(how, tmp_path):
    state = _state_with(tmp_path, "export")
    state.record("verify", {**state.stages["export"], "outputs": state.outputs_hash(["model.onnx"])})
    state = DeployState(tmp_path)
    assert state.reusable(*_same("export")) and state.reusable(*_same("verify"))
    if how == "forget":
        state.forget("prune", ["run"])
    else:
        state.set_aside("prune", ["run"]).drop()
    for later in ("export", "verify"):
        assert state.stale(*_same(later)) == "an earlier stage was redone (prune)" and not state.reusable(*_same(later))


def test_forget_removes_the_earlier_outputs_and_those_about_to_be_written(tmp_path):
    state = _state_with(tmp_path, "quantize", outputs=("model-int8.onnx", "quantize.json"))
    (tmp_path / "model-fp16.onnx").write_text("left by an interrupted run")
    (tmp_path / "keep.txt").write_text("not the stage's")
    state.forget("quantize", ["model-fp16.onnx", "quantize.json"])
    assert sorted(os.listdir(tmp_path)) == ["keep.txt", "stages.json"]


def test_set_aside_puts_an_earlier_deploy_back_only_for_a_first_refused_stage(tmp_path):
    state = _state_with(tmp_path, "export", outputs=("model.onnx", "dense.onnx"))
    before = _mtimes(tmp_path)
    aside = state.set_aside("export", ["model.onnx", "dense.onnx"])
    assert not (tmp_path / "model.onnx").exists() and not (tmp_path / "dense.onnx").exists()
    assert aside.restore() and not state.redo_rest
    aside.drop()
    assert _mtimes(tmp_path) == before and state.reusable(*_same("export"))
    aside = state.set_aside("export", ["model.onnx", "dense.onnx"])  # the stage wrote one output: not put back
    (tmp_path / "model.onnx").write_text("new")
    assert not aside.restore()
    aside.drop()
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "stages.json"]
    state = _state_with(tmp_path, "verify", outputs=("verify.json",))
    state.forget("export")
    aside = state.set_aside("verify", ["verify.json"])  # an earlier stage was redone: the folder is no longer the old one
    assert not aside.restore()
    aside.drop()
    assert not (tmp_path / "verify.json").exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_hashes_cover_content_names_and_listings_not_places(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "w.bin").write_bytes(b"1234")
    h = hash_paths([a])
    shutil.copytree(a, tmp_path / "moved")
    assert hash_paths([tmp_path / "moved"]) == h  # a moved deploy folder is reused
    st = (a / "w.bin").stat()
    (a / "w.bin").write_bytes(b"1235")
    os.utime(a / "w.bin", ns=(st.st_atime_ns, st.st_mtime_ns))  # only the bytes differ
    assert hash_paths([a]) != h
    (a / "w.bin").rename(a / "x.bin")
    assert hash_paths([a]) != hash_paths([tmp_path / "moved"])
    assert hash_paths([None]) != hash_paths([a]) and hash_paths([a, None]) != hash_paths([None, a])
    listing = hash_paths([a], content=False)
    os.utime(a / "x.bin", ns=(1, 1))  # same bytes, another time: a data folder's listing changes
    assert hash_paths([a], content=False) != listing
    assert hash_settings({"a": 1, "b": 2}) == hash_settings({"b": 2, "a": 1}) != hash_settings({"a": 1, "b": 3})


def test_the_record_is_written_only_when_it_changes(tmp_path):
    state = _state_with(tmp_path)
    path = tmp_path / "stages.json"
    os.utime(path, ns=(1, 1))
    state.save()
    state.record("export", dict(state.stages["export"]))
    assert path.stat().st_mtime_ns == 1
    state.record("heal", {"status": "skipped", "why": "not asked"})
    assert path.stat().st_mtime_ns != 1 and DeployState(tmp_path).stages["heal"]["status"] == "skipped"


# -- case 6: each column of the per-model memory table -----------------------------------------------------

def _cells(table: str, row_start: str) -> dict[str, str]:
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    row = next(ln for ln in lines if ln.startswith(f"| {row_start} |"))
    return dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))


def test_memory_table_puts_each_value_in_its_column():
    memory = {"a": {"weights_mib": 1.25, "peak_rss_mib": 300.0, "baseline_rss_mib": 210.0, "device_peak_mib": 42.0},
              "b": {"weights_mib": None, "peak_rss_mib": 250.0, "baseline_rss_mib": 240.0},
              "c": {"error": "the memory probe failed: boom"}}
    table = memory_markdown(memory, {"a": "A = small.onnx", "b": "B = dense.onnx"})
    assert _cells(table, "A = small.onnx") == {"model": "A = small.onnx", "weights MiB": "1.2", "peak RSS MiB": "300.0",
                                               "RSS over the interpreter MiB": "90.0", "device peak MiB": "42.0"}
    assert _cells(table, "B = dense.onnx") == {"model": "B = dense.onnx", "weights MiB": "-", "peak RSS MiB": "250.0",
                                               "RSS over the interpreter MiB": "10.0", "device peak MiB": "-"}
    assert _cells(table, "c")["device peak MiB"] == "- (the memory probe failed: boom)"


def test_memory_probe_measures_each_target_in_its_own_child(tmp_path):
    """One probe: A's weights are its file and its external data; B (a target that is not there) loads
    the file given as its ``load_from`` (64 MiB of weights), its weights are those of the target given; C
    fails in one line. Each baseline is the interpreter's before the model loads: the same for A and B."""
    import dataclasses

    from devices import load_profile
    from runners.bench import BenchConfig

    a = _onnx(tmp_path / "a.onnx", 64, 256, external=True)
    b = _onnx(tmp_path / "b.onnx", 1024, 16384)  # 64 MiB
    cfg = dataclasses.asdict(BenchConfig(profile="cpu", batch_sizes=(1, 2), iterations=1, warmup=0))
    mem = probe_memory({"a": str(a), "b": str(tmp_path / "b.engine"), "c": str(tmp_path / "gone.onnx")}, cfg,
                       load_profile("cpu").to_dict(), load_from={"b": str(b)})
    size = a.stat().st_size + (tmp_path / "a.onnx.data").stat().st_size
    resettable = os.access("/proc/self/clear_refs", os.W_OK)  # the kernel's peak can be reset: the model's own window
    scope = "since the model started loading" if resettable else "process lifetime"
    assert (tmp_path / "a.onnx.data").stat().st_size >= 64 * 256 * 4
    assert mem["a"]["weights_mib"] == pytest.approx(size / 2**20) and mem["a"]["weights_source"] == "file"
    assert mem["b"]["weights_mib"] is None and mem["b"]["weights_source"] == "unknown"  # b.engine: not a file
    for m in (mem["a"], mem["b"]):
        assert m["peak_rss_mib"] >= m["baseline_rss_mib"] > 0 and "device_peak_mib" not in m  # a CPU backend
        assert m["peak_scope"] == scope
    assert abs(mem["a"]["baseline_rss_mib"] - mem["b"]["baseline_rss_mib"]) < 24  # before either model loaded
    own = {k: mem[k]["peak_rss_mib"] - mem[k]["baseline_rss_mib"] for k in "ab"}
    assert own["b"] > own["a"] + 32  # B's 64 MiB are in B's process only
    assert list(mem["c"]) == ["error"] and mem["c"]["error"].startswith("the memory probe failed: ")
    assert "gone.onnx" in mem["c"]["error"] and "\n" not in mem["c"]["error"]  # the child's last line


def test_memory_child_counts_a_torch_models_parameters_and_buffers():
    import torch

    from runners.memory_child import _weights

    bn = torch.nn.BatchNorm1d(4)  # 8 float32 parameters; 8 float32 + 1 int64 buffers
    assert _weights("fmnist-vit", SimpleNamespace(model=bn)) == ((8 * 4 + 8 * 4 + 8) / 2**20, "parameters")
    assert _weights("fmnist-vit", SimpleNamespace()) == (None, "unknown")


def test_memory_child_adds_external_data_only_to_an_onnx_file(tmp_path):
    from runners.memory_child import _weights

    (tmp_path / "m.onnx").write_bytes(b"x" * 1000)
    (tmp_path / "m.onnx.data").write_bytes(b"x" * 3000)
    (tmp_path / "m.engine").write_bytes(b"x" * 500)
    (tmp_path / "m.engine.data").write_bytes(b"x" * 7000)
    assert _weights(str(tmp_path / "m.onnx"), None) == (4000 / 2**20, "file")
    assert _weights(str(tmp_path / "m.engine"), None) == (500 / 2**20, "file")


def test_deploy_report_gives_each_role_its_own_models_memory(tmp_path):
    targets = {"a": {"target": str(tmp_path / "model-int8.onnx")}, "b": {"target": str(tmp_path / "dense.onnx")}}
    bench = {"targets": targets,
             "memory": {"a": {"weights_mib": 1.5, "peak_rss_mib": 260.0, "baseline_rss_mib": 200.0},
                        "b": {"weights_mib": 4.5, "peak_rss_mib": 290.0, "baseline_rss_mib": 205.0}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    o = {"model_name": "m", "budget": "sparsity", "sparsity": 0.5, "precision": "int8",
         "profile": SimpleNamespace(name="cpu", backend="onnxruntime")}
    data = report_data(tmp_path, DeployState(tmp_path), o)
    assert data["memory"]["deployed"]["model"] == "model-int8.onnx" and data["memory"]["dense"]["model"] == "dense.onnx"
    md = report_markdown(data, tmp_path)
    assert ("Memory of the deployed model (`model-int8.onnx`, in its own process): weights 1.50 MiB, peak RSS 260.0 "
            "MiB (60.0 MiB over the interpreter).") in md
    assert "Memory of the dense model (`dense.onnx`, in its own process): weights 4.50 MiB, peak RSS 290.0 MiB" in md


def test_the_state_refuses_what_it_cannot_resume_from(tmp_path):
    (tmp_path / "stages.json").write_text('{"version": 1, "stages": {"prune": {"status": "done"}}}')
    with pytest.raises(UserError, match="'stages.prune.settings' is missing"):
        DeployState(tmp_path)
