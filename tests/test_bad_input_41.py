"""Bad input on the latency and embed features (issue 41): Ctrl-C at any moment, damaged latency
tables and run records (one schema check per file kind, where it is loaded), non-finite float
options, settings that would be silently ignored, misleading messages.

The small runs are ``deit_tiny`` with one block at 32 pixels (seeded random weights as a user's
checkpoint) on 4 images; the latency tables are hand-made for that shape (no timing).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest

from edgeprune.artifact import read_record
from edgeprune.errors import UserError
from edgeprune.latency.table import LatencyTable
from edgeprune.record_schema import RECORD_SCHEMA
from edgeprune.schema import Bool, Int, ListOf, MapOf, Num, Obj, OneOf, Req
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli
from tests.test_bad_input import TINY, _checkpoint, _image_folder

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"embed_dim": 192, "depth": 1, "num_heads": 3, "head_dim": 64, "mlp_hidden": 768, "tokens": 5}
MODEL = ["--model", TINY, "--img-size", "32", "--model-kwargs", "depth=1"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def hand_table(path: Path, **damage) -> str:
    """A complete table of the tiny model's shape on this CPU (``onnxruntime``, batch 8), times
    ``0.1 + dims x 0.001`` ms, saved as JSON; ``damage``: dotted field -> value written instead."""
    from edgeprune.latency.measure import cpu_name

    key = {**SHAPE, "batch": 8, "precision": "fp32", "backend": "onnxruntime", "backend_version": "0",
           "device_name": cpu_name(), "profile": "cpu", "threads": 1}
    heads, dims, widths = [1, 2, 3], [16, 32, 48, 64], [0, 192, 384, 576, 768]
    ms = [[[0.1 + 0.001 * h * (q + v) for v in dims] for q in dims] for h in heads]
    t = LatencyTable(key=key, rules={"mlp_round_to": 8, "head_dim_round_to": 16, "qk_equals_v": False},
                     mlp={"widths": widths, "ms": [0.1 + 0.001 * w for w in widths]},
                     attn={"heads": heads, "qk": dims, "v": dims, "ms": ms}, fixed_ms=0.5, dense_model_ms=1.0,
                     measured={"mlp": widths, "attn": [[h, q, v] for h in heads for q in dims for v in dims],
                               "model": True}, meta={"complete": True})
    t.dense_model_ms = t.dense_ms()
    d = t.to_dict()
    for field, value in damage.items():
        _set(d, field, value)
    Path(path).write_text(json.dumps(d))
    return str(path)


def _tokens(field: str) -> list:
    out = []
    for part in field.replace("[", ".[").split("."):
        if part.startswith("["):
            out.append(int(part[1:-1]))
        elif part:
            out.append(part)
    return out


def _set(d, field, value) -> None:
    """Set (or delete) ``field``: a dotted path, or its list of keys (keys that contain dots)."""
    *parents, last = field if isinstance(field, list) else _tokens(field)
    for p in parents:
        d = d[p]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value


_DELETE = object()


# ---- Ctrl-C at any moment: one line, exit 130 -----------------------------------------------------


def test_import_edgeprune_is_light_and_the_public_names_still_work():
    """issue 41: the console script imported torch/timm through edgeprune/__init__.py before the CLI
    could handle Ctrl-C. Now ``import edgeprune`` and ``edgeprune.cli`` import no torch; the public
    names load on first use; ``import timm`` after ``import edgeprune`` still works (the torchvision
    workaround is an import hook)."""
    code = ("import sys, edgeprune, edgeprune.cli; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'edgeprune.cli.main' not in sys.modules; import timm; "
            "assert callable(edgeprune.prune) and edgeprune.UserError.exit_code == 2; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def _sigint_default() -> None:
    """The child's Ctrl-C as an interactive terminal gives it (``SIG_DFL``), whatever the test
    process inherited: a suite started in the background of a non-interactive shell ignores SIGINT,
    and its children with it (the lost-interrupt flake of the loaded runs, issue 43)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


