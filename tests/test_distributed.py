"""Multi-process calibration (torchrun, gloo on CPU): the run equals the single-process run.

METHODS.md §5 "Distributed statistics". One torchrun launch with two gloo processes runs a small
worker (below) that prunes fmnist-vit twice on 12 calibration images, batches of 4 (rank 0: batch
0, rank 1: batches 1-2): once through the command line (``edgeprune prune``, float32 Grams) and
once through the API with float64 Grams, plus an MLP-only API run where rank 1's share is empty
and a Q/K run in two passes.
The same runs are made single-process in the test process, with one thread as under torchrun
(the Q/K solve is sensitive to the BLAS thread count at the 1e-1 level on this model, see
docs/distributed.md).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import HAS_FMNIST, assert_one_line_error, needs_fmnist, run_cli, torchrun_beside

PRUNE_ARGS = ["--model", "fmnist-vit", "--target", "all", "--sparsity", "0.5", "--attn-sparsity", "0.75",
              "--calib-size", "12", "--batch-size", "4", "--no-eval", "--quiet",
              "--bias-correction", "6"]  # images 0-3 on rank 0, 4-5 on rank 1: the sums are all-reduced
API_KW = dict(target="all", sparsity=0.5, attn_sparsity=0.75, gram_dtype="float64", batch_size=4)
MLP_KW = dict(target="mlp", sparsity=0.5, gram_dtype="float64", batch_size=12)  # one batch: rank 1 gets none
TWO_PASS_KW = dict(target="attn", sparsity=0.75, gram_dtype="float64", batch_size=4,
                   qk_memory_limit_gb=1e-9)  # Q/K system accumulated in a second pass (QKSystemStatistics)
TOKENS_KW = dict(target="mlp", sparsity=0.5, gram_dtype="float64", batch_size=4, gram_tokens=16)  # per-image subsets
RUNS = {"api": API_KW, "mlp": MLP_KW, "twopass": TWO_PASS_KW, "tokens": TOKENS_KW}

WORKER = textwrap.dedent("""
    import json, sys
    import edgeprune
    from edgeprune.artifact import save_run
    from edgeprune.cli.main import main
    from edgeprune.distributed import process_group, rank

    out, cli_args, kws = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    spec = edgeprune.get_model_spec("fmnist-vit")
    calib = spec.calibration_source(12, seed=0)
    with process_group("cpu"):  # one group per process (re-initialising one under torchrun hangs)
        main(["prune", *cli_args, "-o", out + "/cli"])  # the command line, as 'edgeprune prune'
        for name, kw in kws.items():
            res = edgeprune.prune(spec.create(pretrained=True), calib, spec=spec, **kw)
            if rank() == 0:
                save_run(out + "/" + name, res.model, res.record)
