"""The GPU check in one command (issue 43, item 4): everything the docs leave "not measured on a GPU".

    python benchmarks/gpu_check.py --out docs/results/gpu_check       # on a machine with one NVIDIA GPU
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check      # the same steps on the CPU, tiny sizes

Needs torch with CUDA, timm, onnx and ONNX Runtime (CPU); no TensorRT, no network. Runs in under 8 minutes
on an H100 / H200 (every check has a time budget, the whole run a deadline of :data:`DEADLINE_S`; a check
that runs out is recorded as failed with what it measured so far). Each check runs in its own try/except:
one failure is recorded (message and traceback) and the others go on. Writes ``OUT/gpu_check.json`` and
``OUT/gpu_check.md`` (rewritten after every check, so an interrupted run keeps what was done) and prints
one line per check: ``name: pass|fail|skipped -- the number``. Exit status 1 when a check failed, 2 on bad
options (e.g. no GPU without ``--dry-run``).

The checks (models are timm ones with seeded random weights and seeded noise images: speed and
exactness depend on the shapes, not on the weights):

* ``cuda_tests``: the tests that skip without CUDA (found in ``tests/`` by their ``skipif(not
  torch.cuda.is_available())`` / ``needs_cuda`` / ``pytest.mark.gpu`` decorators), run with pytest.
* ``runner_modes``: ``runners.torch_runner.TorchRunner`` in fp32 / tf32 / fp16 / bf16, eager and CUDA
  graphs, deit_small at batch 64: logits against the CPU fp32 model (relative error, top-1 agreement),
  p50 latency and the SDPA kernel that ran.
* ``heal_resume``: a heal interrupted after epoch 1 and resumed from its checkpoint on CUDA equals the
  uninterrupted heal bit for bit (weights and loss history), and two heals are identical.
* ``cli_cuda``: ``edgeprune verify --device cuda`` (the PyTorch side on the GPU) and ``edgeprune bench``
  of a model name with the torch backend on a GPU profile (fp16, CUDA graphs).
* ``prune_cost``: CUDA prune (``both`` @ 0.5, default settings) against one dense pass over the same
  images, deit_small and deit_base, 256 and 1024 images (``benchmarks/bench_prune_cost.py``'s timers
  and bound: <= 3x).
* ``latency_table``: ``edgeprune latency-table --backend torch --precision fp16 --batch 256 --interleave``
  for deit_small on a GPU profile written for this GPU (CUDA graphs; the GPU rules: MLP widths on 64,
  head dims on 16, Q/K = V); reports the entries, the dense model, and the time saved by half the heads /
  half the head dims / half the MLP width against the ideal (the size saved).
* ``latency_prune``: ``prune --latency 0.6`` on that table (CUDA calibration pass): the record's
  ``latency_check`` -- predicted vs measured (interleaved, torch CUDA fp16, graphs, batch 256) for
  every round of the measure-and-correct loop, the round kept, whether it meets the budget.
* ``speedup``: ``--flops 0.5`` vs ``--latency 0.5`` (the same table): real speed-up over the dense
  model at batch 256 and batch 1, fp16 with CUDA graphs, interleaved (``runners.compare.bench_pair``),
  next to each model's FLOPs ratio.
* ``layout``: uniform ``all`` @ 0.5 with ``--layout default`` vs ``--layout fused`` at fp16, batch 256,
  graphs: speed-up as a fraction of the FLOPs ratio (docs/layout.md's target: >= 90% for fused) and the
  attention kernel each runs.

What each "not measured on a GPU" of the docs gets (:data:`TODOS` holds the same list for the report):

* docs/prune_cost.md "GPU rows: not yet measured" (twice), the issue-29 GPU bound "<= 3x ... not yet
  measured" and "GPU timings: not yet measured" (CUDA statistics path) -> ``prune_cost``.
* docs/prune_cost.md "those tests skip without CUDA and have not been run on a GPU yet" (heal /
  derive on CUDA) -> ``cuda_tests`` (and ``heal_resume``); "the CUDA paths [of eval / verify / bench]
  have not run on a GPU yet" -> ``cuda_tests`` (eval) and ``cli_cuda`` (verify, bench).
* docs/latency.md "Not measured ...: the torch CUDA (fp16, batch 256, CUDA graphs) ... table" ->
  ``latency_table``.
* docs/latency_budget.md "torch CUDA tables / DeiT-B --latency 0.6 ... not measured on a GPU" ->
  ``latency_table`` + ``latency_prune`` (deit_small; DeiT-B: ``--model deit_base_patch16_224 --only
  latency_table,latency_prune``).
* docs/latency_budget.md "issue 30: 1.41x on an H100 for a FLOPs ratio of 2" (the issue's number, not
  measured by this project) -> ``speedup``.
* docs/layout.md "GPU profiles: not measured on a GPU" (fused vs default at fp16 batch 256) -> ``layout``.
* docs/results.md "GPU rows: not yet measured" (``bench_latency.py --backend torch --device cuda``) ->
  ``runner_modes`` (precisions, graphs, kernel), ``speedup`` and ``layout`` (pruned vs dense); the
  full grid (deit_base, sparsity 0.7, batch 64) stays with that tool.
* Not answered here (they need TensorRT, pretrained weights or data this check does not assume):
  docs/latency.md "tensorrt ... not measured" (TensorRT tables); docs/quantization.md "whether
  TensorRT fuses every GEMM into an int8 kernel is not measured", "~+4 % GEMM time ... not measured",
  "TensorRT figures ... not measured"; docs/embed.md "GPU: not measured" (the DINOv2-S >= 1.6x at <= 1
  point goal needs the pretrained dinov2-s14-fmnist and its test images) and "Its case is the large
  GPU ... not measured here" (embed slice speed); docs/latency_pareto.md "CUDA: not measured"
  (``benchmarks/pareto.py`` on pretrained DINOv2); docs/prune_cost.md "a bfloat16 -> float32 product
  ... not built" (no code to measure).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import bench_prune_cost, common  # noqa: E402

from edgeprune.allocation.greedy import cheapest  # noqa: E402
from edgeprune.anatomy import find_anatomy  # noqa: E402
from edgeprune.api import prune  # noqa: E402
from edgeprune.atomic import atomic_write_text  # noqa: E402
from edgeprune.errors import UserError  # noqa: E402
from edgeprune.heal import heal  # noqa: E402
from edgeprune.latency.table import LatencyTable  # noqa: E402
from edgeprune.pruning.config import corp_config  # noqa: E402
from edgeprune.zoo.registry import get_model_spec  # noqa: E402
from runners.compare import bench_pair  # noqa: E402
from runners.torch_runner import TorchRunner  # noqa: E402

#: the whole run stops starting checks after this many seconds (each check also has its own budget)
DEADLINE_S = 450.0
#: no check starts with less than this many seconds left of the deadline
MIN_START_S = 5.0
STATUSES = ("pass", "fail", "skipped")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one run: :data:`GPU` on a GPU, :data:`DRY` (tiny, CPU) with ``--dry-run``."""

    mode: str
    device: str
    model: str                      # timm name of the table / latency / speed-up / modes model
    img_size: int | None            # input side of every model of the plan (None: the model's own)
    model_kwargs: dict              # further timm keywords of every model of the plan (the dry run: depth 2)
    cost_models: tuple              # (label as bench_prune_cost names it, timm name)
    cost_sizes: tuple
    calib: int                      # calibration images of the prunes
    batch_size: int                 # calibration batch
    table_batch: int
    precision: str                  # table and bench precision
    graphs: bool                    # CUDA graphs in the benches
    bench_batches: tuple            # speed-up batch sizes (the table's first)
    iterations: int
    warmup: int
    table_iterations: int
    table_warmup: int
    table_max_seconds: float
    modes: tuple                    # (precision, cuda graphs) of runner_modes
    modes_batch: int
    heal_model: str
    heal_images: int
    heal_batch: int
    threads: int | None
    budgets: dict
    latency_budget: float = 0.6     # latency_prune's --latency
    speedup_latency: float = 0.5    # speedup's --latency (against --flops 0.5)
    judge_timing: bool = True       # a missed latency budget fails latency_prune (not on the dry run's tiny model,
    #                                 where per-op overheads dominate and the load of a shared CPU decides)
    correction_rounds: int | None = None  # --latency-rounds (None: the default)
    num_classes: int | None = None  # classifier outputs of every model (None: timm's 1000)