#: the points a prune reports (edgeprune/phases.py) at which a Ctrl-C is sent, and what follows: before ``done`` the
#: command is interrupted (one line, exit 130, nothing written); at ``done`` it is over and ignores the interrupt
PHASES = ["start", "imported", "checked", "stage corp", "stage output_correction", "saving", "done"]


def _interrupted_run(tmp_path: Path, phase: str, start=_sigint_default) -> tuple[int, str, list[str]]:
    """A prune that reports its points (``EDGEPRUNE_PHASES`` with a handshake) and gets SIGINT while it stands at
    ``phase``, whatever the machine's speed or load: (exit status, stderr, the points it reported)."""
    calib = tmp_path / "calib"
    if not calib.exists():
        _image_folder(calib)
    out = tmp_path / f"run-{phase.replace(' ', '-')}"
    shutil.rmtree(out, ignore_errors=True)
    report_r, report_w = os.pipe()
    ack_r, ack_w = os.pipe()
    env = {**_env(), "EDGEPRUNE_PHASES": f"{report_w}:{ack_r}"}
    p = subprocess.Popen([sys.executable, "-m", "edgeprune.cli", "prune", "--quiet", "--no-eval", *MODEL,
                          "--checkpoint", _checkpoint(tmp_path), "--calib", calib, "--calib-size", "4",
                          "--target", "mlp", "-o", out], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=start, pass_fds=(report_w, ack_r))
    os.close(report_w)
    os.close(ack_r)
    seen: list[str] = []
    try:
        with os.fdopen(report_r, "r") as reports:
            for line in reports:  # ends when the child closed the descriptor (it exited)
                seen.append(line.strip())
                if seen[-1] == phase:
                    p.send_signal(signal.SIGINT)  # the child waits at this point for the byte below
                    os.close(ack_w)  # from here on it runs free (end of file), so a lost interrupt shows
                    ack_w = -1
                elif ack_w >= 0:
                    os.write(ack_w, b"\n")
        _, err = p.communicate(timeout=300)
    finally:
        if ack_w >= 0:
            os.close(ack_w)
        if p.poll() is None:
            p.kill()
    return p.returncode, err, seen


@pytest.mark.parametrize("phase", PHASES)
def test_ctrl_c_at_any_point_is_one_line_exit_130(tmp_path, phase):
    """issue 41: Ctrl-C in the first 0.3-2 s of prune gave exit 130 with a 14-74 line traceback
    (two chained ones at 2 s); an interrupt inside a compiled module's import could also be lost
    (the prune ran to the end) or become an ImportError traceback. Issue 52: the interrupt is sent
    at the points the program reports (edgeprune/phases.py), not after a delay that a loaded machine
    moves (0.1 s had landed in CPython's own start-up, which no program code can reach)."""
    code, err, seen = _interrupted_run(tmp_path, phase)
    assert phase in seen, f"the prune never reported {phase!r} (it reported {seen}); exit {code}: {err[-2000:]}"
    out = tmp_path / f"run-{phase.replace(' ', '-')}"
    if phase == "done":  # the command was over: the interrupt is ignored while the process exits
        assert code == 0 and err.strip() == "", f"exit {code}: {err[-3000:]}"
        assert (out / "run.json").is_file()
        return
    assert code == 130, f"exit {code}: {err[-3000:]}"
    assert err.strip().splitlines() == ["interrupted"], err[-3000:]
    after = seen[seen.index(phase) + 1:]  # the interrupt took effect where it was sent: no stage ran after it
    assert after in ([], ["done"]), seen
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_prune_reports_its_points_in_order(tmp_path):
    """The points of a prune come in the documented order (edgeprune/phases.py), each once except stages."""
    code, err, seen = _interrupted_run(tmp_path, "never")
    assert code == 0, err[-3000:]
    assert [s for s in seen if s in PHASES] == PHASES, seen


