"""Bad input on recipes, devices and quantize's reuse of a run's data (issue 52): one line, exit 2, before the work;
a recipe replays exactly and never overwrites; output-derived paths follow ``-o``; advice that works.

The small runs are ``deit_tiny`` with one block at 32 pixels (seeded random weights as a user's checkpoint) on 4
images, and ``fmnist-vit`` on 16 calibration images (quantized dynamic int8 on 32 evaluation images); the latency
table is hand-made for the tiny shape and the "machine" that measures the latency runs is synthetic (a model's
FLOPs plus a per-call overhead, deterministic): no test times anything.
"""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

from edgeprune.cli.main import cli
from edgeprune.cli.recipe import recipe_text
from tests.conftest import FMNIST_DIR, assert_one_line_error, needs_fmnist, run_cli
from tests.test_bad_input import _checkpoint, _image_folder
from tests.test_bad_input_41 import MODEL, hand_table


def _recipe(tmp_path: Path, text: str, name: str = "r.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---- 1. a non-finite float for any key: one line naming the key (was a ValueError while building the message) --

NON_FINITE = [
    ("prune", "[data]\ncalib-size = inf\n", "[data] calib-size = inf"),
    ("prune", "[data]\ncalib-size = nan\n", "[data] calib-size = nan"),
    ("prune", "[data]\ncalib-size = -inf\n", "[data] calib-size = -inf"),
    ("prune", "[data]\nseed = inf\n", "[data] seed = inf"),
    ("prune", "[data]\nbatch-size = nan\n", "[data] batch-size = nan"),
    ("prune", "[model]\nnum-classes = -inf\n", "[model] num-classes = -inf"),
    ("prune", "[model]\nmodel-kwargs = {depth = inf}\n", "[model] model-kwargs = {depth = inf}"),
    ("prune", "[budget]\nlatency-rounds = nan\n", "[budget] latency-rounds = nan"),
    ("quantize", "[data]\ncalib-size = inf\n", "[data] calib-size = inf"),
    ("quantize", "[method]\nexclude = nan\n", "[method] exclude = nan"),
    ("quantize", "[method]\nauto-exclude = -inf\n", "[method] auto-exclude = -inf"),
    ("heal", "[method]\nepochs = inf\n", "[method] epochs = inf"),
    ("derive", "[method]\nskp-steps = nan\n", "[method] skp-steps = nan"),
    ("latency-table", "[runtime]\nthreads = inf\n", "[runtime] threads = inf"),
]


@pytest.mark.parametrize("command, text, pattern", NON_FINITE, ids=[f"{c}:{p}" for c, _, p in NON_FINITE])
def test_a_non_finite_value_of_any_key_is_one_line(tmp_path, command, text, pattern):
    """issue 52: ``calib-size = inf`` raised ValueError in recipe.py:_toml_value while the message was built."""
    r = _recipe(tmp_path, text)
    res = run_cli([command, "--config", r])
    assert_one_line_error(res, f"{pattern}: not a finite number")
    assert str(r) in res.stderr


# ---- 2. a latency run's recipe replays the kept round: the same weights, nothing measured -----------------------

def _synthetic_machine(offset_share: float, calls: list):
    """A ``table_measurer`` stand-in: the machine's time of a model is its FLOPs plus a per-call overhead of
    ``offset_share`` x the dense model's FLOPs (what the table does not see); counts its calls in ``calls``.
    Deterministic: the same pair always measures the same."""
    from edgeprune.anatomy import find_anatomy
    from edgeprune.flops import model_flops

    def measure(dense, pruned) -> dict:
        calls.append(1)
        d = float(model_flops(find_anatomy(dense))["total"])
        p = float(model_flops(find_anatomy(pruned))["total"])
        o = offset_share * d
        return {"dense_ms": (d + o) * 1e-6, "pruned_ms": (p + o) * 1e-6, "ratio": (p + o) / (d + o)}

    return lambda budget, anatomy, **kw: (measure, None)


def _latency_run(tmp_path: Path, offset_share: float, calls: list, monkeypatch, out: Path):
    """A ``--latency 0.45`` prune of the tiny model measured on the synthetic machine (``offset_share``)."""
    import edgeprune.budget.correction_loop as run_mod  # the one loop of prune and derive

    monkeypatch.setattr(run_mod, "table_measurer", _synthetic_machine(offset_share, calls))
    table = hand_table(tmp_path / "t.json")
    calib = tmp_path / "calib"
    if not calib.exists():
        _image_folder(calib)
    return run_cli(["prune", "--quiet", "--no-eval", *MODEL, "--checkpoint", _checkpoint(tmp_path), "--calib", calib,
                    "--calib-size", "4", "--latency", "0.45", "--latency-table", table, "--check-images", "2",
                    "--bias-correction", "0", "--torch-device", "cpu", "-o", out])


def test_a_latency_runs_recipe_replays_its_measurements_and_the_same_weights(tmp_path, monkeypatch):
    """issue 52: ``prune --config RUN/recipe.toml`` of a ``--latency`` run measured again and, on a machine whose
    timings had changed, kept another round (other weights) while the README promises "byte for byte". The run
    here is measured on a machine with a per-call overhead (round 0 misses, a correction round is kept); the
    replay runs on one without it: it must measure nothing, make the run's rounds and give the run's weights."""
    import edgeprune.budget.correction_loop as run_mod  # the one loop of prune and derive

    first, again = [], []
    a, b = tmp_path / "a", tmp_path / "b"
    res = _latency_run(tmp_path, 0.3, first, monkeypatch, a)
    assert res.exit_code == 0, res.output
    chk = json.loads((a / "run.json").read_text())["latency_check"]
    assert chk["chosen_round"] >= 1 and len(first) == len(chk["rounds"])  # the run kept a corrected round

    monkeypatch.setattr(run_mod, "table_measurer", _synthetic_machine(0.0, again))  # today's machine
    res = run_cli(["prune", "--config", a / "recipe.toml", "-o", b])
    assert res.exit_code == 0, res.output
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert again == []  # nothing measured: the replay cannot land elsewhere
    assert "replayed, nothing measured again" in res.output
    assert json.loads((b / "run.json").read_text())["latency_check"]["chosen_round"] == chk["chosen_round"]
    recipe = tomllib.loads((a / "recipe.toml").read_text())
    assert recipe["budget"]["latency"] == "0.45"  # what the run asked, as it asked it
    assert [r["budget-value"] for r in recipe["replay"]["latency"]] == [r["budget_value"] for r in chk["rounds"]]
    ra, rb = (tomllib.loads((d / "recipe.toml").read_text()) for d in (a, b))
    ra["output"].pop("out"), rb["output"].pop("out")
    assert ra == rb  # a replay of the replay is the same again



def test_a_replay_measures_again_when_asked_and_refuses_rounds_that_are_not_the_runs(tmp_path):
    """The recorded measurements are the file budget's: ``--verify-latency`` or a budget typed on the command line
    measures again (said in one line); a replay whose rounds differ from the run's (an option typed, other data, a
    changed table) is refused before anything is written."""
    from edgeprune.cli.recipe import ReplayMeasurer, replay_measurer
    from edgeprune.errors import UserError

    rounds = [{"budget-value": 0.45, "predicted": 0.449, "measured": {"dense_ms": 2.0, "pruned_ms": 1.1, "ratio": 0.55}},
              {"budget-value": 0.36, "predicted": 0.358, "measured": {"dense_ms": 2.0, "pruned_ms": 0.9, "ratio": 0.45}}]
    r = _recipe(tmp_path, '[budget]\nlatency = "0.45"\nlatency-table = "t.json"\n[replay]\nlatency = [\n'
                + "".join(f"  {{budget-value = {x['budget-value']}, predicted = {x['predicted']}, measured = "
                          f"{{dense_ms = 2.0, pruned_ms = {x['measured']['pruned_ms']}, ratio = {x['measured']['ratio']}}}}},\n"
                          for x in rounds) + "]\n")
    cmd = cli.commands["prune"]
    said: list[str] = []
    replay = replay_measurer(cmd.make_context("prune", ["--config", str(r)]), said.append)
    assert isinstance(replay, ReplayMeasurer) and said == []
    assert [replay(None, None)["ratio"], replay(None, None)["ratio"]] == [0.55, 0.45]  # in order, nothing timed
    with pytest.raises(UserError, match="the replay asks for round 2 of the latency correction, the run made 2"):
        replay(None, None)
    rec = {"latency_check": {"rounds": [{"budget_value": x["budget-value"], "predicted": x["predicted"]}
                                        for x in rounds], "chosen_round": 1}}
    assert "2 measurement(s) recorded in" in replay.check(rec) and "nothing measured" in rec["latency_check"]["replayed"]
    rec["latency_check"]["rounds"][1]["budget_value"] = 0.37
    with pytest.raises(UserError, match="round 1 of the replay asked the table for 0.37 .*, the run for 0.36"):
        replay.check(rec)
    for typed, why in ((["--verify-latency"], "--verify-latency"), (["--no-verify-latency"], "--no-verify-latency"),
                       (["--latency", "0.4"], "--latency"), (["--flops", "0.5"], "--flops")):
        said.clear()
        assert replay_measurer(cmd.make_context("prune", ["--config", str(r), *typed]), said.append) is None
        assert len(said) == 1 and f"are not used ({why} on the command line)" in said[0], said


def test_a_derive_latency_recipe_replays_its_measurements_too(tmp_path, monkeypatch):
    """The same kind for ``derive --latency`` (NuWa's measured correction, the tiny model on labeled random
    images): its recipe's replay on a machine whose timings changed measures nothing and gives the run's weights."""
    import edgeprune.budget.correction_loop as measured_mod
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for c in ("a", "b", "c"):
        (tmp_path / "train" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()).save(
                tmp_path / "train" / c / f"{i}.png")
    table = hand_table(tmp_path / "t.json")
    calls: dict[float, list] = {0.3: [], 0.0: []}
    for offset in (0.3, 0.0):  # the run's machine, then today's
        machine = _synthetic_machine(offset, calls[offset])
        monkeypatch.setattr(measured_mod, "table_measurer", lambda budget, anatomy, m=machine, **kw: m(budget, anatomy))
        if offset:
            res = run_cli(["derive", *MODEL, "--checkpoint", _checkpoint(tmp_path), "--train-data", tmp_path / "train",
                           "--classes", "0,1", "--latency", "0.6", "--latency-table", table, "--skp-steps", "0",
                           "--no-eval", "--no-cache", "--calib-size", "8", "--val-size", "6", "--quiet",
                           "-o", tmp_path / "a"])
        else:
            res = run_cli(["derive", "--config", tmp_path / "a" / "recipe.toml", "-o", tmp_path / "b"])
        assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "a" / "run.json").read_text())["latency_check"]["chosen_round"] >= 1
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert calls[0.0] == [] and "replayed, nothing measured again" in res.output