GPU = Plan(
    mode="gpu", device="cuda", model="deit_small_patch16_224", img_size=None, model_kwargs={},
    cost_models=(("deit_small", "deit_small_patch16_224"), ("deit_base", "deit_base_patch16_224")),
    cost_sizes=(256, 1024), calib=256, batch_size=32, table_batch=256, precision="fp16", graphs=True,
    bench_batches=(256, 1), iterations=50, warmup=10, table_iterations=50, table_warmup=10, table_max_seconds=0.4,
    modes=tuple((p, g) for p in ("fp32", "tf32", "fp16", "bf16") for g in (False, True)), modes_batch=64,
    heal_model="deit_tiny_patch16_224", heal_images=128, heal_batch=32, threads=None,
    # estimates (not yet run on a GPU); their sum is above DEADLINE_S, which bounds the whole run
    budgets={"cuda_tests": 75, "runner_modes": 25, "heal_resume": 25, "cli_cuda": 20, "prune_cost": 100,
             "latency_table": 45, "latency_prune": 90, "speedup": 90, "layout": 30},
)
DRY = Plan(
    mode="dry-run", device="cpu", model="deit_tiny_patch16_224", img_size=32,
    model_kwargs={"depth": 2, "embed_dim": 64, "num_heads": 2}, num_classes=10,
    cost_models=(("tiny", "deit_tiny_patch16_224"),), cost_sizes=(8, 16), calib=16, batch_size=8,
    table_batch=2, precision="fp32", graphs=False, bench_batches=(2, 1), iterations=5, warmup=1,
    table_iterations=5, table_warmup=1, table_max_seconds=0.05, modes=(("fp32", False),), modes_batch=2,
    heal_model="deit_tiny_patch16_224", heal_images=16, heal_batch=8, threads=1,
    # generous: the rehearsal runs in the test suite, next to other load; the budget mechanism is tested alone
    budgets={"cuda_tests": 240, "runner_modes": 120, "heal_resume": 120, "cli_cuda": 120, "latency_table": 120,
             "latency_prune": 120, "speedup": 180, "layout": 120, "prune_cost": 120},
    latency_budget=0.9, speedup_latency=0.9, judge_timing=False, correction_rounds=1,
)
#: the modes runner_modes would run on a GPU (the dry run records the others as skipped)
ALL_MODES = GPU.modes
#: relative logit error allowed against the CPU fp32 model, per precision
MODE_TOLERANCE = {"fp32": 1e-3, "tf32": 2e-2, "fp16": 2e-2, "bf16": 1e-1}

#: the docs' "not measured on a GPU": (doc, its phrase, the check(s) that answer it, or "- (why not here)")
TODOS = (
    ("docs/prune_cost.md", "GPU rows: not yet measured", "prune_cost"),
    ("docs/prune_cost.md", "CUDA deit_small / deit_base, 256 and 1024 images, <= 3x | not yet measured", "prune_cost"),
    ("docs/prune_cost.md", "GPU timings: not yet measured", "prune_cost"),
    ("docs/prune_cost.md", "those tests skip without CUDA and have not been run on a GPU yet",
     "cuda_tests, heal_resume"),
    ("docs/prune_cost.md", "run on a GPU yet (none was available", "cuda_tests, cli_cuda"),
    ("docs/latency.md", "the torch CUDA (fp16, batch 256, CUDA graphs)", "latency_table"),
    ("docs/latency_budget.md", "torch CUDA tables / DeiT-B `--latency 0.6`", "latency_table, latency_prune"),
    ("docs/latency_budget.md", "1.41x on an H100", "speedup"),
    ("docs/layout.md", "**not measured on a GPU**", "layout"),
    ("docs/results.md", "**GPU rows: not yet measured**", "runner_modes, speedup, layout"),
    ("docs/latency.md", "**not measured** (no GPU / TensorRT", "- (TensorRT tables: needs TensorRT)"),
    ("docs/quantization.md", "kernel is not measured (no GPU)", "- (needs TensorRT)"),
    ("docs/quantization.md", "not measured (no TensorRT here)", "- (needs TensorRT)"),
    ("docs/quantization.md", "are not measured: this machine has no GPU", "- (needs TensorRT)"),
    ("docs/embed.md", "GPU: **not measured**", "- (needs the pretrained dinov2-s14-fmnist and its test images)"),
    ("docs/embed.md", "is the large GPU", "- (the embed slice's speed: not in these checks)"),
    ("docs/latency_pareto.md", "CUDA: not measured", "- (benchmarks/pareto.py on pretrained DINOv2)"),
    ("docs/prune_cost.md", "it was not built, as no GPU was available", "- (no code to measure)"),
)


