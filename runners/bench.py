"""The one bench path: a device profile's settings, interleaved A/B timing, a report that says what ran.

``edgeprune bench A [--vs B] --device PROFILE`` and the tools go through here:

1. :func:`resolve_config` merges the profile's settings (backend, threads, batch sizes, warm-up,
   iterations, CUDA graphs, precision) with the options given explicitly (which win) into a
   :class:`BenchConfig` that validates itself once and remembers where each value came from.
2. :func:`check_available` refuses, before anything is loaded, a profile whose backend cannot
   run here (TensorRT or CUDA missing): a one-line :class:`~edgeprune.errors.RuntimeFault`,
   never a silent fallback to the host CPU.
3. :func:`run_bench` builds the runners through :func:`runners.registry.make_runner` (an ONNX
   file on a TensorRT profile is first built into a temporary engine), benchmarks A alone or A
   and B interleaved (:func:`runners.compare.bench_pair`), and returns a :class:`BenchReport`
   holding the profile, the config (``dataclasses.asdict``) and the results.

Which backend runs a target (``backend="auto"``): an ``.onnx`` file runs on the profile's
backend (``onnxruntime`` for ``cpu``, ``tensorrt`` for GPU profiles); an engine on ``tensorrt``;
a run directory or model name on ``torch`` (on CUDA for a GPU profile).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import tempfile
from pathlib import Path
from typing import Any

from devices import BenchSettings, ProfileError, load_profile, profile_from_record
from edgeprune.errors import RuntimeFault, UserError
from exporters.tensorrt import read_sidecar
from runners.compare import bench_pair, block_note
from runners.memory import memory_markdown, probe_memory
from runners.registry import DEFAULT_BACKEND, backend_available, backend_names, get_backend, target_kind
from runners.report import markdown_table, pair_markdown_table

#: precisions a bench may ask for: fp32/fp16/int8 for ONNX files (TensorRT build precision, or
#: for ONNX Runtime what the file must hold); fp32/tf32/fp16/bf16 for the torch runner (CUDA);
#: each backend says which of them it runs (:attr:`runners.registry.Backend.precisions`)
PRECISIONS = ("fp32", "fp16", "int8", "tf32", "bf16")
#: the settings a profile provides and an explicit option may override
PROFILE_FIELDS = ("backend", "threads", "batch_sizes", "warmup", "iterations", "cuda_graphs", "precision")
#: the default minimum block time, ms (issue 56 item 3): each timed turn runs a model back to back until it lasts this
#: long (``runners.compare`` module doc); 0: one run per turn
DEFAULT_MIN_BLOCK_MS = 25.0


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run uses; validated once, recorded as-is in the report.

    Attributes:
        profile: device profile name (``cpu``, ``orin-nx``, ...; or a user profile's name).
        backend: ``auto`` (per target, see the module doc) or a registered backend name.
        threads: intra-op threads for CPU backends (``None``: the backend's default).
        batch_sizes: images per inference, e.g. ``(1, 8)``.
        warmup: untimed inferences (pairs, with B) per batch size.
        iterations: timed inferences (pairs) per batch size.
        cuda_graphs: TensorRT (or torch on CUDA) replays a captured CUDA graph.
        precision: ``fp32``, ``fp16`` or ``int8``: the TensorRT build precision for an ONNX
            file; for ONNX Runtime what the file must be (``int8``: it has Q/DQ nodes; run as-is);
            for the torch runner (CUDA only unless fp32) ``fp32``, ``tf32``, ``fp16``, ``bf16``.
        provider: ONNX Runtime execution provider (``cpu``, ``cuda``, ``tensorrt``).
        random_init: model names without weights (latency only).
        min_block_ms: each timed turn is a block of back-to-back runs of one model lasting at least this long (ms;
            runs per block chosen in warm-up; its latency is block time / runs); 0: one run per turn.
        sources: setting -> ``"profile"``, ``"option"`` (given explicitly) or ``"default"``.

    Raises:
        UserError: on construction, for any invalid value.
    """

    profile: str
    backend: str = "auto"
    threads: int | None = None
    batch_sizes: tuple[int, ...] = (1, 8)
    warmup: int = 10
    iterations: int = 50
    cuda_graphs: bool = False
    precision: str = "fp32"
    provider: str = "cpu"
    random_init: bool = False
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    min_block_ms: float = DEFAULT_MIN_BLOCK_MS

    def __post_init__(self) -> None:
        if self.backend != "auto" and self.backend not in backend_names():
            raise UserError(f"unknown backend {self.backend!r} (auto, {', '.join(backend_names())})")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise UserError(f"threads must be >= 1, got {self.threads}")
        if not self.batch_sizes or any(int(b) < 1 for b in self.batch_sizes):
            raise UserError(f"batch sizes must be positive integers, got {list(self.batch_sizes)}")
        if self.warmup < 0 or self.iterations < 1:
            raise UserError(f"need iterations >= 1 and warmup >= 0, got {self.iterations}, {self.warmup}")
        if self.precision not in PRECISIONS:
            raise UserError(f"unknown precision {self.precision!r} (one of {', '.join(PRECISIONS)})")
        if (isinstance(self.min_block_ms, bool) or not isinstance(self.min_block_ms, (int, float))
                or not math.isfinite(self.min_block_ms) or self.min_block_ms < 0):
            raise UserError(f"--min-block-ms must be a number >= 0 (ms; 0: one run per turn), got {self.min_block_ms}")
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
        object.__setattr__(self, "min_block_ms", float(self.min_block_ms))

    def describe(self, profile_backend: str | None = None) -> str:
        """One line: each setting with where it came from, e.g. ``threads 1 [option]``.

        ``profile_backend`` (the profile's backend) spells out what ``auto`` means for .onnx files.
        """
        def show(key: str, value: Any) -> str:
            return f"{key.replace('_', ' ')} {value} [{self.sources.get(key, 'default')}]"

        backend = self.backend
        if backend == "auto" and profile_backend:
            backend = f"auto (.onnx -> {profile_backend})"
        parts = [show("backend", backend),
                 show("threads", self.threads if self.threads is not None else "backend default"),
                 show("batch_sizes", ",".join(map(str, self.batch_sizes))),
                 show("warmup", self.warmup), show("iterations", self.iterations),
                 show("cuda_graphs", "on" if self.cuda_graphs else "off"),
                 show("precision", self.precision), show("min_block_ms", f"{self.min_block_ms:g}")]
        return ", ".join(parts)