@pytest.mark.parametrize("text, pattern", [
    ("[replay]\nlatency = 3\n", "[replay] latency: wants a list"),
    ("[replay]\nlatency = [{budget-value = 0.5}]\n", "[replay] latency[0] = {budget-value = 0.5}: wants"),
    ("[replay]\nother = 1\n", "[replay] other: unknown key"),
    ("[replay]\nlatency = [{budget-value = nan, predicted = 1.0, measured = {}}]\n", "not a finite number"),
])
def test_a_damaged_replay_section_is_one_line(tmp_path, text, pattern):
    r = _recipe(tmp_path, text)
    assert_one_line_error(run_cli(["prune", "--config", r, "-o", tmp_path / "o"]), pattern)


def test_replay_rounds_and_the_tokens_choice_of_a_measured_run():
    """Nothing to replay for an unmeasured run; ``tokens-merge auto`` (candidates compared after their measured
    corrections) is replayed as the schedule it chose (the section holds that candidate's measurements)."""
    from edgeprune.cli.recipe import replay_rounds, tokens_choice

    assert replay_rounds({"latency_check": {"not_measured": "no backend", "measured": None}}) is None
    assert replay_rounds({}) is None
    rec = {"latency_check": {"rounds": [{"round": 0, "budget_value": 0.5, "predicted": 0.49, "measured_ms":
                                         {"dense_ms": 2.0, "pruned_ms": 1.2, "ratio": 0.6, "loaded": None}},
                                        {"round": 1, "budget_value": 0.41, "predicted": 0.4, "measured_ms":
                                         {"dense_ms": 2.0, "pruned_ms": 1.0, "ratio": 0.5}}], "chosen_round": 1},
           "tokens_auto": {"chosen": [2, 1, 0]}}
    rounds = replay_rounds(rec)
    assert [r["kept"] for r in rounds] == [False, True] and "loaded" not in rounds[0]["measured"]
    ctx = cli.commands["prune"].make_context("prune", ["--latency", "0.5", "--latency-table", "t.json",
                                                       "--tokens-merge", "auto"])
    values, notes = tokens_choice(ctx, rec)
    assert values == {"tokens-merge": "2,1,0"} and "chose 2,1,0" in notes["tokens-merge"]
    text = recipe_text(ctx, values, notes, rounds)
    data = tomllib.loads(text)
    assert data["tokens"]["tokens-merge"] == "2,1,0" and data["replay"]["latency"][1]["budget-value"] == 0.41
    assert tokens_choice(cli.commands["prune"].make_context("prune", ["--flops", "0.5"]), rec) == ({}, {})


