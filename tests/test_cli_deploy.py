"""``export`` / ``verify`` / ``bench`` commands (edgeprune/cli_deploy.py) on a local click group."""

from __future__ import annotations

import json

import click
import pytest
import torch
from click.testing import CliRunner

from edgeprune.cli_deploy import bench_cmd, export_cmd, verify_cmd
from edgeprune.errors import UserError
from exporters.onnx import read_metadata


@click.group()
def cli() -> None:
    """Test group holding the deploy commands."""


cli.add_command(export_cmd, "export")
cli.add_command(verify_cmd, "verify")
cli.add_command(bench_cmd, "bench")


def _fmnist_data_available() -> bool:
    try:
        from edgeprune.data.fashion_mnist import dataset_dir

        dataset_dir()
        return True
    except UserError:
        return False


needs_fmnist = pytest.mark.skipif(not _fmnist_data_available(), reason="Fashion-MNIST not installed")


def invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_user_error(result, pattern: str, code: int = 2) -> None:
    """Non-zero exit, exactly one line on stderr, no traceback."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and pattern in lines[0], lines[0]
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A pruned fmnist-vit run directory and dense + pruned ONNX exports."""
    from edgeprune.api import prune
    from edgeprune.artifact import save_run
    from edgeprune.cli_deploy import RANDOM_INIT_SEED
    from edgeprune.zoo.registry import get_model_spec

    d = tmp_path_factory.mktemp("cli")
    spec = get_model_spec("fmnist-vit", random_init=True)
    torch.manual_seed(RANDOM_INIT_SEED)
    model = spec.create(pretrained=False)
    res = prune(model, torch.randn(16, 1, 28, 28), target="both", sparsity=0.5, spec=spec)
    save_run(d / "run", res.model, res.record)
    r1 = invoke("export", d / "run", "-o", d / "pruned.onnx")
    assert r1.exit_code == 0, r1.output
    r2 = invoke("export", "--model", "fmnist-vit", "--random-init", "-o", d / "dense.onnx")
    assert r2.exit_code == 0, r2.output
    return d, r1, r2, res.record


# ---------------------------------------------------------------------------------------------
# export


def test_export_run_dir_and_dense(work):
    d, r_pruned, r_dense, record = work
    assert "wrote" in r_pruned.stdout and "max abs diff" in r_pruned.stdout
    md = read_metadata(d / "pruned.onnx")
    assert md["method"] == record["method"] and md["blocks"] == record["blocks"]
    assert md["sparsity"] == record["sparsity"] and md["base_model"]["name"] == "fmnist-vit"
    assert md["input_shape"] == ["batch", 1, 28, 28] and md["input_name"] == "input"
    assert md["mean"] == [pytest.approx(0.2860)] and md["output_kind"] == "logits"
    dense = read_metadata(d / "dense.onnx")
    assert dense["method"] == "dense" and dense["blocks"][0]["mlp_hidden"] == 512
    assert sorted(p.name for p in d.iterdir()) == ["dense.onnx", "pruned.onnx", "run"]


def test_export_refuses_to_overwrite(work):
    d = work[0]
    before = (d / "dense.onnx").read_bytes()
    r = invoke("export", "--model", "fmnist-vit", "--random-init", "-o", d / "dense.onnx")
    assert_user_error(r, "exists")
    assert (d / "dense.onnx").read_bytes() == before


def test_export_force_and_static_batch(tmp_path):
    out = tmp_path / "s.onnx"
    out.write_bytes(b"old")
    r = invoke("export", "--model", "fmnist-vit", "--random-init", "-o", out, "--force",
               "--static-batch", "2")
    assert r.exit_code == 0, r.output
    assert read_metadata(out)["input_shape"] == [2, 1, 28, 28]


def test_export_user_errors(tmp_path):
    out = tmp_path / "x.onnx"
    assert_user_error(invoke("export", tmp_path / "no_run", "-o", out), "not found")
    assert_user_error(invoke("export", "-o", out), "either")
    assert_user_error(invoke("export", tmp_path, "--model", "fmnist-vit", "-o", out), "either")
    assert_user_error(invoke("export", tmp_path, "-o", out), "not an edgeprune run directory")
    assert_user_error(invoke("export", "--model", "no_such_model_xyz", "-o", out), "unknown model")
    assert_user_error(invoke("export", "--model", "fmnist-vit", "--random-init", "-o", tmp_path / "x.txt"),
                      ".onnx")
    assert_user_error(invoke("export", "--model", "fmnist-vit", "--random-init", "-o", out,
                             "--opset", "23"), "opset")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# verify


