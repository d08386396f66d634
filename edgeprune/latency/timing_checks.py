"""Checks of how a latency table is timed, before any timing (``edgeprune latency-table``): the backend can time
the profile's precision here, the statistic and clock are known and apply, and the one-line message of a backend
that is absent (a TensorRT profile names the command to run on the device)."""

from __future__ import annotations

import math
from typing import Any

from edgeprune.errors import UserError
from edgeprune.latency.measure import TimingSettings, Timer

#: the precisions a table can be timed at (a profile's ``build.precision`` values)
PRECISIONS = ("fp32", "fp16", "int8")


def _check_backend(profile: Any, backend: str, timer: Timer, s: TimingSettings) -> None:
    """The precision and backend fit the profile (usage mistakes, exit 2, before the backend's
    presence is looked at).

    Raises:
        UserError: an unknown precision, a precision the backend cannot time, or TensorRT asked on a
            profile that is not a TensorRT (GPU) one.
    """
    if s.precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, got {s.precision!r}")
    if backend == "tensorrt" and not profile.uses_tensorrt:
        raise UserError(f"--backend tensorrt times on a TensorRT (GPU) profile; profile {profile.name} times on "
                        f"{profile.backend} (drop --backend, or give a TensorRT profile with --device)")
    why = timer.refuses(s)
    if why is not None:
        raise UserError(why)


def _check_way(s: TimingSettings) -> None:
    """Statistic, clock and the spread check.

    Raises:
        UserError: an unknown statistic or clock, the CPU clock where it does not measure the
            run (a GPU, or more than one thread), ``repeats`` < 1, ``spread`` not a positive finite
            fraction <= 1, ``retries`` not in 0..10.
    """
    if isinstance(s.repeats, bool) or not isinstance(s.repeats, int) or s.repeats < 1:
        raise UserError(f"--repeats must be an integer >= 1, got {s.repeats!r}")
    if isinstance(s.retries, bool) or not isinstance(s.retries, int) or not 0 <= s.retries <= 10:
        raise UserError(f"--retries must be an integer in 0..10, got {s.retries!r}")
    if not isinstance(s.spread, (int, float)) or not (math.isfinite(s.spread) and 0 < s.spread <= 1):
        raise UserError(f"--spread must be a fraction in (0, 1] (0.05: 5%), got {s.spread!r}")
    if s.statistic not in ("p50", "min"):
        raise UserError(f"--statistic must be p50 or min, got {s.statistic!r}")
    if s.clock not in ("wall", "cpu"):
        raise UserError(f"--clock must be wall or cpu, got {s.clock!r}")
    if s.clock == "cpu" and (s.device != "cpu" or s.threads != 1):
        raise UserError("--clock cpu measures one CPU thread: it needs a CPU profile and --threads 1")


def unavailable_message(profile: Any, backend: str, reason: str, model: str = "M") -> str:
    """One line: why ``backend`` cannot time here, and (TensorRT) the command to run on the device."""
    first = reason.splitlines()[0].split(": ")[0] if reason else "not available"
    if backend == "tensorrt":
        return (f"profile {profile.name} times with TensorRT on its GPU, which is not here ({first}); run "
                f"`edgeprune latency-table --model {model} --device {profile.name} -o {profile.name}.json` "
                "on the device and copy the file (prune --latency-table FILE)")
    return f"backend {backend} cannot time here: {first}"