# ---- 3. a recipe never records force (a deploy's quantize recipe said force = true) ---------------------------

@pytest.mark.parametrize("command", ["quantize", "latency-table"])
def test_a_recipe_never_records_force(command, tmp_path):
    args = {"quantize": ["m.onnx", "--precision", "int8", "-o", tmp_path / "q.onnx", "--force"],
            "latency-table": ["--model", "x", "-o", tmp_path / "t.json", "--force"]}[command]
    ctx = cli.commands[command].make_context(command, [str(a) for a in args])
    assert ctx.params["force"] is True
    text = recipe_text(ctx)
    data = tomllib.loads(text)
    assert all("force" not in section for section in data.values()), text
    assert "# force = (never recorded" in text
    r = _recipe(tmp_path, "[output]\nforce = true\n")  # an older edgeprune's recipe: refused, not obeyed
    assert_one_line_error(run_cli([command, "--config", r]), "[output] force = true: a recipe never overwrites")


@pytest.fixture(scope="module")
def fm_export(tmp_path_factory) -> Path:
    """The dense fmnist-vit exported (``edgeprune export --model fmnist-vit``)."""
    if not (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST not installed")
    path = tmp_path_factory.mktemp("fm52") / "dense.onnx"
    res = run_cli(["export", "--model", "fmnist-vit", "-o", path])
    assert res.exit_code == 0, res.output
    return path


def _deploy_like_quantize(fm_export: Path, folder: Path) -> tuple[Path, Path, dict]:
    """A quantize as ``deploy`` runs it: ``--force``, the report as ``FOLDER/quantize.json`` beside
    ``FOLDER/model-int8.onnx``. Returns (output, report, {file: bytes} of the three files)."""
    folder.mkdir()
    out, report = folder / "model-int8.onnx", folder / "quantize.json"
    res = run_cli(["quantize", fm_export, "--precision", "int8", "--mode", "dynamic", "--eval-size", "32",
                   "--threads", "1", "--force", "-o", out, "--json", report])
    assert res.exit_code == 0, res.output
    files = {p: p.read_bytes() for p in (out, report, out.with_name(out.name + ".recipe.toml"))}
    return out, report, files


@needs_fmnist
def test_replaying_a_forced_quantize_recipe_in_place_overwrites_nothing(fm_export, tmp_path):
    """issue 52: the quantize recipe ``deploy`` wrote held ``force = true``: its replay without ``-o`` rewrote the
    deploy's model-int8.onnx, recipe and quantize.json in place."""
    out, report, files = _deploy_like_quantize(fm_export, tmp_path / "deploy")
    res = run_cli(["quantize", "--config", out.with_name(out.name + ".recipe.toml")])
    assert res.exit_code == 2 and "exists (use --force" in res.stderr, res.output
    assert {p: p.read_bytes() for p in files} == files


# ---- 4. output-derived paths follow -o ---------------------------------------------------------------------

@needs_fmnist
def test_a_replay_with_another_output_moves_its_report_too(fm_export, tmp_path):
    """issue 52: ``quantize --config DEPLOY/model-int8.onnx.recipe.toml -o NEW.onnx`` wrote NEW.onnx but replayed
    the recipe's ``json`` path: the deploy's quantize.json then described another file."""
    out, report, files = _deploy_like_quantize(fm_export, tmp_path / "deploy")
    new = tmp_path / "new" / "other.onnx"
    res = run_cli(["quantize", "--config", out.with_name(out.name + ".recipe.toml"), "-o", new])
    assert res.exit_code == 0, res.output
    assert {p: p.read_bytes() for p in files} == files  # the deploy's files as they were
    moved = new.with_name("other.json")
    assert json.loads(moved.read_text())["output"] == str(new) and f"--json {moved}" in res.stdout
    recipe = tomllib.loads(new.with_name("other.onnx.recipe.toml").read_text())
    assert recipe["output"]["json"] == str(moved) and recipe["output"]["output"] == str(new)
    same_folder = out.with_name("again.onnx")  # beside the old output: a new name, never the old report
    res = run_cli(["quantize", "--config", out.with_name(out.name + ".recipe.toml"), "-o", same_folder])
    assert res.exit_code == 0, res.output
    assert same_folder.with_name("again.json").is_file() and report.read_bytes() == files[report]


# ---- 5. a CUDA device on a CPU box: the advice names --torch-device ---------------------------------------

@pytest.mark.parametrize("args", [["prune", "--torch-device", "cuda"], ["prune", "--device", "cuda"],
                                  ["deploy", "--device", "cpu", "--sparsity", "0.3", "--torch-device", "cuda"],
                                  ["heal", "RUN", "--torch-device", "cuda"], ["eval", "--torch-device", "cuda:0"]],
                         ids=["prune-torch-device", "prune-old-device", "deploy", "heal", "eval"])
def test_cuda_on_a_cpu_box_advises_torch_device_cpu(tmp_path, monkeypatch, args):
    """issue 52: ``--torch-device cuda`` on a CPU box said "use --device cpu" (``--device`` is the deployment
    profile in every command; after the warning's "use --torch-device cuda" it contradicted it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [str(tmp_path) if a == "RUN" else a for a in args]
    res = run_cli([*args, *(["-o", tmp_path / "o"] if args[0] != "eval" else [])])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines()[-1] == "error: CUDA is not available (use --torch-device cpu)"
    assert "--device cpu" not in res.stderr and not (tmp_path / "o").exists()


def test_library_messages_name_the_torch_device_option(monkeypatch):
    """The calibration pass and torchrun's check give the same advice (no "--device" for a torch device)."""
    from edgeprune.errors import UserError
    from edgeprune.torch_device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"use --torch-device cpu\)$"):
        resolve_device("cuda:1")
    src = (Path(__file__).resolve().parents[1] / "edgeprune").rglob("*.py")
    offenders = [f"{p.name}:{n}" for p in src for n, line in enumerate(p.read_text().splitlines(), 1)
                 if "Error(" in line and ("use --device cpu" in line or "give --device cuda" in line)]
    assert offenders == []