def test_a_command_started_with_ctrl_c_ignored_keeps_ignoring_it(tmp_path):
    """issue 43: a prune started with SIGINT ignored (a background job of a script) ignored an
    interrupt in its first milliseconds but died from a later one; now it ignores it throughout, as
    Python does: the run completes, exit 0, nothing on stderr."""
    for phase in ("start", "stage corp"):
        code, err, seen = _interrupted_run(tmp_path, phase, start=_sigint_ignored)
        assert phase in seen and code == 0 and err.strip() == "", err[-3000:]
        assert (tmp_path / f"run-{phase.replace(' ', '-')}" / "run.json").is_file()


# ---- a latency table is user input: one schema check where it is loaded ---------------------------


@pytest.mark.parametrize("damage, field", [
    ({"mlp.ms": [0.0] * 5}, "mlp.ms[0]"),
    ({"mlp.ms": [-0.1, 0.2, 0.3, 0.4, 0.5]}, "mlp.ms[0]"),
    ({"attn.ms.[0].[0].[0]": float("nan")}, "attn.ms[0][0][0]"),
    ({"attn.ms.[2].[3].[3]": float("inf")}, "attn.ms[2][3][3]"),
    ({"dense_model_ms": 0.0}, "dense_model_ms"),
    ({"fixed_ms": -1.0}, "fixed_ms"),
    ({"rules.mlp_round_to": 0}, "rules.mlp_round_to"),
    ({"rules.head_dim_round_to": "16"}, "rules.head_dim_round_to"),
    ({"rules.qk_equals_v": "no"}, "rules.qk_equals_v"),
    ({"rules.mlp_round_to": _DELETE}, "rules.mlp_round_to"),
    ({"key.batch": 0}, "key.batch"),
    ({"key.batch": 8.0}, "key.batch"),
    ({"key.threads": 0}, "key.threads"),
    ({"key.tokens": "5"}, "key.tokens"),
    ({"key.backend": 3}, "key.backend"),
    ({"mlp.widths": []}, "mlp.widths"),
    ({"mlp.widths": [0, 384, 192, 576, 768]}, "mlp.widths"),
    ({"mlp.widths": [0, 192, 384, 576, 700]}, "mlp.widths"),
    ({"attn.heads": [1, 2, 2]}, "attn.heads"),
    ({"mlp.ms": [0.1, 0.2]}, "mlp.ms"),
    ({"mlp.ms.[1]": None}, "mlp.ms[1]"),
    ({"measured.model": "yes"}, "measured.model"),
    ({"meta.settings": {"iterations": 0}}, "meta.settings.iterations"),
    ({"meta.settings": {"max_seconds": float("nan")}}, "meta.settings.max_seconds"),
])
def test_every_table_field_is_checked_where_it_is_loaded(tmp_path, damage, field):
    """issue 41: all-zero times -> ZeroDivisionError after the whole prune; mlp_round_to 0 ->
    range() arg 3 must not be zero; negative times -> a negative 'dense model' latency; key.batch 0
    -> refused only after the prune. One line naming the file and the field, '--force' to rebuild."""
    p = hand_table(tmp_path / "t.json", **damage)
    with pytest.raises(UserError) as err:
        LatencyTable.load(p)
    msg = str(err.value)
    assert "\n" not in msg and repr(field) in msg and p in msg and "--force" in msg, msg


def test_a_good_hand_table_loads(tmp_path):
    t = LatencyTable.load(hand_table(tmp_path / "t.json"))
    assert t.dense_ms() == pytest.approx(t.dense_model_ms) and t.dense_ms() > 0


@pytest.mark.parametrize("damage, field", [({"rules.mlp_round_to": 0}, "rules.mlp_round_to"),
                                           ({"mlp.ms": [0.0] * 5}, "mlp.ms[0]"),
                                           ({"key.batch": 0}, "key.batch")])