@dataclasses.dataclass
class BenchReport:
    """What :func:`run_bench` ran and measured.

    Attributes:
        profile: the device profile (:meth:`devices.DeviceProfile.to_dict`).
        config: ``dataclasses.asdict(BenchConfig)``.
        targets: per target (``a``, ``b``): path/name, backend that ran it, model precision.
        results: list of :class:`runners.base.BenchResult` (A alone) or
            :class:`runners.compare.PairResult` (with B).
        memory: per target (``a``, ``b``) its weights and its own peak memory, each measured in its
            own process (:func:`runners.memory.probe_memory`); empty when not measured.
    """

    profile: dict[str, Any]
    config: dict[str, Any]
    targets: dict[str, dict[str, Any]]
    results: list[Any]
    memory: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def paired(self) -> bool:
        return "b" in self.targets

    def header(self) -> str:
        """Two lines for stdout/markdown: the profile and the settings that ran."""
        src = self.profile.get("source")
        cfg = BenchConfig(**{**self.config, "batch_sizes": tuple(self.config["batch_sizes"])})
        ran = ", ".join(f"{k.upper()} on {t['backend']}"
                        + (f" ({t['model_precision']})" if t.get("model_precision") else "")
                        for k, t in self.targets.items())
        return (f"profile: {self.profile['name']}" + (f" ({src})" if src else "") + f"; {ran}\n"
                f"settings: {cfg.describe(self.profile.get('backend'))}")

    def markdown(self) -> str:
        """The report as markdown: profile and settings, then the tables (pairs first)."""
        parts = [self.header().replace("\n", "  \n"), ""]
        if self.paired:
            parts += [pair_markdown_table(self.results), "", *[block_note(p) + "  " for p in self.results], "",
                      markdown_table([r for p in self.results for r in (p.a, p.b)])]
        else:
            parts += [markdown_table(self.results), "",
                      *[f"batch {r.batch_size}: timed in " + (f"blocks of {r.block_runs} runs (~{r.block_ms:.1f} ms)"
                        if r.block_runs > 1 and r.block_ms is not None else "single runs") + "  "
                        for r in self.results]]
        if self.memory:
            labels = {k: f"{k.upper()} = {Path(str(t['target'])).name}" for k, t in self.targets.items()}
            parts += ["", memory_markdown(self.memory, labels)]
        return "\n".join(parts)

    def json_extra(self) -> dict[str, Any]:
        """Top-level JSON fields besides ``results`` (see :func:`runners.report.to_json`)."""
        extra = {"profile": self.profile, "config": self.config, "targets": self.targets}
        return {**extra, "memory": self.memory} if self.memory else extra