# ---- 6. a recorded calibration folder that is gone: refused, unless it held the built-in data ---------------

@pytest.fixture(scope="module")
def fm_run(tmp_path_factory) -> tuple[Path, Path]:
    """fmnist-vit pruned on 16 images of a copy of the built-in Fashion-MNIST folder: (run, folder)."""
    if not (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST not installed")
    root = tmp_path_factory.mktemp("fm52run")
    shutil.copytree(FMNIST_DIR, root / "copy")
    res = run_cli(["prune", "--calib", root / "copy", "--calib-size", "16", "--sparsity", "0.25", "--no-eval",
                   "--quiet", "--torch-device", "cpu", "-o", root / "run"])
    assert res.exit_code == 0, res.output
    return root / "run", root / "copy"


def _without(fm_run: tuple[Path, Path], tmp_path: Path, other_files: bool) -> tuple[Path, Path]:
    """A copy of the run whose calibration folder was moved away; ``other_files``: the folder held other files
    than the built-in one (its recorded content hash is another)."""
    run = fm_run[0]
    gone = tmp_path / "moved-away"
    shutil.copytree(run, tmp_path / "run")
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    rec["calibration"]["folder"] = str(gone.resolve())
    if other_files:
        rec["calibration"]["folder_sha256"] = "0" * 64
    (tmp_path / "run" / "run.json").write_text(json.dumps(rec))
    return tmp_path / "run", gone


@needs_fmnist
def test_a_gone_calibration_folder_is_refused_not_replaced_by_the_builtin_data(fm_run, tmp_path):
    """issue 52: ``quantize RUN`` whose recorded folder was moved said "is gone (pass --calib DIR)", then
    calibrated on the built-in Fashion-MNIST and exited 0 without saying so. A folder that held other files than
    the built-in one: quantize, eval and heal refuse in one line, before any work."""
    run, gone = _without(fm_run, tmp_path, other_files=True)
    for args, option in ((["quantize", run, "--precision", "int8", "-o", tmp_path / "q.onnx"], "--calib DIR"),
                         (["eval", run], "--eval-data DIR"),
                         (["heal", run, "--epochs", "1", "--torch-device", "cpu", "-o", tmp_path / "h"], "--calib DIR")):
        res = run_cli(args)
        assert_one_line_error(res, f"the run's calibration folder {gone} is gone (moved or deleted): pass {option}")
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "h").exists()


