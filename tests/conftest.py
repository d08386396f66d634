"""Shared fixtures. Tests run on CPU with few threads; models are small or random-init."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: torch threads per test process: the cores shared among pytest-xdist's workers (``-n N``), at most 2
#: (the tensors are small); also handed to the ``edgeprune`` subprocesses some tests start.
TEST_THREADS = max(1, min(2, _cores() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(TEST_THREADS)

FMNIST_DIR = Path(os.environ.get("EDGEPRUNE_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
HAS_FMNIST = (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists() or (FMNIST_DIR / "train-images-idx3-ubyte").exists()
needs_fmnist = pytest.mark.skipif(not HAS_FMNIST, reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


@pytest.fixture(autouse=True)
def _quiet_machine_figures(monkeypatch):
    """No test's verdict may depend on this machine's load (issue 52): in every in-process test the load figures the
    latency code records (``edgeprune.latency.load``) read as a quiet machine's -- load average 0, no spread of the
    dense model's own timings -- so a fake backend's self-check blames the table on a loaded CI runner as on an idle
    one. Tests of the figures plant their own (monkeypatch again)."""
    from edgeprune.latency import load

    monkeypatch.setattr(load, "snapshot", lambda clock=load.CLOCK: {"load_1m": 0.0, "load_5m": 0.0,
                                                                    "cores": load.usable_cores(), "clock": clock})
    monkeypatch.setattr(load, "spread_of", lambda ms: None)


@pytest.fixture(scope="session")
def timm():
    from edgeprune._compat import import_timm

    return import_timm()


@pytest.fixture(scope="session")
def fmnist_model():
    from edgeprune.zoo.fmnist_vit import create_fmnist_vit

    return create_fmnist_vit(pretrained=True)


@pytest.fixture(scope="session")
def fmnist_calib():
    """256 Fashion-MNIST train images (calibration) and 256 test images (evaluation)."""
    if not HAS_FMNIST:
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    from edgeprune.data.fashion_mnist import load_split

    xtr, _ = load_split("train")
    xte, yte = load_split("test")
    g = torch.Generator().manual_seed(0)
    return xtr[torch.randperm(len(xtr), generator=g)[:256]], xte[:256], yte[:256]


def run_cli(argv: list) -> "types.SimpleNamespace":
    """``edgeprune ARGV`` as a user runs it: through the CLI's one error handler
    (``edgeprune.cli.main``), stdout and stderr captured.

    Returns:
        namespace with ``exit_code`` (int), ``stdout``, ``stderr``, ``output`` (both) and
        ``exception`` (None: the handler turns every user error into an exit code).
    """
    import sys

    from click.testing import CliRunner

    from edgeprune.cli.main import main

    code = 0
    with CliRunner().isolation() as streams:
        try:
            main([str(a) for a in argv])
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = streams[0].getvalue().decode(), streams[1].getvalue().decode()
    return types.SimpleNamespace(exit_code=code, stdout=stdout, stderr=stderr, output=stdout + stderr,
                                 exception=None)


def assert_one_line_error(result, pattern: str, code: int = 2) -> None:
    """Exit ``code``, exactly one ``error: ...`` line on stderr containing ``pattern``, no traceback."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and pattern in lines[0], lines[0]
    assert "Traceback" not in result.output


def tiny_vit():
    """A seeded 2-block timm ViT: width 32, 2 heads of 16, MLP 128, 16 px / patch 4 (17 tokens), 5 classes."""
    from edgeprune._compat import import_timm

    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=32, depth=2,
                             num_heads=2, mlp_ratio=4.0).eval()


def torchrun_beside(args: list, work, nproc: int = 2, timeout: float = 300) -> tuple:
    """Launch ``torchrun --standalone --nproc-per-node NPROC ARGS`` (gloo, one thread per process,
    collectives time out after 120 s), call ``work()`` in this process meanwhile, then wait.

    Returns:
        (work's result, torchrun's stdout); asserts that torchrun exited 0 (its output in the
        message). On any failure torchrun and its workers are killed (their own session).
    """
    import signal
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "EDGEPRUNE_DIST_TIMEOUT_S": "120"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *[str(a) for a in args]]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1], start_new_session=True)
    try:
        result = work()
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        print(stdout[-2000:], stderr[-2000:])
        raise
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return result, stdout


#: The test files that take longest (measured with ``--durations``, slowest first). README's test
#: command (``-n auto --dist loadfile --no-loadscope-reorder``) runs each file on one worker and hands
#: files out in collection order: these start first, so that no long file starts last and runs alone.
SLOW_FILES = ("test_readme.py", "test_quantize.py", "test_deploy_more.py", "test_bad_input_41.py", "test_heal.py",
              "test_deploy.py", "test_allocation_select.py", "test_gpu_check.py", "test_corp_pipeline.py",
              "test_bench_cli.py", "test_standard_attention.py", "test_gram_tokens.py", "test_bad_input.py", "test_distributed.py",
              "test_method_properties.py", "test_onnx_export.py", "test_quantize_dynamic.py", "test_allocation.py",
              "test_cli.py", "test_bad_input_52.py")


def pytest_collection_modifyitems(config, items):
    """Move the tests of :data:`SLOW_FILES` to the front (in that order); every file's own order stays."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[id(item)]))


def ort_outputs(model, x):
    """First output of an ONNX model (path or ``ModelProto``) on ``x`` with ONNX Runtime, 1 thread."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def export_fmnist_vit(directory: Path, name: str = "dense.onnx") -> Path:
    """The dense fmnist-vit exported to ``directory / name`` with its base-model metadata."""
    from edgeprune.zoo.registry import get_model_spec
    from exporters.onnx import build_metadata, export_onnx

    spec = get_model_spec("fmnist-vit")
    model = spec.create()
    md = build_metadata(spec=spec, model=model, model_name=spec.name)
    md["base_model"] = spec.to_record()
    return export_onnx(model, directory / name, spec.input_size, md)


def write_latency_table(path, key: dict, rules: dict, heads: list, dims: list, widths: list, attn_ms, mlp_ms,
                        fixed_ms: float = 1.0) -> str:
    """A hand-made, complete latency table (no timing) saved as JSON at ``path``: attention entries
    ``attn_ms(heads, qk, v)`` on the grid ``heads`` x ``dims`` x ``dims``, MLP entries ``mlp_ms(width)``, fixed
    ``fixed_ms``; the dense model's time is the table's own prediction. Returns the path."""
    from edgeprune.latency.table import LatencyTable

    ms = [[[attn_ms(h, q, v) for v in dims] for q in dims] for h in heads]
    t = LatencyTable(key=key, rules=rules, mlp={"widths": widths, "ms": [mlp_ms(w) for w in widths]},
                     attn={"heads": heads, "qk": dims, "v": dims, "ms": ms}, fixed_ms=fixed_ms, dense_model_ms=0.0,
                     measured={"mlp": widths, "attn": [[h, q, v] for h in heads for q in dims for v in dims]})
    t.dense_model_ms = t.dense_ms()
    t.save(path)
    return str(path)