@needs_fmnist
def test_verify_passes_on_real_inputs(work, tmp_path):
    d = work[0]
    r = invoke("verify", d / "pruned.onnx", "--against", d / "run", "--n", "24",
               "--json", tmp_path / "v.json")
    assert r.exit_code == 0, r.output
    assert "PASS" in r.stdout and "max abs diff" in r.stdout and "top1_agreement: 100.00%" in r.stdout
    rep = json.loads((tmp_path / "v.json").read_text())
    assert rep["passed"] and rep["n"] == 24 and rep["max_abs_diff"] <= 1e-4
    r2 = invoke("verify", d / "dense.onnx", "--model", "fmnist-vit", "--random-init", "--n", "8")
    assert r2.exit_code == 0, r2.output


@needs_fmnist
def test_verify_exits_1_above_tolerance(work):
    d = work[0]
    # the pruned export against the dense model: a real mismatch, not a user error
    r = invoke("verify", d / "pruned.onnx", "--model", "fmnist-vit", "--random-init", "--n", "8")
    assert r.exit_code == 1 and "FAIL" in r.stdout
    assert "Traceback" not in r.output
    # and with an absurd tolerance it passes
    r2 = invoke("verify", d / "pruned.onnx", "--model", "fmnist-vit", "--random-init", "--n", "8",
                "--atol", "1e6")
    assert r2.exit_code == 0


def test_verify_user_errors(work, tmp_path):
    d = work[0]
    assert_user_error(invoke("verify", tmp_path / "missing.onnx", "--against", d / "run"), "not found")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01garbage")
    assert_user_error(invoke("verify", bad, "--against", d / "run"), "not a valid ONNX model")
    assert_user_error(invoke("verify", d / "dense.onnx"), "either")
    assert_user_error(invoke("verify", d / "dense.onnx", "--against", tmp_path / "nope"), "not found")
    r = invoke("verify", d / "dense.onnx", "--model", "deit_tiny_patch16_224", "--random-init", "--n", "1")
    assert r.exit_code == 2 and "input shape mismatch" in r.stderr and "Traceback" not in r.output


# ---------------------------------------------------------------------------------------------
# bench


def test_bench_pair_table_json_plot(work, tmp_path):
    d = work[0]
    r = invoke("bench", d / "dense.onnx", "--vs", d / "pruned.onnx", "--batch-sizes", "1,2",
               "--iterations", "4", "--warmup", "1", "--threads", "1",
               "--json", tmp_path / "b.json", "--plot", tmp_path / "b.png")
    assert r.exit_code == 0, r.output
    assert "latency A/B" in r.stdout and "throughput B/A" in r.stdout
    assert "| dense.onnx | onnxruntime | cpu | 2 |" in r.stdout
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [p["batch_size"] for p in doc["results"]] == [1, 2]
    assert doc["results"][0]["a"]["settings"]["intra_op_threads"] == 1
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_single_and_torch_backend(work):
    d = work[0]
    r = invoke("bench", d / "pruned.onnx", "--batch-sizes", "2", "--iterations", "3", "--warmup", "0")
    assert r.exit_code == 0, r.output
    assert "| pruned.onnx | onnxruntime | cpu | 2 |" in r.stdout
    r2 = invoke("bench", "fmnist-vit", "--vs", d / "run", "--backend", "torch", "--random-init",
                "--batch-sizes", "1", "--iterations", "3", "--warmup", "0", "--threads", "1")
    assert r2.exit_code == 0, r2.output
    assert "| run | torch | cpu | 1 |" in r2.stdout


def test_bench_user_errors(work, tmp_path):
    d = work[0]
    assert_user_error(invoke("bench", tmp_path / "missing.onnx"), "not found")
    bad = tmp_path / "bad.onnx"
    bad.write_text("garbage")
    assert_user_error(invoke("bench", bad), "cannot load")
    assert_user_error(invoke("bench", d / "dense.onnx", "--provider", "no_such_provider"), "not available")
    assert_user_error(invoke("bench", d / "dense.onnx", "--backend", "torch"), "ONNX file")
    assert_user_error(invoke("bench", d / "run", "--backend", "onnxruntime"), "export it first")
    assert_user_error(invoke("bench", tmp_path / "model.engine"), "TensorRT")
    r = invoke("bench", d / "dense.onnx", "--batch-sizes", "1,x")
    assert r.exit_code == 2 and "comma-separated integers" in r.output