@needs_fmnist
def test_a_gone_copy_of_the_builtin_data_uses_the_builtin_folder_and_says_so(fm_run, tmp_path):
    """The run's data *was* the built-in data (its folder had the built-in folder's content hash): the built-in
    folder is the same data, used and said in one line."""
    run, gone = _without(fm_run, tmp_path, other_files=False)
    res = run_cli(["quantize", run, "--precision", "fp16", "--eval-size", "32", "--threads", "1",
                   "-o", tmp_path / "h.onnx"])
    assert res.exit_code == 0, res.output
    said = [ln for ln in res.output.splitlines() if str(gone) in ln]
    assert len(said) == 1 and "same content hash" in said[0] and str(FMNIST_DIR) in said[0]


# ---- 7. --exclude of every node --------------------------------------------------------------------------

@needs_fmnist
@pytest.mark.parametrize("args, pattern", [
    (["--precision", "int8", "--mode", "dynamic", "--exclude", "*"],
     "--exclude '*' matches every quantizable node ("),
    (["--precision", "int8", "--recipe", "ort", "--calib-size", "8", "--exclude", "*MatMul*", "--exclude", "*Gemm*",
      "--exclude", "*"], "together match every quantizable node ("),
    (["--precision", "int8", "--recipe", "tensorrt", "--calib-size", "8", "--exclude", "*"],
     "--exclude '*' matches every quantizable node ("),
    (["--precision", "fp16", "--exclude", "*"], "--exclude '*' matches every node ("),
], ids=["dynamic", "ort-static-patterns", "tensorrt", "fp16"])
def test_excluding_every_node_is_one_line(fm_export, tmp_path, args, pattern):
    """issue 52: ``--exclude '*'`` said "--auto-exclude 0 would keep all 0 quantizable nodes in float ... give
    --auto-exclude below 0"; fp16 wrote the float model as "fp16"."""
    res = run_cli(["quantize", fm_export, *args, "--eval-size", "32", "-o", tmp_path / "q.onnx"])
    assert_one_line_error(res, pattern)
    assert "nothing would be" in res.stderr and "auto-exclude" not in res.stderr
    assert not (tmp_path / "q.onnx").exists()


