"""Deterministic healing: what :func:`edgeprune.heal.heal` switches on so that a run is repeatable and
a resumed run is bit-identical to an uninterrupted one (issue 29, item 3).

* :func:`seeded` -- the optimisation loop on every device: torch's RNG forked and seeded,
  deterministic algorithms on (errors, not warnings, for an op without a deterministic kernel), TF32
  off on CUDA (:func:`edgeprune.calibration.collect.exact_fp32`);
* :func:`cuda_deterministic` -- the whole heal on CUDA (the dense targets included):
  ``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8`` unless the user chose ``:16:8``; cuBLAS reads it when
  the process makes its first cuBLAS call, so set it before any CUDA work to be sure), deterministic
  algorithms, ``cudnn.deterministic`` (``cudnn.benchmark`` off), and the math backend of
  ``scaled_dot_product_attention`` (the memory-efficient and flash backends' backward passes are
  not deterministic: a resumed heal differed by 7.45e-9 on an H100).

Both restore every global setting they change (flags, environment variable, RNG state) on exit, also
after an exception. Everything else in the process (a later prune, a benchmark) runs as before.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from edgeprune.calibration.collect import exact_fp32
from edgeprune.errors import UserError

#: the environment variable cuBLAS reads for its workspace, and the deterministic configurations.
CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


@contextlib.contextmanager
def deterministic_algorithms(warn_only: bool = False) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` inside, the previous
    mode (and its ``warn_only``) restored afterwards."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


@contextlib.contextmanager
def _cublas_workspace() -> Iterator[None]:
    """``CUBLAS_WORKSPACE_CONFIG=:4096:8`` inside unless it is set to a deterministic value; removed
    again afterwards if it was set here.

    Raises:
        UserError: the variable is set to a value with which cuBLAS is not deterministic.
    """
    value = os.environ.get(CUBLAS_ENV)
    if value is not None and value not in CUBLAS_DETERMINISTIC:
        raise UserError(f"{CUBLAS_ENV}={value} makes cuBLAS non-deterministic, and heal on CUDA runs "
                        f"deterministically (use {' or '.join(CUBLAS_DETERMINISTIC)}, or unset it)")
    if value is None:
        if torch.cuda.is_initialized():
            warnings.warn(f"{CUBLAS_ENV} is set by heal after CUDA was initialised; if cuBLAS was already in "
                          f"use, set {CUBLAS_ENV}={CUBLAS_DETERMINISTIC[0]} before the first CUDA work for "
                          "bit-identical resumed heals", RuntimeWarning, stacklevel=4)
        os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC[0]
    try:
        yield
    finally:
        if value is None:
            os.environ.pop(CUBLAS_ENV, None)


@contextlib.contextmanager
def _cudnn_deterministic() -> Iterator[None]:
    """``cudnn.deterministic`` on and ``cudnn.benchmark`` off inside; both restored afterwards."""
    cudnn = torch.backends.cudnn
    prev = cudnn.deterministic, cudnn.benchmark
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = prev


@contextlib.contextmanager
def cuda_deterministic(device: torch.device | str) -> Iterator[None]:
    """Deterministic CUDA kernels for everything inside (a no-op on other devices): cuBLAS workspace
    configuration, deterministic algorithms (``warn_only=False``), cuDNN deterministic, and the math
    backend of ``scaled_dot_product_attention``. Every setting is restored on exit.

    Raises:
        UserError: ``CUBLAS_WORKSPACE_CONFIG`` set to a non-deterministic value (CUDA only).
    """
    if torch.device(device).type != "cuda":
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(_cublas_workspace())
        stack.enter_context(deterministic_algorithms(warn_only=False))
        stack.enter_context(_cudnn_deterministic())
        stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        yield


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Fork torch's RNG (and the CUDA device's), seed it with ``seed``, turn deterministic
    algorithms on (``warn_only=False``) and, on CUDA, TF32 off; restore all of it afterwards."""
    dev = torch.device(device)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), exact_fp32(dev):  # TF32 off on CUDA, restored after
        torch.manual_seed(seed)
        with deterministic_algorithms(warn_only=False):
            yield