def test_prune_and_derive_refuse_a_damaged_table_before_any_work(tmp_path, damage, field):
    table = hand_table(tmp_path / "t.json", **damage)
    r = run_cli(["prune", "--quiet", "--no-eval", *MODEL, "--random-init", "--latency", "0.6", "--latency-table",
                 table, "--calib", _image_folder(tmp_path / "c"), "-o", tmp_path / "r"])
    assert_one_line_error(r, repr(field))
    assert "calibration" not in r.stdout and not (tmp_path / "r").exists()
    r = run_cli(["derive", "--classes", "0,1", "--latency", "0.5", "--latency-table", table, "-o", tmp_path / "d"])
    assert_one_line_error(r, repr(field))


def _partial(tmp_path: Path, **settings) -> Path:
    """A real tiny table (torch, 3 iterations), made partial: the whole-model entry unmeasured."""
    out = tmp_path / "t.json"
    r = run_cli(["latency-table", *MODEL, "--random-init", "--backend", "torch", "--threads", "1", "--warmup", "0",
                 "--iterations", "3", "--max-seconds", "0.05", "--quiet", "--force", "-o", out])
    assert r.exit_code == 0, r.output  # --force: kept should its self-check (issue 40) miss on this shared box
    d = json.loads(out.read_text())
    d["meta"]["complete"], d["measured"]["model"], d["dense_model_ms"], d["fixed_ms"] = False, False, None, None
    for k, v in settings.items():
        _set(d, k, v)
    out.write_text(json.dumps(d))
    return out


def test_latency_table_resume_refuses_other_timing_settings_and_a_damaged_partial_table(tmp_path):
    """issue 41: a resume with other --iterations/--warmup/--max-seconds gave exit 0 with the first
    run's settings recorded; a hand-damaged partial table said 'rebuild the table' (and rerunning
    failed the same way) instead of naming --force."""
    out = _partial(tmp_path)
    base = ["latency-table", *MODEL, "--random-init", "--backend", "torch", "--threads", "1", "--warmup", "0",
            "--quiet", "-o", out]
    for extra, name in ((["--iterations", "5", "--max-seconds", "0.05"], "iterations"),
                        (["--iterations", "3", "--max-seconds", "0.5"], "max_seconds")):
        r = run_cli([*base, *extra])
        assert_one_line_error(r, f"exists with another {name}")
        assert "--force" in r.stderr and not LatencyTable.load(out, allow_partial=True).complete
    d = json.loads(out.read_text())
    d["mlp"]["ms"][1] = None  # measured.mlp still names it
    out.write_text(json.dumps(d))
    r = run_cli([*base, "--iterations", "3", "--max-seconds", "0.05"])
    assert_one_line_error(r, "'mlp.ms[1]'")
    assert "--force" in r.stderr
    r = run_cli([*base, "--iterations", "3", "--max-seconds", "0.05", "--force"])
    assert r.exit_code == 0, r.output
    assert LatencyTable.load(out).complete


@pytest.mark.parametrize("args, code, pattern", [
    (["--model", TINY], 2, "--random-init"),  # said "pass --checkpoint PATH": a table needs no weights
    (["--model", TINY, "--random-init", "--backend", "torch", "--precision", "fp16"], 2, "--precision fp16"),
    (["--model", TINY, "--random-init", "--precision", "fp8"], 2, "'--precision'"),  # was exit 1
    (["--model", TINY, "--random-init", "--precision", "int8"], 2, "fp32 only"),  # was exit 1
    (["--model", TINY, "--random-init", "--backend", "tensorrt"], 2, "profile cpu times on onnxruntime"),
    (["--model", TINY, "--random-init", "--max-seconds", "nan"], 2, "not a finite number"),
    (["--model", TINY, "--random-init", "--max-seconds", "inf"], 2, "not a finite number"),
])
def test_latency_table_messages_name_what_the_command_takes(tmp_path, args, code, pattern):
    """issue 41: '--cuda-graphs' named though latency-table has none; fp8 exit 1 (environment) for a
    usage mistake; --backend tensorrt on the cpu profile told to run 'on the device'; --max-seconds
    nan/inf -> ValueError 'Out of range float values are not JSON compliant'."""
    r = run_cli(["latency-table", "--img-size", "32", "--model-kwargs", "depth=1", *args, "-o", tmp_path / "t.json"])
    assert_one_line_error(r, pattern, code)
    assert "cuda-graphs" not in r.stderr and "on the device" not in r.stderr
    assert not (tmp_path / "t.json").exists()