# ---- 8. quantize reuses the run's recorded evaluation folder before refusing --------------------------------

@pytest.fixture(scope="module")
def whole_folder_run(tmp_path_factory) -> dict:
    """A tiny timm run calibrated on every image of its folder (4 of 4), evaluated on another folder."""
    tmp = tmp_path_factory.mktemp("whole52")
    calib, evald = _image_folder(tmp / "calib", n=4), _image_folder(tmp / "evald", n=3)
    res = run_cli(["prune", "--quiet", *MODEL, "--checkpoint", _checkpoint(tmp), "--calib", calib, "--calib-size",
                   "4", "--eval-data", evald, "--target", "mlp", "--sparsity", "0.5", "--torch-device", "cpu",
                   "-o", tmp / "run"])
    assert res.exit_code == 0, res.output
    return {"run": tmp / "run", "calib": calib, "eval": evald}


def test_quantize_reuses_the_runs_evaluation_folder(whole_folder_run, tmp_path):
    """issue 52: ``quantize RUN --precision int8`` of a timm run whose prune used all images of its calibration
    folder (and was given --eval-data) stopped with "no held-out images"."""
    run, evald = whole_folder_run["run"], whole_folder_run["eval"]
    out = tmp_path / "q.onnx"
    res = run_cli(["quantize", run, "--precision", "int8", "--recipe", "ort", "--threads", "1", "-o", out,
                   "--json", tmp_path / "q.json"])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "run.json").read_text())["calibration"]["eval_folder"] == str(evald.resolve())
    assert f"evaluation: the run's folder {evald.resolve()}" in res.stdout
    rep = json.loads((tmp_path / "q.json").read_text())
    assert rep["n"] == 3 and str(evald.resolve()) in rep["eval_source"]
    assert tomllib.loads((tmp_path / "q.onnx.recipe.toml").read_text())["data"]["eval-data"] == str(evald.resolve())


