"""The backend registry: backend names -> :class:`Backend` objects (runner + bench behaviour).

One place maps the backend names ``torch``, ``onnxruntime`` and ``tensorrt`` to what serves
them; ``edgeprune bench``, ``edgeprune verify`` and the tools build runners through
:func:`make_runner`, and :mod:`runners.bench` asks the backend what it needs (checks before
loading, the device and precision it runs, an engine build for an ONNX file, ...). A backend is
one subclass of :class:`Backend` registered with the :func:`register_backend` decorator, in its
own module (``runners/torch_runner.py``, ``runners/onnxruntime_runner.py``,
``runners/tensorrt/backend.py``; importing the ``runners`` package registers these three); no
caller branches on backend names::

    from runners.registry import make_runner
    runner = make_runner("model.onnx", threads=1)          # -> OrtRunner
    runner = make_runner("runs/deit-50", backend="torch")  # -> TorchRunner

    @register_backend("mine")                              # a new backend: one class
    class MyBackend(Backend):
        kinds = ("onnx",)
        def create(self, target, path, kind, opts): return MyRunner(path)

A *target* is a ``.onnx`` file, a TensorRT ``.engine``/``.plan``/``.trt`` file, an edgeprune run
directory, or a model name (dense model). Its kind (:func:`target_kind`) decides the default
backend (``backend="auto"``); each backend lists the kinds it can run.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable, TypeVar

from edgeprune.errors import RuntimeFault, UserError
from edgeprune.registry import Registry
from exporters.tensorrt_settings import onnx_precision, require_quantized
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
        device: torch device (``cpu``, ``cuda``, ``cuda:N``) the torch runner runs on.
        profile: device profile name/path whose ``[bench]`` settings apply to an engine
            (``cuda_graphs``) and that must be a TensorRT profile; ``None``: none.
        threads: intra-op threads (``None``: the backend's default).
        random_init: model names without weights (latency only).
        cuda_graphs: TensorRT / torch on CUDA: replay a captured CUDA graph (``None``: TensorRT
            takes it from the profile named by ``device``, else off).
        precision: torch: ``fp32`` (default), ``tf32``, ``fp16``, ``bf16`` (``None``: fp32).
    """

    provider: str = "cpu"
    device: str = "cpu"
    profile: str | None = None
    threads: int | None = None
    random_init: bool = False
    cuda_graphs: bool | None = None
    precision: str | None = None


#: precisions an ONNX file or engine may be benchmarked at (TensorRT build precision, or for
#: ONNX Runtime what the file must hold)
ONNX_PRECISIONS = ("fp32", "fp16", "int8")