# ---- every float option of every command is finite ---------------------------------------------


def _float_options() -> list[tuple[str, str]]:
    from edgeprune.cli.main import cli

    out = []
    for name, cmd in sorted(cli.commands.items()):
        for p in cmd.params:
            if isinstance(p, click.Option) and isinstance(p.type, click.types.FloatParamType):
                out.append((name, p.opts[0]))
    return out


def test_every_float_option_is_a_finite_float():
    from edgeprune.cli.main import cli
    from edgeprune.cli.options import FiniteFloat

    found = _float_options()
    assert len(found) >= 20  # prune, derive, heal, verify, quantize, latency-table ...
    for name, cmd in cli.commands.items():
        for p in cmd.params:
            if isinstance(p.type, click.types.FloatParamType):
                assert isinstance(p.type, FiniteFloat), f"{name} {p.opts[0]} is a float option without FiniteFloat"


@pytest.mark.parametrize("command, option", _float_options())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_float_options_are_one_line(command, option, value):
    r = run_cli([command, option, value])
    assert_one_line_error(r, f"'{option}': '{value}' is not a finite number")


# ---- settings that would be silently ignored -----------------------------------------------------


@pytest.mark.parametrize("args, pattern", [
    (["--sparsity", "0.3", "--verify-latency"], "--verify-latency goes with --latency"),
    (["--no-verify-latency"], "--no-verify-latency goes with --latency"),
    (["--embed-order", "last"], "--embed-order goes with --embed-sparsity"),
    (["--embed-refit"], "--embed-refit goes with --embed-sparsity"),
    (["--embed-sparsity", "0", "--embed-order", "first"], "--embed-order goes with --embed-sparsity"),
    # issue 40's options come with their conflicts (issue 41: every new option)
    (["--latency-tolerance", "0.05"], "--latency-tolerance goes with --latency"),
    (["--sensitivity-images", "8"], "--sensitivity-images goes with --flops/--params/--latency"),
    (["--flops", "0.5", "--sensitivity-images", "0"], "allocation sensitivity images must be an int >= 1"),
    (["--sparsity", "0.3", "--latency-rounds", "2"], "--latency-rounds goes with --latency"),
])
def test_prune_refuses_settings_it_would_ignore(tmp_path, args, pattern):
    """issue 41: exit 0 and ignored (the record even said order last / refit true)."""
    r = run_cli(["prune", *args, "-o", tmp_path / "r"])
    assert_one_line_error(r, pattern)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, pattern", [
    (["--latency-rounds", "11"], "--latency-rounds must be an integer in [0, 10]"),
    (["--latency-rounds", "-1"], "--latency-rounds must be an integer in [0, 10]"),
    (["--latency-tolerance", "0"], "--latency-tolerance must be a fraction in (0, 1)"),
    (["--latency-tolerance", "1.5"], "--latency-tolerance must be a fraction in (0, 1)"),
    (["--latency-tolerance", "0.05", "--no-verify-latency"], "needs the measurement that --no-verify-latency"),
])
def test_latency_correction_options_bad_values_and_conflicts(tmp_path, args, pattern):
    """The measure-and-correct options (issue 40): bad values and conflicts in one line, before any work."""
    table = hand_table(tmp_path / "t.json")
    r = run_cli(["prune", "--latency", "0.5", "--latency-table", table, *args, "-o", tmp_path / "r"])
    assert_one_line_error(r, pattern)
    assert not (tmp_path / "r").exists()


