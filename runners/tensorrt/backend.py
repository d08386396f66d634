"""The ``tensorrt`` backend: TensorRT engines, and ONNX files built into an engine for a bench.

Registered with :func:`runners.registry.register_backend`. A bench on it needs a TensorRT device
profile; an ``.onnx`` target is first built into a temporary engine for that profile
(:func:`exporters.tensorrt.build_engine`, at the bench precision); an engine built for another
profile is benchmarked with a warning; batch sizes outside the engine's optimization profile are
refused (:func:`check_batch_range`). TensorRT itself is imported only when an engine is built or
loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

import exporters.tensorrt as trt_build
from devices import load_profile
from edgeprune.errors import RuntimeFault, UserError
from runners.base import Runner
from runners.registry import Backend, RunnerOptions, make_runner, register_backend
from runners.tensorrt.runner import TrtRunner


def check_batch_range(runner: Any, sizes: Sequence[int]) -> None:
    """UserError when a batch size lies outside the engine's optimization-profile range."""
    bad = [b for b in sizes if not runner.min_batch <= b <= runner.max_batch]
    if bad:
        raise UserError(f"batch size(s) {bad} outside {runner.engine_path.name}'s range "
                        f"{runner.min_batch}..{runner.max_batch} (rebuild with a wider build.batch)")


def warn_other_profile(engine: str, profile: Any) -> None:
    """A warning on stderr when ``engine``'s sidecar names another profile than ``profile``."""
    built = ((trt_build.read_sidecar(engine) or {}).get("profile") or {}).get("name")
    if built and built != profile.name:
        print(f"warning: {Path(engine).name} was built for profile {built!r}, benchmarking with "
              f"{profile.name!r} settings", file=sys.stderr)


@register_backend("tensorrt")
class TensorRTBackend(Backend):
    """TensorRT engines on the local GPU (see the module doc)."""

    runner = "runners.tensorrt.runner:TrtRunner"
    kinds = ("engine",)
    cuda_graphs = True
    reads_onnx_for_tensorrt = True

    def check(self) -> None:
        trt_build.tensorrt_version()

    def create(self, target: str, path: Path, kind: str, opts: RunnerOptions) -> Runner:
        if not path.is_file():
            raise UserError(f"TensorRT engine file not found: {target}")
        cuda_graphs = opts.cuda_graphs
        if opts.profile is not None:
            profile = load_profile(opts.profile)
            if not profile.uses_tensorrt:
                raise UserError(f"device profile {profile.name!r} does not use TensorRT")
            if cuda_graphs is None:
                cuda_graphs = bool(profile.bench.cuda_graphs)
        return TrtRunner(path, cuda_graphs=bool(cuda_graphs), model=path.name)

    def bench_missing(self, profile: Any, missing: str) -> None:
        if profile.uses_tensorrt:  # the root cause first: without TensorRT no engine can exist or run here
            raise RuntimeFault(f"profile {profile.name} needs TensorRT, which is not installed "
                               "(run on the device, or use --device cpu)")

    def bench_profile(self, target: str, kind: str, profile: Any) -> None:
        if not profile.uses_tensorrt:
            raise UserError(f"the tensorrt backend needs a TensorRT device profile, and {profile.name!r} "
                            f"runs {profile.backend} (use e.g. --device rtx3090)")

    def bench_open(self, target: str, kind: str, cfg: Any, profile: Any, workdir: Path,
                   info: dict[str, Any]) -> Runner:
        if kind == "onnx":
            engine = workdir / f"{Path(target).stem}.{profile.name}.engine"
            trt_build.build_engine(target, profile, engine, precision=cfg.precision)
            info["engine"] = "built for this run (temporary)"
            target = str(engine)
        else:
            warn_other_profile(target, profile)
        runner = make_runner(target, self.name, provider=cfg.provider, device="cuda", threads=cfg.threads,
                             random_init=cfg.random_init, cuda_graphs=cfg.cuda_graphs)
        check_batch_range(runner, cfg.batch_sizes)
        return runner


__all__ = ["TensorRTBackend", "check_batch_range", "warn_other_profile"]