def resolve_config(profile: Any = None, *, targets: tuple[str, ...] = (), **options: Any) -> tuple[BenchConfig, Any]:
    """Merge a device profile with explicit options into a :class:`BenchConfig`.

    Args:
        profile: device profile name, ``.toml`` path or :class:`~devices.DeviceProfile` (what
            ``edgeprune bench --device`` names); ``None``: the profile an engine target was built
            for (its sidecar), else ``cpu``.
        targets: the bench targets (only used to find an engine's profile when ``profile`` is None).
        **options: ``backend``, ``threads``, ``batch_sizes``, ``warmup``, ``iterations``,
            ``cuda_graphs``, ``precision``, ``provider``, ``random_init``, ``min_block_ms``; ``None`` (or
            ``backend="auto"``) means "not given": the profile's value is used.

    Returns:
        (config, profile).

    Raises:
        UserError: unknown option, unknown profile, invalid value.
    """
    unknown = set(options) - set(PROFILE_FIELDS) - {"provider", "random_init", "min_block_ms"}
    if unknown:
        raise TypeError(f"unknown bench options: {sorted(unknown)}")
    if profile is None:
        profile = _engine_profile(targets) or "cpu"
    prof = load_profile(profile)
    from_profile: dict[str, Any] = {
        "threads": prof.threads, "batch_sizes": tuple(prof.bench.batch_sizes),
        "warmup": prof.bench.warmup, "iterations": prof.bench.iterations,
        "cuda_graphs": prof.bench.cuda_graphs, "precision": prof.precision,
    }
    values: dict[str, Any] = {}
    sources: dict[str, str] = {"backend": "profile"}
    backend = options.get("backend") or "auto"
    if backend != "auto":
        sources["backend"] = "option"
    for key, value in from_profile.items():
        given = options.get(key)
        if given is not None:
            values[key], sources[key] = given, "option"
        else:
            values[key], sources[key] = value, "profile"
    provider = options.get("provider")
    sources["provider"] = "option" if provider is not None else "profile"
    if provider is None:  # ONNX Runtime on a GPU profile (--backend onnxruntime) runs on its GPU
        provider = "cuda" if prof.uses_tensorrt else "cpu"
    min_block = options.get("min_block_ms")
    sources["min_block_ms"] = "option" if min_block is not None else "default"
    # blocks on the CPU backends (a 2 ms run is a scheduler slice); a GPU run is timed by its own events: no blocks
    on_gpu = backend == "tensorrt" or provider == "cuda" or values.get("device") == "cuda"
    default_block = 0.0 if on_gpu else DEFAULT_MIN_BLOCK_MS
    cfg = BenchConfig(profile=prof.name, backend=backend, provider=provider,
                      min_block_ms=default_block if min_block is None else min_block,
                      random_init=bool(options.get("random_init")), sources=sources,
                      **{**values, "batch_sizes": tuple(values["batch_sizes"])})
    return cfg, prof


def _engine_profile(targets: tuple[str, ...]) -> Any:
    """The profile recorded in the first engine target's sidecar (the settings it was built
    for), or ``None`` when no target is an engine with a sidecar."""
    for t in targets:
        if Path(t).suffix.lower() not in (".engine", ".plan", ".trt") or not Path(t).is_file():
            continue
        built = (read_sidecar(t) or {}).get("profile") or {}
        if not built:
            continue
        try:
            return profile_from_record(built)
        except ProfileError:  # a partial record: the named profile, with the recorded bench settings
            base = load_profile(built.get("name") or "")
            bench = {**dataclasses.asdict(base.bench), **(built.get("bench") or {})}
            bench["batch_sizes"] = tuple(bench["batch_sizes"])
            return dataclasses.replace(base, bench=BenchSettings(**bench))
    return None


def backend_for(kind: str, cfg: BenchConfig, profile: Any) -> str:
    """The backend that runs a target of ``kind`` under ``cfg`` (see the module doc)."""
    if cfg.backend != "auto":
        return cfg.backend
    if kind == "onnx":
        return str(profile.backend)
    return DEFAULT_BACKEND[kind]