class OverBudget(BaseException):
    """A check ran past its time budget (a BaseException: library code that catches Exception lets it pass)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`OverBudget` in the main thread after ``seconds`` (SIGALRM; between Python bytecodes, so a
    long native call finishes first)."""
    def on_alarm(signum, frame):
        raise OverBudget(f"over its time budget of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- shared helpers ------------------------------------------------------------------------------------

def make_model(plan: Plan, name: str | None = None):
    """(spec, eval-mode model with seeded random weights) of a timm name (default: the plan's model), at the
    plan's input size and keywords."""
    spec = get_model_spec(name or plan.model, random_init=True, num_classes=plan.num_classes, img_size=plan.img_size,
                          model_kwargs=plan.model_kwargs or None)
    return spec, spec.create(pretrained=False).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``edgeprune ARGV`` in this process (the CLI's own error handler): (exit code, stdout + stderr)."""
    from edgeprune.cli.main import main as cli_main

    buf = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            cli_main([str(a) for a in argv])
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    return code, buf.getvalue()


def cli_model_args(plan: Plan) -> list[str]:
    args = ["--model", plan.model, "--random-init"]
    if plan.img_size:
        args += ["--img-size", str(plan.img_size)]
    if plan.num_classes:
        args += ["--num-classes", str(plan.num_classes)]
    if plan.model_kwargs:
        args += ["--model-kwargs", ",".join(f"{k}={v}" for k, v in plan.model_kwargs.items())]
    return args


def write_profile(plan: Plan, folder: Path) -> Path:
    """A device profile for this machine with the GPU pruning rules (MLP widths on 64, head dims on 16, Q/K =
    V): a TensorRT-kind profile for this GPU (the torch backend times on CUDA for it), or on the dry run a CPU
    profile with the same rules."""
    rules = "[pruning]\nmlp_round_to = 64\nhead_dim_round_to = 16\nqk_equals_v = true\n"
    if plan.device == "cpu":
        text = ('[device]\nname = "gpu-check-dry-run"\nbackend = "onnxruntime"\n'
                f"[bench]\nbatch_sizes = [1, {plan.table_batch}]\nwarmup = 1\niterations = 5\n" + rules)
    else:
        major, minor = torch.cuda.get_device_capability(0)
        mem = max(1, int(torch.cuda.get_device_properties(0).total_memory // 2**30))
        b = plan.table_batch
        text = ('[device]\nname = "gpu-check"\nbackend = "tensorrt"\n'
                f'description = "{torch.cuda.get_device_name(0)} (benchmarks/gpu_check.py)"\n'
                f'compute_capability = "{major}.{minor}"\nmemory_gb = [{mem}]\n'
                f'[build]\nprecision = "fp16"\nworkspace_mib = 1024\ntiming_cache = "{folder / "timing.cache"}"\n'
                f"batch = {{ min = 1, opt = {b}, max = {b} }}\n"
                f"[bench]\nbatch_sizes = [1, {b}]\nwarmup = 10\niterations = 50\ncuda_graphs = true\n" + rules)
    path = folder / "gpu_check_profile.toml"
    atomic_write_text(path, text)
    return path


def runner(model, plan: Plan, label: str, input_shape, precision: str | None = None,
           graphs: bool | None = None) -> TorchRunner:
    """A torch runner of a copy of ``model`` on the plan's device (the runner casts and moves its model)."""
    return TorchRunner(copy.deepcopy(model), device=plan.device, threads=plan.threads, label=label,
                       input_shape=tuple(input_shape), precision=precision or plan.precision,
                       cuda_graphs=plan.graphs if graphs is None else graphs)


def bench_vs_dense(dense, pruned: dict[str, tuple[Any, dict]], plan: Plan, input_shape,
                   batches, out: list) -> None:
    """Append one row per (pruned model, batch size) to ``out``: interleaved dense vs pruned speed-up (median
    and p10-p90 of the per-pair ratios), the FLOPs ratio and the attention kernels."""
    for name, (model, record) in pruned.items():
        ra, rb = runner(dense, plan, "dense", input_shape), runner(model, plan, name, input_shape)
        try:
            for res in bench_pair(ra, rb, list(batches), iterations=plan.iterations, warmup=plan.warmup):
                flops = record["flops"] / record["dense_flops"]
                lr = res.latency_ratio
                out.append({"model": name, "batch": res.batch_size, "dense_ms": res.a.latency_ms["p50"],
                            "pruned_ms": res.b.latency_ms["p50"], "speedup": lr["median"], "p10": lr["p10"],
                            "p90": lr["p90"], "flops_ratio": flops, "of_flops_ratio": lr["median"] * flops,
                            "kernel_dense": res.a.settings.get("attention_kernel"),
                            "kernel_pruned": res.b.settings.get("attention_kernel")})
        finally:
            ra.close()
            rb.close()


def prune_timed(model, calib, spec, plan: Plan, **settings) -> tuple[Any, dict, float]:
    if "latency" in settings and plan.correction_rounds is not None:
        settings["correction_rounds"] = plan.correction_rounds
    t0 = time.perf_counter()
    res = prune(model, calib, spec=spec, device=plan.device, batch_size=plan.batch_size, **settings)
    return res.model, res.record, time.perf_counter() - t0


@dataclasses.dataclass
class Ctx:
    """What the checks share: the plan, the output folder, the profile and table paths."""

    plan: Plan
    folder: Path
    profile: Path | None = None
    table: Path | None = None


# -- the checks: each fills ``d`` (its details, kept when it fails) and returns (status, the number) ------

def cuda_test_ids(root: Path = common.REPO) -> list[str]:
    """pytest ids (``tests/f.py::name``) of the test functions that skip without CUDA: decorated with a
    ``skipif(not ... cuda.is_available() ...)`` (directly or through a module-level name bound to one) or with
    ``pytest.mark.gpu``."""
    def cuda_skip(src: str) -> bool:
        return "skipif" in src and re.search(r"not\s+torch\.cuda\.is_available\(\)", src) is not None

    ids = []
    for f in sorted((root / "tests").glob("test_*.py")):
        tree = ast.parse(f.read_text(), str(f))
        marks = {t.id for node in tree.body if isinstance(node, ast.Assign) and cuda_skip(ast.unparse(node.value))
                 for t in node.targets if isinstance(t, ast.Name)}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                decos = [ast.unparse(d) for d in node.decorator_list]
                if any(d in marks or cuda_skip(d) or d == "pytest.mark.gpu" for d in decos):
                    ids.append(f"{f.relative_to(root).as_posix()}::{node.name}")
    return ids


def check_cuda_tests(ctx: Ctx, d: dict) -> tuple[str, str]:
    ids = cuda_test_ids()
    d["tests"] = ids
    if not ids:
        return "fail", "no CUDA test found in tests/"
    if importlib.util.find_spec("pytest") is None:
        return "skipped", "pytest is not installed here (pip install pytest)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *ids]
    proc = subprocess.run(cmd, cwd=common.REPO, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    d.update(returncode=proc.returncode, output_tail=tail[-30:])
    last = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed|skipped|errors?)", line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", last)}
    d["counts"] = counts
    bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    number = ", ".join(f"{n} {k}" for k, n in counts.items()) or f"pytest exit {proc.returncode}"
    if bad or proc.returncode not in (0, 5) or not counts:
        return "fail", number
    return ("pass" if counts.get("passed") else "skipped"), f"{number} ({len(ids)} CUDA tests)"


def check_runner_modes(ctx: Ctx, d: dict) -> tuple[str, str]:
    plan = ctx.plan
    spec, model = make_model(plan)
    x = common.noise(spec, plan.modes_batch, 1)
    with torch.no_grad():
        ref = model(x).double()
    rows, bad = [], []
    d["rows"] = rows
    for precision, graphs in ALL_MODES:
        if (precision, graphs) not in plan.modes:
            rows.append({"precision": precision, "graphs": graphs, "status": "skipped", "why": "needs CUDA"})
            continue
        r = runner(model, plan, f"{precision}{'+graphs' if graphs else ''}", spec.input_size, precision, graphs)
        try:
            out = torch.from_numpy(r.infer(x.numpy())).double()
            (res,) = r.benchmark([plan.modes_batch], iterations=plan.iterations, warmup=plan.warmup, inputs=x)
        finally:
            r.close()
        rel = float((out - ref).norm() / ref.norm())
        agree = float((out.argmax(-1) == ref.argmax(-1)).double().mean())
        ok = bool(torch.isfinite(out).all()) and rel <= MODE_TOLERANCE[precision]
        rows.append({"precision": precision, "graphs": graphs, "status": "pass" if ok else "fail", "rel_error": rel,
                     "tolerance": MODE_TOLERANCE[precision], "top1_agreement": agree,
                     "p50_ms": res.latency_ms["p50"], "kernel": res.settings.get("attention_kernel")})
        if not ok:
            bad.append(f"{precision}{'+graphs' if graphs else ''} rel {rel:.1e}")
    ran = [r for r in rows if r["status"] != "skipped"]
    worst = max(ran, key=lambda r: r["rel_error"] / r["tolerance"])
    number = (f"{len(ran)} mode(s) at batch {plan.modes_batch}; worst {worst['precision']} rel error "
              f"{worst['rel_error']:.1e} (<= {worst['tolerance']:g})")
    skipped = len(rows) - len(ran)
    return ("fail", "; ".join(bad)) if bad else ("pass", number + (f"; {skipped} need CUDA" if skipped else ""))


def check_heal_resume(ctx: Ctx, d: dict) -> tuple[str, str]:
    plan = ctx.plan
    spec, dense = make_model(plan, plan.heal_model)
    calib = common.noise(spec, plan.heal_images, 2)
    pruned = prune(dense, calib, target="both", sparsity=0.5, compensation=False, device=plan.device).model
    kw = dict(epochs=2, batch_size=plan.heal_batch, lr=1e-3, warmup_steps=0, device=plan.device)
    t0 = time.perf_counter()
    full = heal(pruned, dense, calib, **kw)
    d["heal_s"] = time.perf_counter() - t0
    again = heal(pruned, dense, calib, **kw)

    class Stop(Exception):
        pass

    def stop(epoch, stats):
        raise Stop

    with tempfile.TemporaryDirectory(dir=ctx.folder, prefix="heal-checkpoint-") as ck:
        with contextlib.suppress(Stop):
            heal(pruned, dense, calib, checkpoint_dir=ck, callback=stop, **kw)
        resumed = heal(pruned, dense, calib, checkpoint_dir=ck, **kw)
    sf, sa, sr = (m.state_dict() for m in (full.model, again.model, resumed.model))
    diff_again = max(float((sf[k].double() - sa[k].double()).abs().max()) for k in sf)
    diff_resumed = max(float((sf[k].double() - sr[k].double()).abs().max()) for k in sf)
    same_loss = [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    d.update(device=full.info["device"], resumed_from_epoch=resumed.info.get("resumed_from_epoch"),
             max_abs_diff_repeat=diff_again, max_abs_diff_resumed=diff_resumed, same_loss_history=same_loss,
             losses=[h["loss"] for h in full.history])
    ok = d["resumed_from_epoch"] == 1 and diff_again == 0.0 and diff_resumed == 0.0 and same_loss
    return ("pass" if ok else "fail"), (f"on {d['device']}: resumed from epoch {d['resumed_from_epoch']}, max |diff| "
                                        f"resumed {diff_resumed:.1e}, repeated {diff_again:.1e}, "
                                        f"loss history {'equal' if same_loss else 'DIFFERENT'}")


def check_cli_cuda(ctx: Ctx, d: dict) -> tuple[str, str]:
    plan = ctx.plan
    onnx, rep, bench = ctx.folder / "cli_tiny.onnx", ctx.folder / "cli_verify.json", ctx.folder / "cli_bench.json"
    tiny = ["--model", "deit_tiny_patch16_224", "--random-init", "--model-kwargs", "depth=1"]
    code, text = run_cli(["export", *tiny, "-o", onnx, "--force"])
    d["export"] = {"exit": code, "output": text[-2000:]}
    if code:
        return "fail", f"edgeprune export exit {code}: {text.strip().splitlines()[-1:]}"
    code, text = run_cli(["verify", onnx, *tiny, "--n", "2", "--device", plan.device, "--json", rep])
    d["verify"] = {"exit": code, "output": text[-2000:]}
    got = json.loads(rep.read_text()).get("torch_device") if rep.exists() else None
    code2, text2 = run_cli(bench_argv(ctx, bench))
    d["bench"] = {"exit": code2, "output": text2[-2000:]}
    settings = {}
    if bench.exists():
        doc = json.loads(bench.read_text())
        d["bench"]["json_keys"] = sorted(doc)
        settings = _first_settings(doc)
    where = settings.get("gpu") or settings.get("cpu")
    ok = code == 0 and got == plan.device and code2 == 0 and where is not None
    return ("pass" if ok else "fail"), (f"verify --device {plan.device}: exit {code}, torch_device {got}; bench torch "
                                        f"{plan.precision}{' graphs' if plan.graphs else ''}: exit {code2} on {where}")


def bench_argv(ctx: Ctx, json_path: Path) -> list:
    """``edgeprune bench`` of a model name with the torch backend on the plan's profile (CUDA for the GPU one)."""
    plan = ctx.plan
    return ["bench", "deit_tiny_patch16_224", "--random-init", "--device", ctx.profile, "--backend", "torch",
            "--precision", plan.precision, "--batch-sizes", "1", "--iterations", "5", "--warmup", "1",
            "--json", json_path, *(["--cuda-graphs"] if plan.graphs else []),
            *(["--threads", str(plan.threads)] if plan.threads else [])]


def _first_settings(doc: Any) -> dict:
    """The first ``settings`` dict found in a bench JSON (its layout: results per model and batch)."""
    if isinstance(doc, dict):
        if isinstance(doc.get("settings"), dict):
            return doc["settings"]
        items = doc.values()
    elif isinstance(doc, list):
        items = doc
    else:
        return {}
    for v in items:
        found = _first_settings(v)
        if found:
            return found
    return {}


def check_latency_table(ctx: Ctx, d: dict) -> tuple[str, str]:
    path = ctx.folder / "latency_table.json"
    path.unlink(missing_ok=True)  # a fresh measurement (the same key would resume the old table)
    argv = table_argv(ctx, path)
    t0 = time.perf_counter()
    code, text = run_cli(argv)
    d.update(command="edgeprune " + " ".join(str(a) for a in argv), exit=code, output=text.strip()[-2000:],
             seconds=time.perf_counter() - t0)
    if code:
        return "fail", f"edgeprune latency-table exit {code}: {text.strip().splitlines()[-1:]}"
    t = LatencyTable.load(path)
    k, dense = t.key, t.dense_dims()
    full_attn, full_mlp = t.attn_ms(k["num_heads"], k["head_dim"], k["head_dim"]), t.mlp_ms(k["mlp_hidden"])
    half_h, half_d = max(1, k["num_heads"] // 2), _on(t.attn["qk"], k["head_dim"] // 2)
    half_m = _on(t.mlp["widths"], k["mlp_hidden"] // 2)
    # what half of each structure costs, against the ideal (the kept fraction): 1.0 = time follows the size
    d["half"] = {
        "heads": {"kept": half_h / k["num_heads"], "time": t.attn_ms(half_h, k["head_dim"], k["head_dim"]) / full_attn},
        "head_dims": {"kept": half_d / k["head_dim"], "time": t.attn_ms(k["num_heads"], half_d, half_d) / full_attn},
        "mlp": {"kept": half_m / k["mlp_hidden"], "time": t.mlp_ms(half_m) / full_mlp}}
    for v in d["half"].values():
        v["of_ideal"] = (1 - v["time"]) / (1 - v["kept"])  # saved time / saved size
    n = len(t.measured["mlp"]) + len(t.measured["attn"])
    d.update(key=k, entries=n, dense_model_ms=t.dense_model_ms, block_ms=t.block_ms(dense), fixed_ms=t.fixed_ms,
             complete=t.complete)
    ctx.table = path if ctx.plan.judge_timing else sized_table(t, ctx.folder / "latency_table_sized.json")
    h = d["half"]
    return ("pass" if t.complete else "fail"), (
        f"{n} entries, {k['device_name']}, {k['precision']} batch {k['batch']}: dense {t.dense_model_ms:.2f} ms; "
        f"saved vs ideal at half: heads {h['heads']['of_ideal']:.0%}, head dims {h['head_dims']['of_ideal']:.0%}, "
        f"MLP {h['mlp']['of_ideal']:.0%}")


def sized_table(t: LatencyTable, path: Path) -> Path:
    """The dry run's table for the latency prunes: ``t`` with every time replaced by one that follows the kept sizes
    (a sub-block at fraction f of its dense size costs ``(0.2 + 0.8 f)`` x its measured dense time; no in-model
    correction; the measured table's self-check and in-model costs left out: they describe its times), saved at
    ``path``. A tiny model timed on a shared CPU is all per-op overhead: its measured table can
    price the cheapest allocation above the dense model, and whether it does depends on the machine's load (issue 52:
    ``--latency 1.005`` asked, refused). The measured table is still built and checked by ``latency_table``; the prunes
    that follow get this one, whose branch no load can flip."""
    k = t.key
    full_mlp = t.mlp_ms(k["mlp_hidden"])
    full_attn = t.attn_ms(k["num_heads"], k["head_dim"], k["head_dim"])
    heads, qk, v = t.attn["heads"], t.attn["qk"], t.attn["v"]
    size = lambda f: 0.2 + 0.8 * f  # noqa: E731
    mlp = {**t.mlp, "ms": [full_mlp * size(w / k["mlp_hidden"]) for w in t.mlp["widths"]]}
    attn = {**t.attn, "ms": [[[None if t.attn["ms"][i][j][m] is None else
                               full_attn * size(h * (q + u) / (2 * k["num_heads"] * k["head_dim"]))
                               for m, u in enumerate(v)] for j, q in enumerate(qk)] for i, h in enumerate(heads)]}
    meta = {key: value for key, value in t.meta.items() if key != "self_check"}  # the measured table's
    meta["parts"] = {key: value for key, value in meta.get("parts", {}).items()  # its timings, not what they gave
                     if not key.startswith("per_block") and key not in ("calls", "shape_change")}
    sized = dataclasses.replace(t, mlp=mlp, attn=attn, block_overhead_ms=0.0, block_scale=1.0, block_points=None,
                                block_surface=None, shape_change=None, meta={**meta, "sized_for_dry_run": True})
    sized.dense_model_ms = sized.dense_ms()
    atomic_write_text(path, json.dumps(sized.to_dict()))
    LatencyTable.load(path)  # the same schema check as any table
    return path


def table_argv(ctx: Ctx, path: Path) -> list:
    """``edgeprune latency-table`` of the plan's model on the plan's profile: torch backend, the plan's precision
    and batch, interleaved with the dense sub-block (docs/latency.md: on a GPU, use --interleave)."""
    plan = ctx.plan
    return ["latency-table", *cli_model_args(plan), "--device", ctx.profile, "--backend", "torch",
            "--precision", plan.precision, "--batch", str(plan.table_batch), "--warmup", str(plan.table_warmup),
            "--iterations", str(plan.table_iterations), "--max-seconds", str(plan.table_max_seconds),
            "--interleave", "-o", path, "--force", "--quiet",
            *(["--threads", str(plan.threads)] if plan.threads else [])]


def _on(grid: list, x: int) -> int:
    """The grid point nearest ``x``."""
    return min(grid, key=lambda g: abs(g - x))


def latency_value(ctx: Ctx, model, value: float) -> float:
    """The ``--latency`` fraction to ask: ``value``; on the dry run (a tiny model timed on a shared CPU, where
    per-op overheads dominate) at least halfway between the table's cheapest allocation and the dense model, so
    that the budget is reachable whatever the load did to the table."""
    if ctx.plan.judge_timing:
        return value
    cfg = corp_config(None, None, latency=value, latency_table=str(ctx.table))
    floor, dense, _target = cheapest(find_anatomy(model), cfg)
    return round(max(value, (1 + floor / dense) / 2), 3)


def _need_table(ctx: Ctx) -> str | None:
    return None if ctx.table is not None else "no latency table (the latency_table check did not make one)"


def check_latency_prune(ctx: Ctx, d: dict) -> tuple[str, str]:
    if _need_table(ctx):
        return "skipped", _need_table(ctx)
    plan = ctx.plan
    spec, model = make_model(plan)
    value = latency_value(ctx, model, plan.latency_budget)
    calib = common.noise(spec, plan.calib, 0)
    _m, rec, seconds = prune_timed(model, calib, spec, plan, latency=value, latency_table=str(ctx.table))
    chk = rec.get("latency_check") or {}
    d.update(budget=value, prune_s=seconds, latency_check=chk, flops_ratio=rec["flops"] / rec["dense_flops"])
    if not chk.get("measured"):
        return "fail", f"not measured: {chk.get('not_measured')}"
    r0 = (chk.get("rounds") or [{}])[0]
    kept = chk["measured"]["ratio"]
    number = (f"--latency {value}: round 0 predicted x{r0.get('predicted', float('nan')):.3f}, measured "
              f"x{r0.get('measured', float('nan')):.3f}; kept round {chk.get('chosen_round')} of "
              f"{len(chk.get('rounds', []))}: measured x{kept:.3f} ({100 * chk['miss']:+.1f}%, {chk.get('stopped')})")
    if not plan.judge_timing:
        return "pass", number + " (not judged: tiny model on a CPU)"
    return ("pass" if chk.get("meets_budget") else "fail"), number


def check_speedup(ctx: Ctx, d: dict) -> tuple[str, str]:
    if _need_table(ctx):
        return "skipped", _need_table(ctx)
    plan = ctx.plan
    spec, model = make_model(plan)
    latency = latency_value(ctx, model, plan.speedup_latency)
    calib = common.noise(spec, plan.calib, 0)
    pruned, d["prune_s"], rows = {}, {}, []
    d["rows"] = rows
    for name, kw in ((f"flops {0.5}", {"flops": 0.5}),
                     (f"latency {latency}", {"latency": latency, "latency_table": str(ctx.table)})):
        m, rec, d["prune_s"][name] = prune_timed(model, calib, spec, plan, **kw)
        pruned[name] = (m, rec)
    bench_vs_dense(model, pruned, plan, spec.input_size, plan.bench_batches, rows)
    by = {(r["model"], r["batch"]): r for r in rows}
    parts = [f"batch {b}: " + ", ".join(f"{n} {by[(n, b)]['speedup']:.2f}x (FLOPs x{by[(n, b)]['flops_ratio']:.2f})"
                                        for n in pruned) for b in plan.bench_batches]
    ok = all(r["speedup"] > 0 and r["pruned_ms"] > 0 for r in rows) and len(rows) == 2 * len(plan.bench_batches)
    return ("pass" if ok else "fail"), f"{plan.precision}{' graphs' if plan.graphs else ''}; " + "; ".join(parts)


def check_layout(ctx: Ctx, d: dict) -> tuple[str, str]:
    plan = ctx.plan
    spec, model = make_model(plan)
    calib = common.noise(spec, plan.calib, 0)
    pruned, rows = {}, []
    d["rows"] = rows
    for layout in ("default", "fused"):
        m, rec, _s = prune_timed(model, calib, spec, plan, target="all", sparsity=0.5, layout=layout)
        pruned[f"all@0.5 {layout}"] = (m, rec)
    bench_vs_dense(model, pruned, plan, spec.input_size, plan.bench_batches[:1], rows)
    fused = next(r for r in rows if r["model"].endswith("fused"))
    d["fused_reaches_90pct"] = fused["of_flops_ratio"] >= 0.9
    parts = [f"{r['model'].split()[-1]} {r['speedup']:.2f}x = {r['of_flops_ratio']:.0%} of the FLOPs ratio "
             f"({r['kernel_pruned']})" for r in rows]
    return "pass", f"batch {plan.bench_batches[0]} {plan.precision}: " + "; ".join(parts)


def check_prune_cost(ctx: Ctx, d: dict) -> tuple[str, str]:
    plan = ctx.plan
    dev = torch.device(plan.device)
    args = SimpleNamespace(sparsity=0.5, qk_solver="auto", batch_size=32, gram_tokens_now=None)
    rows = []
    d["rows"] = rows
    for label, name in plan.cost_models:
        spec, model = make_model(plan, name)
        for n in plan.cost_sizes:
            images = common.noise(spec, n, 0)
            bench_prune_cost.dense_pass(model, images[:args.batch_size], args.batch_size, dev)  # warm-up, untimed
            dense_s, dense_cpu = bench_prune_cost.dense_pass(model, images, args.batch_size, dev)
            p = bench_prune_cost.one_prune(model, spec, images, args, dev)
            row = {"model": label, "images": n, "threads": torch.get_num_threads(), "device": str(dev),
                   "sparsity": 0.5, "qk_solver": "auto", "gram_tokens": None, "dense_s": dense_s, **p,
                   "ratio": p["prune_s"] / dense_s, "cpu_ratio": p["prune_cpu_s"] / max(dense_cpu, 1e-9)}
            row["bound"] = bench_prune_cost.bound_for(row)
            row["verdict"] = bench_prune_cost.verdict(row)
            rows.append(row)
    worst = max(rows, key=lambda r: r["ratio"])
    missed = [r for r in rows if r["bound"] is not None and r["ratio"] > r["bound"]]
    bounded = [r for r in rows if r["bound"] is not None]
    number = (", ".join(f"{r['model']} {r['images']}: {r['ratio']:.2f}x" for r in rows)
              + (f" (bound <= {bounded[0]['bound']:g}x)" if bounded else f" (no bound on {dev.type}; worst "
                                                                           f"{worst['ratio']:.2f}x)"))
    return ("fail" if missed else "pass"), number


#: the checks in the order they run (cheap ones first; the layouts, the least asked for, last: the deadline cuts
#: the end)
CHECKS: tuple[tuple[str, Callable[[Ctx, dict], tuple[str, str]]], ...] = (
    ("cuda_tests", check_cuda_tests), ("runner_modes", check_runner_modes), ("heal_resume", check_heal_resume),
    ("cli_cuda", check_cli_cuda), ("prune_cost", check_prune_cost), ("latency_table", check_latency_table),
    ("latency_prune", check_latency_prune), ("speedup", check_speedup), ("layout", check_layout))


def run_check(fn: Callable[[Ctx, dict], tuple[str, str]], ctx: Ctx, budget: float) -> dict:
    """One check under its time budget; an exception (or the budget running out) is a failure with its message
    and traceback, and the details the check had filled so far."""
    d: dict = {}
    t0 = time.perf_counter()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # runners set them process-wide
    try:
        with time_limit(budget):
            status, number = fn(ctx, d)
    except OverBudget as err:
        status, number = "fail", str(err)
    except Exception as err:  # noqa: BLE001 -- recorded; the other checks go on
        first = (str(err).strip().splitlines() or [""])[0]
        status, number = "fail", f"{type(err).__name__}: {first}"[:300]
        d["traceback"] = traceback.format_exc()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        if ctx.plan.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if status not in STATUSES:
        status, number = "fail", f"bad status {status!r}: {number}"
    return {"status": status, "number": number, "seconds": time.perf_counter() - t0, "budget_s": budget,
            "details": d}


def _squash(text: str) -> str:
    return " ".join(text.split())


def todo_rows() -> list[dict]:
    """:data:`TODOS` with whether each phrase is still in its doc (whitespace-insensitive)."""
    rows = []
    for doc, phrase, check in TODOS:
        path = common.REPO / doc
        present = path.exists() and _squash(phrase) in _squash(path.read_text())
        rows.append({"doc": doc, "says": phrase, "check": check, "still_in_doc": present})
    return rows


def _fmt(v: Any, spec: str = ".3g") -> str:
    """A table cell (``|`` escaped)."""
    text = format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
    return text.replace("|", "\\|")


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> list[str]:
    """Markdown table of ``rows`` with columns (header, key, format)."""
    out = ["| " + " | ".join(h for h, _k, _f in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(k, "-"), f) for _h, k, f in cols) + " |" for r in rows
            if isinstance(r, dict)]
    return out


SPEED_COLS = [("model", "model", ""), ("batch", "batch", ""), ("dense ms", "dense_ms", ".3f"),
              ("pruned ms", "pruned_ms", ".3f"), ("speed-up", "speedup", ".3f"), ("p10", "p10", ".3f"),
              ("p90", "p90", ".3f"), ("FLOPs x", "flops_ratio", ".3f"), ("speed-up x FLOPs", "of_flops_ratio", ".2f"),
              ("kernel (dense)", "kernel_dense", ""), ("kernel (pruned)", "kernel_pruned", "")]


def markdown(doc: dict) -> str:
    """The report: one row per check, then the measured tables, the failures, and the docs' TODOs."""
    dry = doc["mode"] == "dry-run"
    lines = ["# GPU check (`benchmarks/gpu_check.py`)", "",
             f"Command: `python benchmarks/gpu_check.py {' '.join(doc['argv'])}`", "",
             f"Mode: **{doc['mode']}**" + (" -- CPU, tiny models and sizes: the steps are exercised, no number here "
                                           "is a GPU measurement." if dry else "") + f" GPU: {doc['gpu']}; "
             f"torch {doc['torch']} (CUDA {doc['cuda']}); {doc['machine']}; {doc['created']}.", "",
             "| check | status | result | s (budget) |", "|---|---|---|---|"]
    checks = doc["checks"]
    lines += [f"| {n} | {c['status']} | {_fmt(c['number'])} | {c['seconds']:.0f} ({c['budget_s']:.0f}) |"
              for n, c in checks.items()]
    det = {n: c["details"] for n, c in checks.items()}
    if det.get("prune_cost", {}).get("rows"):
        lines += ["", "## prune_cost: prune vs one dense pass", ""] + _table(det["prune_cost"]["rows"], [
            ("model", "model", ""), ("images", "images", ""), ("dense s", "dense_s", ".2f"),
            ("prune s", "prune_s", ".2f"), ("statistics s", "statistics_s", ".2f"), ("solve s", "solve_s", ".2f"),
            ("ratio", "ratio", ".2f"), ("peak GPU MiB", "peak_gpu_mb", ".0f"), ("bound", "verdict", "")])
    for name, title in (("speedup", "speed-up over the dense model"), ("layout", "layouts")):
        if det.get(name, {}).get("rows"):
            lines += ["", f"## {name}: {title}", ""] + _table(det[name]["rows"], SPEED_COLS)
    rounds = det.get("latency_prune", {}).get("latency_check", {}).get("rounds")
    if rounds:
        lines += ["", "## latency_prune: the measure-and-correct rounds (ratios to dense)", ""] + _table(rounds, [
            ("round", "round", ""), ("asked", "budget_value", ".4f"), ("predicted", "predicted", ".4f"),
            ("measured", "measured", ".4f"), ("miss", "miss", "+.3f")])
    if det.get("runner_modes", {}).get("rows"):
        lines += ["", "## runner_modes", ""] + _table(det["runner_modes"]["rows"], [
            ("precision", "precision", ""), ("graphs", "graphs", ""), ("status", "status", ""),
            ("rel. error", "rel_error", ".2e"), ("tolerance", "tolerance", "g"), ("top-1 agreement", "top1_agreement",
                                                                                  ".3f"),
            ("p50 ms", "p50_ms", ".3f"), ("kernel", "kernel", "")])
    failed = [(n, c) for n, c in checks.items() if c["details"].get("traceback")]
    for n, c in failed:
        lines += ["", f"## {n}: traceback", "", "```", *c["details"]["traceback"].strip().splitlines()[-12:], "```"]
    lines += ["", "## The docs' GPU TODOs and the check that answers each", ""]
    lines += _table(doc["todos"], [("doc", "doc", ""), ("says", "says", ""), ("answered by", "check", ""),
                                   ("phrase still in the doc", "still_in_doc", "")])
    return "\n".join(lines) + "\n"


def write_reports(ctx: Ctx, results: dict, argv: list[str]) -> None:
    gpu = torch.cuda.get_device_name(0) if ctx.plan.device.startswith("cuda") else "none (CPU dry run)"
    payload = {"mode": ctx.plan.mode, "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
               "plan": dataclasses.asdict(ctx.plan), "checks": results, "todos": todo_rows()}
    path = common.write_json(ctx.folder / "gpu_check.json", payload, "gpu_check", argv)
    doc = json.loads(path.read_text())
    try:
        text = markdown(doc)
    except Exception as err:  # noqa: BLE001 -- the JSON holds everything; the summary must still be written
        text = markdown({**doc, "checks": {n: {**c, "details": {}} for n, c in doc["checks"].items()}})
        text += f"\n(details not rendered: {type(err).__name__}: {err})\n"
    atomic_write_text(ctx.folder / "gpu_check.md", text)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="the same steps on the CPU with tiny models and sizes (no GPU needed; a test runs it)")
    ap.add_argument("--out", default="runs/gpu_check", help="folder of gpu_check.json and gpu_check.md")
    ap.add_argument("--only", default=None, help=f"comma list of checks [all: {', '.join(n for n, _ in CHECKS)}]")
    ap.add_argument("--model", default=None,
                    help="timm name of the table / latency / speed-up / layout / modes model [deit_small_patch16_224]")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help="seconds after which no further check starts [%(default)s]")
    return ap.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[Ctx, list[str]]:
    """The context and the checks to run; every option checked before any work.

    Raises:
        UserError: no CUDA without --dry-run, an unknown check, a bad deadline, an --out that is a file.
    """
    names = [n for n, _ in CHECKS]
    only = common.names(args.only) if args.only is not None else names
    unknown = [n for n in only if n not in names]
    if unknown or not only:
        raise UserError(f"--only: unknown check {', '.join(unknown) or '(none given)'} (one of {', '.join(names)})")
    if not args.deadline > 0 or args.deadline != args.deadline or args.deadline == float("inf"):
        raise UserError(f"--deadline must be a positive number of seconds, got {args.deadline}")
    if not args.dry_run and not torch.cuda.is_available():
        raise UserError("no CUDA GPU here (torch.cuda.is_available() is false): run this on a machine with an NVIDIA "
                        "GPU, or add --dry-run for the CPU rehearsal with tiny sizes")
    folder = Path(args.out)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out {args.out} is a file; give a folder")
    plan = DRY if args.dry_run else GPU
    if args.model:
        plan = dataclasses.replace(plan, model=args.model)
    folder.mkdir(parents=True, exist_ok=True)
    return Ctx(plan=plan, folder=folder), [n for n in names if n in only]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ctx, selected = setup(args)
    argv = list(sys.argv[1:] if argv is None else argv)
    if ctx.plan.threads:
        torch.set_num_threads(ctx.plan.threads)
    ctx.profile = write_profile(ctx.plan, ctx.folder)
    results: dict[str, dict] = {}
    start = time.perf_counter()
    for name, fn in CHECKS:
        if name not in selected:
            continue
        left = args.deadline - (time.perf_counter() - start)
        budget = min(float(ctx.plan.budgets[name]), left)
        if left < MIN_START_S:
            results[name] = {"status": "skipped", "number": f"not started: {left:.0f} s left of the run's deadline of "
                             f"{args.deadline:.0f} s", "seconds": 0.0, "budget_s": 0.0, "details": {}}
        else:
            common.log(f"gpu_check: {name} (budget {budget:.0f} s) ...")
            results[name] = run_check(fn, ctx, budget)
        r = results[name]
        print(f"{name}: {r['status']} -- {r['number']} ({r['seconds']:.0f} s)", flush=True)
        write_reports(ctx, results, argv)
    common.log(f"gpu_check: {ctx.folder / 'gpu_check.json'}, {ctx.folder / 'gpu_check.md'} "
               f"({time.perf_counter() - start:.0f} s)")
    return 1 if any(r["status"] == "fail" for r in results.values()) else 0


if __name__ == "__main__":
    common.run_main(main)
