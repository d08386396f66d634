"""Device profiles: what a TensorRT build and a benchmark need for one target device.

A profile is one TOML file (the shipped ones live next to this module: ``rtx3090.toml``,
``orin-nx.toml``, ``cpu.toml``). Layout::

    [device]
    name = "rtx3090"                # optional; defaults to the file name without .toml
    description = "..."
    backend = "tensorrt"            # "tensorrt" or "onnxruntime"
    architecture = "Ampere"
    compute_capability = "8.6"      # required for backend = "tensorrt"
    memory_gb = [24]                # one or more sizes (Orin NX: [8, 16])
    shared_memory = false           # true on Jetson (CPU and GPU share DRAM)
    gpu_names = ["RTX 3090"]        # optional substrings of the CUDA device name (warning only)
    tensorrt = "10.x"               # optional: TensorRT version expected on the device
    jetpack = "6"                   # optional

    [build]                         # backend = "tensorrt" only
    precision = "fp16"              # "fp16" (default), "fp32" or "int8" (int8: the ONNX must be
                                    # explicitly quantized (Q/DQ, `edgeprune quantize`); built
                                    # with the INT8 and FP16 flags: TensorRT's explicit quantization)
    workspace_mib = 4096
    builder_optimization_level = 3  # 0..5
    timing_cache = "~/.cache/edgeprune/timing/rtx3090.cache"   # optional; this is the default
    batch = { min = 1, opt = 8, max = 32 }

    [bench]
    batch_sizes = [1, 8, 32]
    warmup = 50
    iterations = 200
    cuda_graphs = true              # must be false for backend = "onnxruntime"

    [onnxruntime]                   # backend = "onnxruntime" only, optional
    threads = 0                     # intra-op threads; 0 = ONNX Runtime's default
    precision = "fp32"              # "fp32" (default), "fp16" or "int8": what the benchmarked
                                    # ONNX must be (int8: it has Q/DQ nodes); run as-is

    [pruning]                       # optional: the structures this device's kernels reward
    mlp_round_to = 64               # kept MLP widths are multiples of this (default: 8 CPU, 64 GPU)
    head_dim_round_to = 16          # kept Q/K and V head dims: multiples of this (8 CPU, 16 GPU)
    qk_equals_v = true              # Q/K and V head dims must be equal (fused attention kernels;
                                    # default false CPU, true GPU)
    [pruning.head_dims]             # optional: head dims the fused attention kernels take, per
    fp16 = { min = 16, max = 256, step = 8 }   # precision (a range or a list; default for TensorRT:
    int8 = [16, 32, 64]             # its documented rule, devices.kernels; for ONNX Runtime: none)

Every field is checked on load; a bad one raises :class:`ProfileError` (a
:class:`~edgeprune.errors.UserError`) naming the file and the field, e.g.
``orin-nx.toml: build.precision must be one of fp16, fp32, int8 (got 'fp8')``. Unknown keys are errors
too, so a typo does not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from devices.fields import ProfileError, Section, expand_path, parse_compute_capability
from devices.kernels import TENSORRT_HEAD_DIMS, parse_head_dims

BACKENDS = ("tensorrt", "onnxruntime")
PRECISIONS = ("fp16", "fp32", "int8")
ORT_PRECISIONS = ("fp32", "fp16", "int8")
MAX_OPT_LEVEL = 5
DEFAULT_TIMING_CACHE_DIR = "~/.cache/edgeprune/timing"


@dataclasses.dataclass(frozen=True)
class BatchRange:
    """Batch sizes of the TensorRT optimization profile (``min <= opt <= max``)."""

    min: int
    opt: int
    max: int


@dataclasses.dataclass(frozen=True)
class BuildSettings:
    """What a TensorRT engine build needs (``[build]``)."""

    precision: str
    workspace_mib: int
    builder_optimization_level: int
    batch: BatchRange
    timing_cache: Path
    """Expanded (``~``, environment variables) absolute path of the timing cache file."""


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """Benchmark defaults (``[bench]``)."""

    batch_sizes: tuple[int, ...]
    warmup: int
    iterations: int
    cuda_graphs: bool


@dataclasses.dataclass(frozen=True)
class PruningRules:
    """What the device's kernels reward (``[pruning]``, issue 30 item 3): the grid of kept MLP
    widths, the grid of head dims, whether Q/K and V head dims must be equal, and per precision the
    head dims the fused attention kernels take (``head_dims``: ``((precision, dims), ...)``, issue 40
    item 6, :mod:`devices.kernels`; ``()``: any)."""

    mlp_round_to: int
    head_dim_round_to: int
    qk_equals_v: bool
    head_dims: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def allowed_head_dims(self, precision: str) -> tuple[int, ...] | None:
        """The head dims allowed at ``precision`` (ascending), None when the profile has no rule for it."""
        return dict(self.head_dims).get(precision)


#: ``[pruning]`` defaults per backend: CPUs run any multiple of 8 at full speed; GPU kernels
#: (TensorRT, fused attention) want wide tiles, q/k/v of one head dim (issue 30 measurements) and
#: the head dims TensorRT's fused MHA takes (:data:`devices.kernels.TENSORRT_HEAD_DIMS`).
DEFAULT_PRUNING = {"onnxruntime": PruningRules(8, 8, False),
                   "tensorrt": PruningRules(64, 16, True, tuple(sorted(TENSORRT_HEAD_DIMS.items())))}


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One validated device profile."""

    name: str
    description: str
    backend: str
    architecture: str
    compute_capability: tuple[int, int] | None
    memory_gb: tuple[int, ...]
    shared_memory: bool
    build: BuildSettings | None
    bench: BenchSettings
    gpu_names: tuple[str, ...] = ()
    tensorrt: str | None = None
    jetpack: str | None = None
    ort_threads: int = 0
    ort_precision: str = "fp32"
    source: Path | None = None
    pruning: PruningRules | None = None
    """``[pruning]`` rules; ``None`` only for profiles built by hand (then the backend's defaults)."""

    @property
    def precision(self) -> str:
        """The profile's precision: ``build.precision`` (TensorRT) or ``onnxruntime.precision``."""
        return self.build.precision if self.build is not None else self.ort_precision

    @property
    def threads(self) -> int | None:
        """Intra-op threads for CPU backends (``None``: the backend's default)."""
        return self.ort_threads or None

    @property
    def compute_capability_str(self) -> str:
        """``"8.6"``, or ``"-"`` when the profile names no GPU."""
        if self.compute_capability is None:
            return "-"
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def uses_tensorrt(self) -> bool:
        return self.backend == "tensorrt"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (for engine sidecars and ``edgeprune devices NAME``)."""
        d: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "backend": self.backend,
            "architecture": self.architecture,
            "compute_capability": None if self.compute_capability is None else self.compute_capability_str,
            "memory_gb": list(self.memory_gb),
            "shared_memory": self.shared_memory,
            "gpu_names": list(self.gpu_names),
            "tensorrt": self.tensorrt,
            "jetpack": self.jetpack,
            "build": None,
            "bench": {
                "batch_sizes": list(self.bench.batch_sizes),
                "warmup": self.bench.warmup,
                "iterations": self.bench.iterations,
                "cuda_graphs": self.bench.cuda_graphs,
            },
            "source": None if self.source is None else str(self.source),
        }
        rules = self.pruning or DEFAULT_PRUNING[self.backend]
        d["pruning"] = {k: v for k, v in pruning_rules(self).items() if k != "head_dims"}
        if rules.head_dims or self.uses_tensorrt:  # per precision (round trip); none: the CPU's as before
            d["pruning"]["head_dims"] = {p: list(dims) for p, dims in rules.head_dims}
        if self.backend == "onnxruntime":
            d["onnxruntime"] = {"threads": self.ort_threads, "precision": self.ort_precision}
        if self.build is not None:
            d["build"] = {
                "precision": self.build.precision,
                "workspace_mib": self.build.workspace_mib,
                "builder_optimization_level": self.build.builder_optimization_level,
                "batch": dataclasses.asdict(self.build.batch),
                "timing_cache": str(self.build.timing_cache),
            }
        return d


def profile_from_dict(data: Mapping[str, Any], *, label: str, default_name: str,
                      source: Path | None = None) -> DeviceProfile:
    """Validate a parsed TOML document and build a :class:`DeviceProfile`.

    Args:
        data: the parsed TOML.
        label: file label used as the prefix of error messages (``"orin-nx.toml"``).
        default_name: profile name when ``device.name`` is absent (the file stem).
        source: the file it came from (relative timing-cache paths are resolved against its folder).

    Raises:
        ProfileError: a missing, unknown or invalid field (checked section by section: [device],
            [build], [onnxruntime], [bench], [pruning]).
    """
    top = Section(label, "", data, ("device", "build", "bench", "onnxruntime", "pruning"))
    dev_t = top.table_("device", required=True)
    build_t = top.table_("build")
    bench_t = top.table_("bench", required=True)
    ort_t = top.table_("onnxruntime")
    assert dev_t is not None and bench_t is not None
    device = _device_section(label, dev_t, default_name)
    backend, name = device["backend"], device["name"]
    build = _build_section(label, build_t, backend, name, source.parent if source is not None else None)
    ort_threads, ort_precision = _onnxruntime_section(label, ort_t, backend)
    bench = _bench_section(label, bench_t, backend, build)
    return DeviceProfile(**device, build=build, bench=bench, ort_threads=ort_threads, ort_precision=ort_precision,
                         source=source, pruning=_pruning_section(label, top.table_("pruning"),
                                                                 DEFAULT_PRUNING[backend]))


def _device_section(label: str, table: Mapping[str, Any], default_name: str) -> dict[str, Any]:
    """The ``[device]`` table as :class:`DeviceProfile` keyword arguments (``name`` .. ``jetpack``).

    Raises:
        ProfileError: an unknown key, a bad value, or no ``compute_capability`` for TensorRT.
    """
    dev = Section(label, "device", table, (
        "name", "description", "backend", "architecture", "compute_capability", "memory_gb",
        "shared_memory", "gpu_names", "tensorrt", "jetpack"))
    name = dev.string("name", default_name)
    assert name is not None
    if not name or any(c in name for c in "/\\ \t"):
        raise dev.fail("name", f"must be a non-empty name without spaces or slashes (got {name!r})")
    description = dev.string("description", "") or ""
    backend = dev.string("backend", required=True, choices=BACKENDS)
    architecture = dev.string("architecture", "") or ""
    cc_raw = dev._get("compute_capability", None, False)
    cc = None if cc_raw is None else parse_compute_capability(cc_raw, label)
    memory_gb: tuple[int, ...] = ()
    if backend == "tensorrt" or "memory_gb" in table:
        memory_gb = dev.int_list("memory_gb", required=True)
    out: dict[str, Any] = dict(name=name, description=description, backend=backend, architecture=architecture,
               compute_capability=cc, memory_gb=memory_gb, shared_memory=dev.boolean("shared_memory", False),
               gpu_names=dev.str_list("gpu_names"), tensorrt=dev.string("tensorrt"), jetpack=dev.string("jetpack"))
    if backend == "tensorrt" and cc is None:
        raise dev.fail("compute_capability", "is required for backend 'tensorrt'")
    return out


def _build_section(label: str, table: Mapping[str, Any] | None, backend: str, name: str,
                   base_dir: Path | None) -> BuildSettings | None:
    """The ``[build]`` table: required for TensorRT, refused for any other backend (``None`` then).

    Raises:
        ProfileError: the table missing or misplaced, an unknown key or a bad value.
    """
    if backend != "tensorrt":
        if table is not None:
            raise ProfileError(f"{label}: [build] is only allowed for backend 'tensorrt' "
                               f"(this profile's backend is {backend!r})")
        return None
    if table is None:
        raise ProfileError(f"{label}: [build] section is required for backend 'tensorrt'")
    b = Section(label, "build", table, ("precision", "workspace_mib", "builder_optimization_level",
                                        "timing_cache", "batch"))
    precision = b.string("precision", "fp16", choices=PRECISIONS)
    assert precision is not None
    workspace = b.integer("workspace_mib", required=True, lo=16)
    opt_level = b.integer("builder_optimization_level", 3, lo=0, hi=MAX_OPT_LEVEL)
    cache_text = b.string("timing_cache", f"{DEFAULT_TIMING_CACHE_DIR}/{name}.cache")
    assert cache_text is not None
    if not cache_text.strip():
        raise b.fail("timing_cache", "must be a non-empty path")
    batch_t = b.table_("batch", required=True)
    assert batch_t is not None
    return BuildSettings(precision=precision, workspace_mib=workspace, builder_optimization_level=opt_level,
                         batch=_batch_range(label, batch_t), timing_cache=expand_path(cache_text, base_dir))


def _batch_range(label: str, table: Mapping[str, Any]) -> BatchRange:
    """The ``[build.batch]`` table (``min <= opt <= max``, each >= 1)."""
    bt = Section(label, "build.batch", table, ("min", "opt", "max"))
    bmin = bt.integer("min", required=True, lo=1)
    bopt = bt.integer("opt", required=True, lo=1)
    bmax = bt.integer("max", required=True, lo=1)
    if not bmin <= bopt <= bmax:
        raise ProfileError(f"{label}: build.batch must satisfy min <= opt <= max "
                           f"(got min={bmin}, opt={bopt}, max={bmax})")
    return BatchRange(bmin, bopt, bmax)


def _onnxruntime_section(label: str, table: Mapping[str, Any] | None, backend: str) -> tuple[int, str]:
    """``(threads, precision)`` of the optional ``[onnxruntime]`` table (``(0, "fp32")`` without it);
    the table is refused for any other backend."""
    if table is None:
        return 0, "fp32"
    if backend != "onnxruntime":
        raise ProfileError(f"{label}: [onnxruntime] is only allowed for backend 'onnxruntime'")
    o = Section(label, "onnxruntime", table, ("threads", "precision"))
    return o.integer("threads", 0, lo=0), o.string("precision", "fp32", choices=ORT_PRECISIONS) or "fp32"


def _bench_section(label: str, table: Mapping[str, Any], backend: str, build: BuildSettings | None
                   ) -> BenchSettings:
    """The ``[bench]`` table; CUDA graphs only with TensorRT, batch sizes within ``build.batch``."""
    be = Section(label, "bench", table, ("batch_sizes", "warmup", "iterations", "cuda_graphs"))
    batch_sizes = be.int_list("batch_sizes", required=True)
    warmup = be.integer("warmup", 10, lo=0)
    iterations = be.integer("iterations", 100, lo=1)
    cuda_graphs = be.boolean("cuda_graphs", False)
    if cuda_graphs and backend != "tensorrt":
        raise be.fail("cuda_graphs", f"must be false for backend {backend!r} (CUDA graphs need TensorRT)")
    if build is not None:
        outside = [s for s in batch_sizes if not build.batch.min <= s <= build.batch.max]
        if outside:
            raise be.fail("batch_sizes", f"must lie within build.batch min..max "
                                         f"({build.batch.min}..{build.batch.max}) (got {outside[0]})")
    return BenchSettings(batch_sizes=batch_sizes, warmup=warmup, iterations=iterations, cuda_graphs=cuda_graphs)


def _pruning_section(label: str, table: Mapping[str, Any] | None, default: PruningRules) -> PruningRules:
    """The ``[pruning]`` table (each field optional, defaulting to the backend's ``default``;
    ``head_dims = {}`` states no head-dim rule).

    Raises:
        ProfileError: an unknown key or a bad value (round_to values must be >= 1; head dims:
            :func:`devices.kernels.parse_head_dims`).
    """
    if table is None:
        return default
    p = Section(label, "pruning", table, ("mlp_round_to", "head_dim_round_to", "qk_equals_v", "head_dims"))
    head_round = p.integer("head_dim_round_to", default.head_dim_round_to, lo=1)
    head_dims = p._get("head_dims", None, False)
    return PruningRules(mlp_round_to=p.integer("mlp_round_to", default.mlp_round_to, lo=1),
                        head_dim_round_to=head_round, qk_equals_v=p.boolean("qk_equals_v", default.qk_equals_v),
                        head_dims=default.head_dims if head_dims is None else parse_head_dims(label, head_dims,
                                                                                             head_round))


def pruning_rules(profile: DeviceProfile, precision: str | None = None) -> dict[str, Any]:
    """The profile's pruning rules as the dict a latency table stores in ``rules``:
    ``{"mlp_round_to": int, "head_dim_round_to": int, "qk_equals_v": bool}`` and, when the profile has
    a head-dim rule for ``precision`` (default: the profile's own), ``"head_dims": [int, ...]`` (the
    allowed head dims, ascending; :mod:`devices.kernels`). Without such a rule the dict is as before
    issue 40 (the CPU profile's tables are unchanged)."""
    rules = profile.pruning or DEFAULT_PRUNING.get(profile.backend, DEFAULT_PRUNING["onnxruntime"])
    d: dict[str, Any] = {"mlp_round_to": rules.mlp_round_to, "head_dim_round_to": rules.head_dim_round_to,
                         "qk_equals_v": rules.qk_equals_v}
    allowed = rules.allowed_head_dims(precision or profile.precision)
    if allowed is not None:
        d["head_dims"] = list(allowed)
    return d


def load_profile_file(path: str | os.PathLike[str]) -> DeviceProfile:
    """Load and validate one profile TOML file.

    Raises:
        ProfileError: missing file, TOML syntax error, bad field.
    """
    p = Path(path).expanduser()
    label = p.name
    if not p.is_file():
        raise ProfileError(f"device profile {str(p)!r} not found")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"{label}: invalid TOML: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ProfileError(f"{label}: cannot read: {err}") from None
    stem = p.name[:-5] if p.name.endswith(".toml") else p.stem
    return profile_from_dict(data, label=label, default_name=stem, source=p.resolve())