def check_available(cfg: BenchConfig, profile: Any, targets: tuple[str, ...]) -> None:
    """Refuse, before any loading, what cannot run here; one line naming what is missing.

    The generic checks (files exist, an engine needs a TensorRT profile) are made here; the rest
    is asked of each target's backend (:class:`runners.registry.Backend`'s ``bench_*`` hooks).

    Raises:
        RuntimeFault: the profile needs TensorRT (or a CUDA GPU for torch) and it is missing.
        UserError: a setting the chosen backend cannot honour (CUDA graphs without TensorRT,
            int8 on torch).
    """
    for t in targets:
        kind = target_kind(t)
        backend = get_backend(backend_for(kind, cfg, profile))
        if kind == "onnx" and not Path(t).is_file():
            raise UserError(f"ONNX file not found: {t}")
        missing = backend_available(backend.name)
        if missing is not None:
            backend.bench_missing(profile, missing)
        if kind == "engine" and not Path(t).is_file():
            raise UserError(f"TensorRT engine file not found: {t}")
        if kind == "engine" and not profile.uses_tensorrt:
            raise UserError(f"device profile {profile.name!r} is for {profile.backend}; {t} is a TensorRT "
                            "engine (use the profile it was built for, e.g. --device rtx3090)")
        backend.bench_profile(t, kind, profile)
        if missing is not None:
            raise RuntimeFault(f"profile {profile.name} needs {backend.name}: {missing}")
        backend.bench_settings(t, cfg, profile)


def open_runner(target: str, cfg: BenchConfig, profile: Any, workdir: Path) -> tuple[Any, dict[str, Any]]:
    """(runner, report entry) of one target on the backend ``cfg`` and ``profile`` choose (an ONNX
    file on TensorRT is built into an engine in ``workdir``).

    Raises:
        UserError / RuntimeFault: what the backend's ``bench_open`` raises (see :func:`check_available`).
    """
    kind = target_kind(target)
    backend = get_backend(backend_for(kind, cfg, profile))
    info: dict[str, Any] = {"target": target, "kind": kind, "backend": backend.name,
                            "model_precision": backend.bench_model_precision(target, kind),
                            "cuda_graphs": cfg.cuda_graphs and backend.cuda_graphs}
    runner = backend.bench_open(target, kind, cfg, profile, workdir, info)
    return runner, info


def run_bench(a: str, b: str | None, cfg: BenchConfig, profile: Any, *, inputs: Any = None,
              memory: bool = False) -> BenchReport:
    """Benchmark A (and B, interleaved) with ``cfg``; see the module doc.

    Args:
        a, b: targets (``.onnx``, engine, run directory, model name); ``b`` optional.
        cfg, profile: from :func:`resolve_config`.
        inputs: optional real (N, C, H, W) inputs; default seeded noise.
        memory: also measure each target's weights and own peak memory, each in its own process
            after the timing (:func:`runners.memory.probe_memory`; on seeded noise).

    Raises:
        RuntimeFault: the profile's backend cannot run here (see :func:`check_available`).
        UserError: bad targets, int8 asked of a model without Q/DQ nodes, unknown input shape, ...
    """
    targets = (a,) if b is None else (a, b)
    check_available(cfg, profile, targets)
    runners: list[Any] = []
    infos: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="edgeprune-bench-") as tmp:
        try:
            for key, t in zip("ab", targets):
                runner, infos[key] = open_runner(t, cfg, profile, Path(tmp))
                runners.append(runner)
            if runners[0].input_shape is None and (len(runners) == 1 or runners[1].input_shape is None):
                raise UserError(f"{a}: the ONNX input has symbolic image dims; re-export with a fixed size")
            if len(runners) == 2:
                results: list[Any] = bench_pair(runners[0], runners[1], cfg.batch_sizes, cfg.iterations,
                                                cfg.warmup, inputs=inputs, min_block_ms=cfg.min_block_ms)
                flat = [r for p in results for r in (p.a, p.b)]
            else:
                blocks = ({"min_block_ms": cfg.min_block_ms}  # a runner overriding benchmark() may predate blocks
                          if "min_block_ms" in inspect.signature(runners[0].benchmark).parameters else {})
                results = list(runners[0].benchmark(cfg.batch_sizes, cfg.iterations, cfg.warmup,
                                                    inputs=inputs, **blocks))
                flat = results
        finally:
            for r in runners:
                r.close()
        mem: dict[str, dict[str, Any]] = {}
        if memory:  # after the timing, the runners closed; a built engine is probed, not rebuilt
            built = {k: str(r.engine_path) for k, r in zip("ab", runners)
                     if getattr(r, "engine_path", None) is not None and str(r.engine_path) != infos[k]["target"]}
            mem = probe_memory(dict(zip("ab", targets)), dataclasses.asdict(cfg), profile.to_dict(), built)
    for r in flat:
        r.settings["bench_profile"] = profile.name
        r.settings["precision_requested"] = cfg.precision
    return BenchReport(profile=profile.to_dict(), config=dataclasses.asdict(cfg), targets=infos,
                       results=results, memory=mem)


__all__ = ["BenchConfig", "BenchReport", "DEFAULT_MIN_BLOCK_MS", "PROFILE_FIELDS", "backend_for", "check_available",
           "open_runner", "resolve_config", "run_bench"]
