"""ONNX Runtime sessions with one-line errors: provider names, threads, optimization level.

:func:`load_session` is the one way edgeprune opens an ``onnxruntime.InferenceSession``: the
exporters (verification, int8 calibration checks) and :class:`runners.onnxruntime_runner.OrtRunner`
alike. It lives with the exporters so that the dependencies point one way (runners -> exporters).
onnxruntime is an optional dependency, imported when a session is opened.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from edgeprune.errors import RuntimeFault, UserError

PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "gpu": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
}
GPU_PROVIDERS = {"CUDAExecutionProvider", "TensorrtExecutionProvider"}


def import_onnxruntime() -> Any:
    """The ``onnxruntime`` module (an optional dependency).

    Raises:
        UserError: onnxruntime is not installed.
    """
    try:
        import onnxruntime
    except ImportError:
        raise UserError("onnxruntime is not installed (pip install 'edgeprune[cpu]')") from None
    return onnxruntime


def resolve_providers(providers: Sequence[str] | str | None) -> list[str]:
    """Full ORT provider names for ``providers`` (aliases allowed), CPU appended as fallback.

    Raises:
        UserError: a name ONNX Runtime does not know.
        RuntimeFault: a known provider the installed onnxruntime does not offer (no CUDA build).
    """
    ort = import_onnxruntime()
    if providers is None:
        providers = ["cpu"]
    if isinstance(providers, str):
        providers = [p for p in providers.split(",") if p.strip()]
    available = ort.get_available_providers()
    out: list[str] = []
    for p in providers:
        name = PROVIDER_ALIASES.get(p.strip().lower(), p.strip())
        if name not in available:
            short = ", ".join(sorted({k for k, v in PROVIDER_ALIASES.items() if v in available}))
            # a known provider this installation lacks is the environment's fault (exit 1);
            # a name ONNX Runtime does not know at all is the user's (exit 2)
            known = name in set(PROVIDER_ALIASES.values()) or name in ort.get_all_providers()
            error = RuntimeFault if known else UserError
            raise error(f"ONNX Runtime provider {p!r} is not available in onnxruntime "
                        f"{ort.__version__} (available: {short or ', '.join(available)})")
        if name not in out:
            out.append(name)
    if "CPUExecutionProvider" not in out:
        out.append("CPUExecutionProvider")
    return out


def load_session(path: str | os.PathLike, providers: Sequence[str] | str | None = ("cpu",),
                 threads: int | None = None, *, provider_options: Sequence[dict] | None = None,
                 optimization: str = "all", model_bytes: bytes | None = None):
    """An ``onnxruntime.InferenceSession`` for ``path``, with errors as one-line UserErrors.

    Args:
        providers: provider names or aliases, in priority order.
        threads: intra-op threads (``None``: ORT's default, one per physical core).
        provider_options: per-provider option dicts, aligned with the *resolved* providers.
        optimization: ``"all"``, ``"extended"``, ``"basic"`` or ``"disable"``.
        model_bytes: the serialized model to run instead of the file's (a copy of ``path`` with extra outputs:
            :mod:`exporters.merge_replay`); ``path`` names it in messages.

    Raises:
        UserError: missing/unreadable/corrupt file, unavailable provider, bad threads.
    """
    ort = import_onnxruntime()
    p = Path(path)
    if not p.exists():
        raise UserError(f"ONNX file not found: {p}")
    if p.is_dir():
        raise UserError(f"{p} is a directory, not an ONNX file")
    if threads is not None and threads < 1:
        raise UserError(f"threads must be >= 1, got {threads}")
    names = resolve_providers(providers)
    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }[optimization]
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    if threads is not None:
        so.intra_op_num_threads = int(threads)
    so.log_severity_level = 3
    kwargs: dict[str, Any] = {"providers": names}
    if provider_options is not None:
        opts = list(provider_options) + [{}] * (len(names) - len(provider_options))
        kwargs["provider_options"] = opts[:len(names)]
    try:
        sess = ort.InferenceSession(str(p) if model_bytes is None else model_bytes, sess_options=so, **kwargs)
    except Exception as err:
        msg = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if len(msg) > 300:
            msg = msg[:300] + "..."
        raise UserError(f"cannot load ONNX model {p}: {msg}") from None
    got = sess.get_providers()
    missing = [n for n in names if n not in got]
    if missing:
        raise RuntimeFault(f"ONNX Runtime could not initialise {', '.join(missing)} for {p} "
                        f"(running on {', '.join(got)}); check the CUDA/TensorRT libraries")
    return sess


__all__ = ["GPU_PROVIDERS", "PROVIDER_ALIASES", "import_onnxruntime", "load_session", "resolve_providers"]