""")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _worst_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        assert a[k].shape == b[k].shape, k
        diff = (a[k].double() - b[k].double()).norm() / a[k].double().norm().clamp_min(1e-30)
        worst = max(worst, float(diff))
    return worst


def _assert_same_kept(a: dict, b: dict, blocks: list) -> None:
    """Kept MLP channels and V dims: fc1 and the V rows of qkv are selected, never folded, so
    equal kept indices means bitwise-equal rows."""
    for blk in blocks:
        i, hq = blk["index"], blk["num_heads"] * blk["qk_dim"]
        assert torch.equal(a[f"blocks.{i}.mlp.fc1.weight"], b[f"blocks.{i}.mlp.fc1.weight"]), i
        assert torch.equal(a[f"blocks.{i}.attn.qkv.weight"][2 * hq:], b[f"blocks.{i}.attn.qkv.weight"][2 * hq:]), i


def _single_runs(out: Path) -> None:
    """The same runs in this process, one thread (as torchrun's workers)."""
    import edgeprune
    from edgeprune.artifact import save_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_cli(["prune", *PRUNE_ARGS, "-o", out / "cli"])
        assert result.exit_code == 0, result.output
        spec = edgeprune.get_model_spec("fmnist-vit")
        calib = spec.calibration_source(12, seed=0)
        for name, kw in RUNS.items():
            res = edgeprune.prune(spec.create(pretrained=True), calib, spec=spec, **kw)
            save_run(out / name, res.model, res.record)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(torchrun out dir {cli, api, mlp, twopass}, its stdout, single-process out dir): one
    two-process launch, the single-process runs made meanwhile."""
    if not HAS_FMNIST:
        pytest.skip("Fashion-MNIST not installed")
    out = tmp_path_factory.mktemp("dist")
    single = tmp_path_factory.mktemp("single")
    script = out / "worker.py"
    script.write_text(WORKER)
    _, stdout = torchrun_beside([script, out, json.dumps(PRUNE_ARGS), json.dumps(RUNS)],
                                lambda: _single_runs(single), timeout=240)
    return out, stdout, single


@needs_fmnist
def test_two_processes_equal_one_float64(runs):
    """float64 Grams: folded weights within 1e-5 relative (observed ~1e-10), same kept indices,
    with an empty share on rank 1 (MLP-only run), with the two-pass Q/K system, and with
    ``gram_tokens`` (each rank draws the subsets of its images by their index in the whole set)."""
    out, _, single_runs = runs
    for name in RUNS:
        rec = json.loads((out / name / "run.json").read_text())
        ref = json.loads((single_runs / name / "run.json").read_text())
        assert rec["blocks"] == ref["blocks"]
        assert rec["calibration"]["num_images"] == 12
        assert rec["calibration"]["passes"] == ref["calibration"]["passes"] == (2 if name == "twopass" else 1)
        assert rec["calibration"]["world_size"] == 2 and rec["calibration"]["backend"] == "gloo"
        a, b = _weights(single_runs / name), _weights(out / name)
        _assert_same_kept(a, b, rec["blocks"])
        assert _worst_rel(a, b) < 1e-5, name


@needs_fmnist
def test_two_processes_command_line(runs):
    """``edgeprune prune`` under torchrun: one report (rank 0), record says world_size and backend,
    same kept indices as one process; with the default float32 Grams the folded weights are
    within 1e-5 relative too (every rank centres on rank 0's first batch, as one process does,
    so the per-batch float32 products are the same; before that, ~2e-4)."""
    out, stdout, single_runs = runs
    assert stdout.count("saved ") == 1
    rec = json.loads((out / "cli" / "run.json").read_text())
    ref = json.loads((single_runs / "cli" / "run.json").read_text())
    assert rec["calibration"]["world_size"] == 2 and rec["calibration"]["backend"] == "gloo"
    assert "world_size" not in ref["calibration"]
    assert rec["calibration"]["num_images"] == ref["calibration"]["num_images"] == 12
    assert rec["blocks"] == ref["blocks"]
    assert rec["bias_correction"]["images"] == ref["bias_correction"]["images"] == 6
    assert rec["bias_correction"]["shift_norm"] == pytest.approx(ref["bias_correction"]["shift_norm"], rel=1e-5)
    a, b = _weights(single_runs / "cli"), _weights(out / "cli")
    _assert_same_kept(a, b, rec["blocks"])
    worst = _worst_rel(a, b)
    print(f"float32 torchrun vs one process: worst relative difference {worst:.2e}")
    assert worst < 1e-5


@pytest.mark.parametrize("second_order", [True, False])
def test_recentred_halves_equal_one_pass(second_order):
    """Two halves, each centred on its own first batch, re-centred onto the first half's shift and
    summed == one pass over all (float64, ~1e-12)."""
    from edgeprune.calibration.mlp_stats import MLPStatistics
    from edgeprune.distributed import recentre

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 7, 6, generator=g, dtype=torch.float64) * (1 + i) + 5 * i for i in range(4)]
    whole = MLPStatistics(6, torch.float64, second_order)
    halves = [MLPStatistics(6, torch.float64, second_order) for _ in range(2)]
    for i, x in enumerate(batches):
        whole.add_batch(x)
        halves[i // 2].add_batch(x)
    assert not torch.allclose(halves[0]._shift, halves[1]._shift)
    s = halves[0]._shift
    parts = [recentre(h._sum, h._gram if second_order else None, None if second_order else h._sq, h.count,
                      h._shift - s) for h in halves]
    assert torch.allclose(s, whole._shift, rtol=0, atol=0)
    total = parts[0][0] + parts[1][0]
    assert torch.allclose(total, whole._sum, rtol=1e-12, atol=1e-10)
    k = 1 if second_order else 2
    second = parts[0][k] + parts[1][k]
    assert torch.allclose(second, whole._gram if second_order else whole._sq, rtol=1e-12, atol=1e-10)
    # and the moments read from the merged sums
    merged = MLPStatistics(6, torch.float64, second_order)
    merged._shift, merged._sum, merged.count = s, total, whole.count
    if second_order:
        merged._gram = second
        assert torch.allclose(merged.cov, whole.cov, rtol=1e-12, atol=1e-12)
    else:
        merged._sq = second
    assert torch.allclose(merged.variance, whole.variance, rtol=1e-12, atol=1e-12)
    assert torch.allclose(merged.mean, whole.mean, rtol=1e-12, atol=1e-12)


def test_shards_cover_the_batches_once_in_order():
    """Contiguous shards of nb batches over W ranks: disjoint, in order, all of them (empty shares allowed)."""
    from edgeprune.distributed import shard_range

    for nb in (1, 2, 3, 7, 16):
        for w in (1, 2, 3, 5):
            got = [i for r in range(w) for i in range(*shard_range(nb, r, w))]
            assert got == list(range(nb)), (nb, w)


def test_prune_with_world_size_but_no_torchrun_env(monkeypatch, tmp_path):
    """WORLD_SIZE > 1 without torchrun's other variables: one line naming the launcher."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    result = run_cli(["prune", "--calib-size", "4", "--no-eval", "--quiet", "-o", str(tmp_path / "x")])
    assert_one_line_error(result, "torchrun --nproc-per-node 2")


def test_calibration_shares_partition_the_batches(monkeypatch):
    """Under W ranks, calibration_batches yields rank r's share: together the shares are every
    batch once, with the single-process batch boundaries; contiguous runs for a sized source
    (so gathering in rank order keeps the image order), every W-th batch for a callable."""
    import edgeprune.distributed as D
    from edgeprune.api import calibration_batches

    images = torch.arange(11 * 3, dtype=torch.float32).reshape(11, 3, 1, 1)
    whole = [x for x in calibration_batches(images, 2)[0]()]
    monkeypatch.setattr(D, "is_distributed", lambda: True)
    monkeypatch.setattr(D, "world_size", lambda: 3)
    shares_sized, shares_callable = [], []
    for r in range(3):
        monkeypatch.setattr(D, "rank", lambda r=r: r)
        batches, _, n = calibration_batches(images, 2)
        assert n == 11  # the whole set's size
        shares_sized.append(list(batches()))
        shares_callable.append(list(calibration_batches(lambda: iter(whole), 2)[0]()))
    flat = [x for share in shares_sized for x in share]
    assert len(flat) == len(whole) and all(torch.equal(a, b) for a, b in zip(flat, whole))
    assert [len(s) for s in shares_sized] == [2, 2, 2]
    strided = [shares_callable[j % 3][j // 3] for j in range(len(whole))]
    assert all(torch.equal(a, b) for a, b in zip(strided, whole))
    assert sum(len(s) for s in shares_callable) == len(whole)