@needs_fmnist
def test_quantize_auto_exclude_of_every_node_is_refused(tmp_path):
    """issue 41 (left over): --auto-exclude N >= the quantizable nodes kept every node float and exited 0."""
    onnx_path = tmp_path / "m.onnx"
    assert run_cli(["export", "--model", "fmnist-vit", "-o", onnx_path]).exit_code == 0
    r = run_cli(["quantize", onnx_path, "--precision", "int8", "--recipe", "ort", "--auto-exclude", "100000",
                 "--calib-size", "16", "-o", tmp_path / "q.onnx"])
    assert_one_line_error(r, "--auto-exclude 100000 would keep all")
    assert not (tmp_path / "q.onnx").exists()


def test_quantize_missing_data_names_its_own_options(tmp_path):
    """issue 41: quantize --calib <missing> suggested '--data DIR', which quantize does not have;
    a missing --eval-data was found only after the calibration."""
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not read: the data folders are checked first")
    for option in ("--calib", "--eval-data"):
        r = run_cli(["quantize", model, "--precision", "int8", option, tmp_path / "missing", "-o", tmp_path / "q.onnx"])
        assert_one_line_error(r, f"{option} {tmp_path / 'missing'}")
        assert "--data " not in r.stderr
    from edgeprune.data.fashion_mnist import dataset_dir

    with pytest.raises(UserError) as err:
        dataset_dir(tmp_path / "missing")
    assert "--data " not in str(err.value) and "--calib" in str(err.value)


# ---- a run record is user input: one schema check of every field where it is loaded -------------


def _fields(node, prefix: str = "") -> list[tuple[str, object, bool]]:
    """(dotted field, node, required) of every field the schema declares; a list's items as [0], a
    free-key object's values as .* (the first key of the record)."""
    out = []
    if isinstance(node, Obj):
        for name, spec in node.fields.items():
            sub = f"{prefix}.{name}" if prefix else name
            inner = spec.node if isinstance(spec, Req) else spec
            out.append((sub, inner, isinstance(spec, Req)))
            out += _fields(inner, sub)
    elif isinstance(node, ListOf):
        out.append((f"{prefix}[0]", node.item, True))
        out += _fields(node.item, f"{prefix}[0]")
    elif isinstance(node, MapOf):
        out.append((f"{prefix}.*", node.item, True))
        out += _fields(node.item, f"{prefix}.*")
    return out


FIELDS = _fields(RECORD_SCHEMA)
#: (field, node, required, kind): a list item or a free key's value has no "missing" case (deleting one
#: is a shorter list / fewer keys, not a missing field)
CASES = [(f, n, req, kind) for f, n, req in FIELDS for kind in ("wrong type", "non-finite", "missing", "null")
         if not (kind == "missing" and f.endswith(("]", "*")))]

def _sample(node):
    """A valid value for ``node`` (a field a real prune record lacks: derive's ``head``, heal's
    ``healing``, an absolute budget's ``unit`` ...), its own declared fields filled too."""
    if isinstance(node, OneOf):
        return _sample(node.options[0])
    if isinstance(node, Obj):
        return _fill({}, node)
    if isinstance(node, ListOf):
        return [_sample(node.item)] * max(1, node.min_len)
    if isinstance(node, MapOf):
        return {"k": _sample(node.item)}
    if isinstance(node, Int):
        return max(node.min or 0, 2)
    if isinstance(node, Num):
        return 0.5
    if isinstance(node, Bool):
        return False
    return node.choices[0] if getattr(node, "choices", None) else "x"