def test_eval_and_heal_reuse_the_runs_evaluation_folder_and_quantize_refuses_without_one(whole_folder_run, tmp_path):
    """The same kind: ``eval RUN`` and ``heal RUN`` evaluate on the run's own --eval-data (heal said "pass
    --eval-data DIR"); a run that recorded none still gets the one-line "no held-out images"."""
    run, evald = whole_folder_run["run"], whole_folder_run["eval"]
    res = run_cli(["eval", run])
    assert res.exit_code == 0, res.output
    assert f"evaluation: the run's folder {evald.resolve()}" in res.stdout and "3 images" in res.stdout
    res = run_cli(["heal", run, "--epochs", "1", "--quiet", "--torch-device", "cpu", "-o", tmp_path / "healed"])
    assert res.exit_code == 0, res.output
    assert f"evaluation: the run's folder {evald.resolve()}" in res.stdout
    assert tomllib.loads((tmp_path / "healed" / "recipe.toml").read_text())["data"]["eval-data"] == str(evald.resolve())
    shutil.rmtree(tmp_path / "healed")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    rec = json.loads((copy / "run.json").read_text())
    del rec["calibration"]["eval_folder"]  # a run of an older edgeprune: the refusal names both ways out
    (copy / "run.json").write_text(json.dumps(rec))
    assert_one_line_error(run_cli(["quantize", copy, "--precision", "int8", "-o", tmp_path / "q.onnx"]),
                          "no held-out images: the calibration uses all 4 images")
    assert os.listdir(tmp_path) == ["run"]