class Backend:
    """One backend: builds its runners and says how ``edgeprune bench`` runs a target on it.

    Subclass, set the class attributes, implement :meth:`create`, and register the class with
    :func:`register_backend`; override the ``bench_*`` hooks where the defaults (an ONNX-style
    backend on the host) do not fit. The bench config (``cfg``) is a
    :class:`runners.bench.BenchConfig`, the profile a :class:`devices.DeviceProfile`.

    Attributes:
        name: the registered name (set by :func:`register_backend`).
        runner: ``"module:Class"`` of its runner class (for :func:`runner_class`).
        kinds: target kinds it can run (``onnx``, ``engine``, ``run``, ``model``).
        requires: import names it needs (for :func:`backend_available`).
        precisions: the ``--precision`` values a bench may ask of it.
        cuda_graphs: whether it can replay CUDA graphs (``--cuda-graphs``).
        reads_onnx_for_tensorrt: an ONNX file's precision is read as TensorRT reads it (Q/DQ int8
            and fp16 as TensorRT builds them) rather than as ONNX Runtime runs it.
    """

    name: str = ""
    runner: str = ""
    kinds: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    precisions: tuple[str, ...] = ONNX_PRECISIONS
    cuda_graphs: bool = False
    reads_onnx_for_tensorrt: bool = False

    def create(self, target: str, path: Path, kind: str, opts: RunnerOptions) -> Runner:
        """The runner for ``target`` (of ``kind``, already checked to be in :attr:`kinds`).

        Raises:
            UserError: missing file, bad options. RuntimeFault: the library is missing here.
        """
        raise NotImplementedError

    def check(self) -> None:
        """Raise :class:`RuntimeFault` when the backend cannot run here although its packages
        import (e.g. TensorRT: only the type stubs installed). Default: nothing to check."""

    # -- bench hooks (called by runners.bench, in this order) ------------------------------
    def bench_missing(self, profile: Any, missing: str) -> None:
        """The backend is missing here (``missing`` says what): raise a more telling error than
        the generic one when the profile explains it. Default: nothing (the generic one follows)."""

    def bench_profile(self, target: str, kind: str, profile: Any) -> None:
        """Refuse a device profile this backend cannot run on. Default: any profile."""

    def bench_settings(self, target: str, cfg: Any, profile: Any) -> None:
        """Refuse settings this backend cannot honour; default: precisions other than
        :attr:`precisions`, CUDA graphs asked explicitly of a backend without them."""
        if cfg.cuda_graphs and not self.cuda_graphs and cfg.sources.get("cuda_graphs") == "option":
            raise UserError(f"CUDA graphs need TensorRT or torch on CUDA; {target} runs on {self.name} "
                            f"(drop --cuda-graphs, or use a TensorRT profile)")
        if cfg.precision not in self.precisions:
            raise UserError(f"precision {cfg.precision} is for the torch runner; {target} runs on "
                            f"{self.name} (use {', '.join(self.precisions)})")

    def bench_model_precision(self, target: str, kind: str) -> str | None:
        """The precision an ONNX target holds (``fp32``/``fp16``/``int8``), ``None`` otherwise
        (read as this backend reads it: :attr:`reads_onnx_for_tensorrt`)."""
        if kind != "onnx" or not Path(target).is_file():
            return None
        return onnx_precision(target, for_tensorrt=self.reads_onnx_for_tensorrt)

    def bench_open(self, target: str, kind: str, cfg: Any, profile: Any, workdir: Path,
                   info: dict[str, Any]) -> Runner:
        """The runner bench times for ``target``; may add facts to ``info`` (the report's target
        entry). Default: an ONNX file must be what ``cfg.precision`` asks (int8: Q/DQ nodes),
        then :func:`make_runner` on the host."""
        if info.get("model_precision") is not None:
            require_quantized(target, info["model_precision"], cfg.precision)
        return make_runner(target, self.name, provider=cfg.provider, threads=cfg.threads,
                           random_init=cfg.random_init, cuda_graphs=cfg.cuda_graphs)


#: backend name -> the registered instance (a name registers once: a duplicate is a ValueError)
BACKENDS: Registry[Backend] = Registry("backend")
B = TypeVar("B", bound=type[Backend])


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator registering one instance of a :class:`Backend` subclass as ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(cls: B) -> B:
        backend = BACKENDS.register(name, cls())
        backend.name = name
        return cls

    return deco


def backend_names() -> list[str]:
    """Registered backend names, sorted (for ``--backend`` choices)."""
    return sorted(BACKENDS)


def get_backend(name: str) -> Backend:
    """The registered backend ``name``.

    Raises:
        UserError: unknown name; one line listing the known ones.
    """
    return BACKENDS.get(name)


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
                profile: str | None = None, threads: int | None = None, random_init: bool = False,
                cuda_graphs: bool | None = None, precision: str | None = None) -> Runner:
    """The runner for one bench/verify target (the one place that maps targets to backends).

    * ``*.onnx`` file -> :class:`runners.onnxruntime_runner.OrtRunner` (backend onnxruntime);
    * run directory -> :class:`runners.torch_runner.TorchRunner` (backend torch);
    * a model name (no such path) -> dense TorchRunner (backend torch);
    * ``*.engine`` / ``*.plan`` -> :class:`runners.tensorrt.runner.TrtRunner` (backend tensorrt;
      ``profile`` may name the device profile whose bench settings apply, e.g. ``orin-nx``).

    Args:
        target: file, run directory or model name.
        backend: ``auto`` (from the target's kind) or a registered backend name.
        provider, device, profile, threads, random_init, cuda_graphs, precision: see
            :class:`RunnerOptions`.

    Raises:
        UserError: missing file, a target the backend cannot run, unknown backend, ...
        RuntimeFault: the backend's library (TensorRT, CUDA) is missing here.
    """
    kind = target_kind(target)
    name = DEFAULT_BACKEND[kind] if backend == "auto" else backend
    be = get_backend(name)
    if kind not in be.kinds:
        raise UserError(_mismatch(target, kind, name))
    opts = RunnerOptions(provider=provider, device=device, profile=profile, threads=threads, random_init=random_init,
                         cuda_graphs=cuda_graphs, precision=precision)
    return be.create(target, Path(target), kind, opts)


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


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "ONNX_PRECISIONS", "Backend", "RunnerOptions", "backend_available",
           "backend_names", "get_backend", "make_runner", "register_backend", "runner_class",
           "target_kind"]