def _fill(d: dict, node: Obj) -> dict:
    """``d`` with every declared field of ``node`` present (sampled where absent), recursively."""
    for name, spec in node.fields.items():
        inner = spec.node if isinstance(spec, Req) else spec
        if name not in d:
            d[name] = _sample(inner)
        elif isinstance(inner, Obj) and isinstance(d[name], dict):
            _fill(d[name], inner)
        elif isinstance(inner, ListOf) and isinstance(inner.item, Obj) and isinstance(d[name], list):
            for x in d[name]:
                _fill(x, inner.item)
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Two real small prunes: a latency budget (allocation, latency and selection sections, latency
    check) and a width prune with a sliced residual stream (embed section)."""
    tmp = tmp_path_factory.mktemp("runs41")
    calib = _image_folder(tmp / "calib")
    common = ["prune", "--quiet", *MODEL, "--checkpoint", _checkpoint(tmp), "--calib", calib, "--calib-size", "4"]
    r = run_cli([*common, "--no-eval", "--latency", "0.6", "--latency-table", hand_table(tmp / "t.json"),
                 "--check-images", "2", "-o", tmp / "lat"])
    assert r.exit_code == 0, r.output
    evald = _image_folder(tmp / "evald", n=3)
    r = run_cli([*common, "--eval-data", evald, "--target", "mlp", "--sparsity", "0.5", "--embed-sparsity", "0.25",
                 "-o", tmp / "embed"])
    assert r.exit_code == 0, r.output
    return {"lat": tmp / "lat", "embed": tmp / "embed", "eval": evald}


@pytest.fixture(scope="module")
def full_record(runs, tmp_path_factory) -> dict:
    """The latency run's record with the embed run's embed / evaluation sections, every other
    declared field sampled where a prune record has none (:func:`_fill`)."""
    rec = json.loads((runs["lat"] / "run.json").read_text())
    emb = json.loads((runs["embed"] / "run.json").read_text())
    rec["embed"], rec["evaluation"] = emb["embed"], emb["evaluation"]
    assert _load(tmp_path_factory.mktemp("real"), rec) == rec  # the real sections load as they are
    return _fill(rec, RECORD_SCHEMA)


def _concrete(rec: dict, field: str) -> tuple[str, list] | None:
    """``field`` with each ``*`` replaced by the record's first key there, as the dotted path a
    message names and the list of keys (a key may hold dots: "greedy(qk_weight=0.2)"); None:
    nothing there."""
    d, parts, keys = rec, [], []
    for tok in _tokens(field.replace(".*", ".<any>")):
        if tok == "<any>":
            if not isinstance(d, dict) or not d:
                return None
            tok = next(iter(d))
        if isinstance(tok, int):
            if not isinstance(d, list) or not d:
                return None
            parts.append(f"[{tok}]")
        else:
            if not isinstance(d, dict) or tok not in d:
                return None
            parts.append(f".{tok}" if parts else tok)
        keys.append(tok)
        d = d[tok]
    return "".join(parts), keys


def _wrong(node):
    """A value of the wrong type for ``node``."""
    if isinstance(node, (Obj, MapOf, ListOf, Num, Int, Bool)):
        return "x"
    if isinstance(node, OneOf):
        return ["x"]
    return 5  # Str


def _load(tmp_path: Path, rec) -> dict:
    """The loader a command uses (edgeprune.artifact.read_record) on ``rec`` written as run.json."""
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(b"")  # read_record reads the record only
    (d / "run.json").write_text(json.dumps(rec))
    return read_record(d)


def _read_back(rec: dict) -> None:
    """What info / heal / export read of an accepted record (must not raise anything but UserError)."""
    from edgeprune.allocation.report import allocation_lines
    from edgeprune.heal.reduced import reduced_modules_from_record
    from edgeprune.heal.runs import default_calib_size

    if rec.get("allocation"):
        allocation_lines(rec["allocation"])
    default_calib_size(rec, type("Spec", (), {"default_calib_size": 4})())
    embed = rec.get("embed") or {}
    assert embed.get("embed_dim", 0) <= embed.get("dense_embed_dim", 0) or not embed
    if "dense_blocks" in rec:
        reduced_modules_from_record(rec)


@pytest.mark.parametrize("field, node, required, kind", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_every_record_field_wrong_missing_or_non_finite_is_one_line(full_record, tmp_path, field, node, required,
                                                                   kind):
    """issue 41: "calibration": null -> AttributeError in info; allocation.budget deleted,
    proxy_error mistyped or blocks deleted -> KeyError/AttributeError; an embed entry that is a
    string, a list or has embed_dim null -> TypeError in info/export/eval and AttributeError in heal.
    Every declared field: a wrong type and a non-finite number are one line naming it; a missing or
    null value is one line where the field is required / not nullable, else accepted and read back."""
    found = _concrete(full_record, field)
    assert found is not None, f"the test record has no {field}"
    where, keys = found
    rec = copy.deepcopy(full_record)
    value = {"wrong type": _wrong(node), "non-finite": float("nan"), "missing": _DELETE, "null": None}[kind]
    _set(rec, keys, value)
    refused = kind in ("wrong type", "non-finite") or (kind == "missing" and required) or (
        kind == "null" and not node.nullable)
    if not refused:
        _read_back(_load(tmp_path, rec))
        return
    with pytest.raises(UserError) as err:
        _load(tmp_path, rec)
    msg = str(err.value)
    assert "\n" not in msg and "run.json" in msg, msg
    assert repr(where) in msg or (kind == "wrong type" and where.rsplit(".", 1)[0] in msg), msg
    assert not any(t in msg for t in ("NoneType", "<class", "KeyError", "TypeError", "AttributeError")), msg


def test_the_schema_covers_every_section_of_a_real_record(full_record):
    """A new section of the record comes with its schema (or the test above would not see it)."""
    declared = set(RECORD_SCHEMA.fields)
    missing = [k for k in full_record if k not in declared and k not in ("solve",)]
    assert not missing, f"sections without a schema: {missing}"


def _damage(run: Path, tmp_path: Path, field: str, value) -> Path:
    dst = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
    shutil.copytree(run, dst)
    rec = json.loads((dst / "run.json").read_text())
    _set(rec, field, value)
    (dst / "run.json").write_text(json.dumps(rec))
    return dst


@pytest.mark.parametrize("which, field, value", [
    ("lat", "calibration", None),
    ("lat", "allocation.budget", _DELETE),
    ("lat", "allocation.proxy_error", "x"),
    ("lat", "allocation.blocks", _DELETE),
    ("lat", "allocation.latency.dense", float("inf")),
    ("embed", "embed", "x"),
    ("embed", "embed", [1, 2]),
    ("embed", "embed.embed_dim", None),
])
def test_damaged_sections_are_one_line_in_every_command(runs, tmp_path, which, field, value):
    run = _damage(runs[which], tmp_path, field, value)
    for argv in (["info", run], ["eval", run, "--eval-data", runs["eval"]], ["export", run, "-o", tmp_path / "m.onnx"],
                 ["heal", run, "--epochs", "1", "-o", tmp_path / "h"],
                 ["quantize", run, "--precision", "fp16", "-o", tmp_path / "q.onnx"]):
        r = run_cli(argv)
        assert_one_line_error(r, repr(field))
        assert str(run / "run.json") in r.stderr


def test_a_record_that_is_json_null_says_what_the_file_should_be(runs, tmp_path):
    """issue 41: 'not a run record (a JSON object), got NoneType'."""
    run = _damage(runs["lat"], tmp_path, "method", "x")
    (run / "run.json").write_text("null")
    r = run_cli(["info", run])
    assert_one_line_error(r, "is not a run record")
    assert "NoneType" not in r.stderr and "edgeprune prune" in r.stderr
