"""The runner registry: backend names -> runner classes, and :func:`make_runner` for a bench target.

One place maps the backend names ``torch``, ``onnxruntime`` and ``tensorrt`` to the runner that
serves them; ``edgeprune bench``, ``edgeprune verify`` and the tools all build runners through
:func:`make_runner`. A backend registers itself with :func:`register_backend` (a decorator on
the factory that builds its runner from a target); no caller branches on backend names::

    from runners.registry import make_runner
    runner = make_runner("model.onnx", threads=1)          # -> OrtRunner
    runner = make_runner("runs/deit-50", backend="torch")  # -> TorchRunner

A *target* is a ``.onnx`` file, a TensorRT ``.engine``/``.plan``/``.trt`` file, an edgeprune run
directory, or a model name (dense model). Its kind (:func:`target_kind`) decides the default
backend (``backend="auto"``); each backend lists the kinds it can run.

Runner modules are imported lazily (inside the factories), so importing the registry needs
neither torch, onnxruntime nor TensorRT.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable

from edgeprune.errors import RuntimeFault, UserError
from runners.base import Runner

ENGINE_SUFFIXES = (".engine", ".plan", ".trt")
ONNX_SUFFIXES = (".onnx",)

#: target kind -> the backend ``backend="auto"`` picks for it
DEFAULT_BACKEND: dict[str, str] = {
    "engine": "tensorrt",
    "onnx": "onnxruntime",
    "run": "torch",
    "model": "torch",
}


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """Backend settings for :func:`make_runner` (each backend reads the ones it understands).

    Attributes:
        provider: ONNX Runtime execution provider(s): ``cpu``, ``cuda``, ``tensorrt``.
        device: torch device (``cpu``, ``cuda``, ``cuda:N``) or, for engines, a device profile
            name/path whose ``[bench]`` settings apply (``cuda_graphs``).
        threads: intra-op threads (``None``: the backend's default).
        random_init: model names without weights (latency only).
        cuda_graphs: TensorRT / torch on CUDA: replay a captured CUDA graph (``None``: TensorRT
            takes it from the profile named by ``device``, else off).
        precision: torch: ``fp32`` (default), ``tf32``, ``fp16``, ``bf16`` (``None``: fp32).
    """

    provider: str = "cpu"
    device: str = "cpu"
    threads: int | None = None
    random_init: bool = False
    cuda_graphs: bool | None = None
    precision: str | None = None


Factory = Callable[[str, Path, str, RunnerOptions], Runner]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registered backend.

    Attributes:
        name: ``torch``, ``onnxruntime``, ``tensorrt``.
        runner: ``"module:Class"`` of its runner class (imported on demand by :func:`runner_class`).
        kinds: target kinds it can run (``onnx``, ``engine``, ``run``, ``model``).
        factory: ``(target, path, kind, options) -> Runner``.
        requires: import names the backend needs; for :func:`backend_available`.
        check: optional ``() -> None`` raising :class:`RuntimeFault` when the backend cannot run
            here although its package imports (TensorRT: only the type stubs installed).
    """

    name: str
    runner: str
    kinds: tuple[str, ...]
    factory: Factory
    requires: tuple[str, ...] = ()
    check: Callable[[], None] | None = None


BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, runner: str, kinds: tuple[str, ...], requires: tuple[str, ...] = (),
                     check: Callable[[], None] | None = None) -> Callable[[Factory], Factory]:
    """Decorator registering ``factory`` as the builder of ``name``'s runners.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(factory: Factory) -> Factory:
        if name in BACKENDS:
            raise ValueError(f"backend {name!r} is already registered")
        BACKENDS[name] = Backend(name, runner, tuple(kinds), factory, tuple(requires), check)
        return factory

    return deco


def backend_names() -> list[str]:
    """Registered backend names, sorted (for ``--backend`` choices)."""
    return sorted(BACKENDS)


def get_backend(name: str) -> Backend:
    """The registered backend ``name``.

    Raises:
        UserError: unknown name (lists the known ones).
    """
    try:
        return BACKENDS[name]
    except KeyError:
        raise UserError(f"unknown backend {name!r} (known: {', '.join(backend_names())})") from None


def runner_class(name: str) -> type[Runner]:
    """The runner class of backend ``name`` (imports its module)."""
    mod, _, cls = get_backend(name).runner.partition(":")
    runner: type[Runner] = getattr(importlib.import_module(mod), cls)
    return runner


def backend_available(name: str) -> str | None:
    """``None`` if backend ``name`` can run here, else a phrase saying what is missing."""
    be = get_backend(name)
    for req in be.requires:
        try:
            importlib.import_module(req)
        except ImportError:
            return f"{req} is not installed"
    if be.check is not None:
        try:
            be.check()
        except RuntimeFault as err:
            return str(err)
    return None


def target_kind(target: str) -> str:
    """``engine``, ``onnx``, ``run`` (a directory) or ``model`` (a name; no such path).

    Raises:
        UserError: an existing file that is neither ONNX nor an engine; a path-like name that
            does not exist.
    """
    p = Path(target)
    suffix = p.suffix.lower()
    if suffix in ENGINE_SUFFIXES:
        return "engine"
    if suffix in ONNX_SUFFIXES:
        return "onnx"
    if p.is_dir():
        return "run"
    if p.exists():
        raise UserError(f"{target}: not an .onnx file or a run directory")
    if "/" in target or suffix in (".safetensors", ".json", ".pt", ".pth"):
        raise UserError(f"no such file or directory: {target}")
    return "model"


_KIND_WORDS = {"engine": "a TensorRT engine", "onnx": "an ONNX file", "run": "a run directory",
               "model": "a model name"}


def make_runner(target: str, backend: str = "auto", *, provider: str = "cpu", device: str = "cpu",
                threads: int | None = None, random_init: bool = False,
                cuda_graphs: bool | None = None, precision: str | None = None) -> Runner:
    """The runner for one bench/verify target (the one place that maps targets to backends).

    * ``*.onnx`` file -> :class:`runners.onnxruntime_runner.OrtRunner` (backend onnxruntime);
    * run directory -> :class:`runners.torch_runner.TorchRunner` (backend torch);
    * a model name (no such path) -> dense TorchRunner (backend torch);
    * ``*.engine`` / ``*.plan`` -> :class:`runners.tensorrt.runner.TrtRunner` (backend tensorrt;
      ``device`` may name the device profile whose bench settings apply, e.g. ``orin-nx``).

    Args:
        target: file, run directory or model name.
        backend: ``auto`` (from the target's kind) or a registered backend name.
        provider, device, threads, random_init, cuda_graphs, precision: see :class:`RunnerOptions`.

    Raises:
        UserError: missing file, a target the backend cannot run, unknown backend, ...
        RuntimeFault: the backend's library (TensorRT, CUDA) is missing here.
    """
    kind = target_kind(target)
    name = DEFAULT_BACKEND[kind] if backend == "auto" else backend
    be = get_backend(name)
    if kind not in be.kinds:
        raise UserError(_mismatch(target, kind, name))
    opts = RunnerOptions(provider=provider, device=device, threads=threads, random_init=random_init,
                         cuda_graphs=cuda_graphs, precision=precision)
    return be.factory(target, Path(target), kind, opts)


def _mismatch(target: str, kind: str, backend: str) -> str:
    if kind == "engine":
        return f"{target} is a TensorRT engine; use --backend tensorrt (or auto)"
    if kind == "onnx":
        return (f"{target} is an ONNX file; the {backend} backend runs run directories or model "
                "names (use --backend onnxruntime)")
    if kind == "run":
        return (f"{target} is a run directory; export it first "
                f"(edgeprune export {target} -o model.onnx) or use --backend torch")
    return f"{target} is {_KIND_WORDS[kind]}; the {backend} backend cannot run it"


# ---------------------------------------------------------------------------------------------
# the three backends


@register_backend("onnxruntime", "runners.onnxruntime_runner:OrtRunner", ("onnx",),
                  requires=("onnxruntime",))
def _ort_factory(target: str, path: Path, kind: str, opts: RunnerOptions) -> Runner:
    if not path.exists():
        raise UserError(f"ONNX file not found: {target}")
    from runners.onnxruntime_runner import OrtRunner

    return OrtRunner(path, providers=opts.provider, threads=opts.threads, label=path.name)


@register_backend("torch", "runners.torch_runner:TorchRunner", ("run", "model"), requires=("torch",))
def _torch_factory(target: str, path: Path, kind: str, opts: RunnerOptions) -> Runner:
    from edgeprune.loading import load_target
    from runners.torch_runner import TorchRunner

    if kind == "run":
        model, _rec, spec = load_target(path, None)
        label = path.name
    else:
        from edgeprune.zoo.registry import MissingWeightsError

        try:
            model, _rec, spec = load_target(None, target, None, opts.random_init)
        except MissingWeightsError:  # bench has no --checkpoint: name what it takes
            raise UserError(f"{target}: no weights to benchmark -- pass --random-init (latency only), or a "
                            "run directory or .onnx file") from None
        label = target
    kwargs: dict[str, Any] = {"cuda_graphs": bool(opts.cuda_graphs)}
    if opts.precision is not None:
        kwargs["precision"] = opts.precision
    return TorchRunner(model, device=opts.device, threads=opts.threads, label=label,
                       input_shape=spec.input_size, **kwargs)


def _trt_check() -> None:
    from exporters.tensorrt import tensorrt_version

    tensorrt_version()


@register_backend("tensorrt", "runners.tensorrt.runner:TrtRunner", ("engine",), check=_trt_check)
def _trt_factory(target: str, path: Path, kind: str, opts: RunnerOptions) -> Runner:
    if not path.is_file():
        raise UserError(f"TensorRT engine file not found: {target}")
    cuda_graphs = opts.cuda_graphs
    dev = opts.device
    if dev not in ("cpu", "cuda") and not dev.startswith("cuda:"):
        from devices import load_profile

        profile = load_profile(dev)
        if not profile.uses_tensorrt:
            raise UserError(f"device profile {profile.name!r} does not use TensorRT")
        if cuda_graphs is None:
            cuda_graphs = bool(profile.bench.cuda_graphs)
    from runners.tensorrt.runner import TrtRunner

    return TrtRunner(path, cuda_graphs=bool(cuda_graphs), model=path.name)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "Backend", "RunnerOptions", "backend_available",
           "backend_names", "get_backend", "make_runner", "register_backend", "runner_class",
           "target_kind"]
