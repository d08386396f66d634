"""Per-model memory of a bench: each model's weights and its own peak, each in its own process.

Timing A and B interleaved needs both models in one process, whose peak RSS is then the same
number for both (issue 42: DINOv2 dense vs its x0.46 prune read 503 / 503 MiB). :func:`probe_memory`
therefore starts, per target, a fresh Python child (``python -m runners.memory_child``; the children
run side by side) that loads only that model the way the bench does (:func:`runners.bench.open_runner`:
same backend, threads, provider, precision), runs every bench batch size a few times on seeded
noise, and reports:

* ``weights_mib``: the model's weights in MiB (2**20 bytes): the file's size for an ``.onnx``
  file (its external-data file added) or an engine, else the parameters and buffers of the
  loaded torch model (``numel x element size``); ``weights_source`` says which;
* ``peak_rss_mib``: the child's peak resident set size from the moment the model started loading
  (the kernel's ``VmHWM``, reset then through ``/proc/self/clear_refs``; the interpreter and the
  libraries, the loaded model, the inference buffers); where that reset is not possible, the
  lifetime peak ``getrusage(RUSAGE_SELF).ru_maxrss`` (``peak_scope`` says which): the imports'
  own transient peak could otherwise hide a small model;
* ``baseline_rss_mib``: its resident set size just before the model was loaded (the interpreter
  and the libraries), so ``peak_rss_mib - baseline_rss_mib`` is what the model itself added;
* ``device_peak_mib``: on a GPU backend, the runner's own device-memory peak
  (:meth:`runners.base.Runner.peak_memory_mb`: TensorRT and torch on CUDA), else absent.

An engine the bench built from an ``.onnx`` file for TensorRT is probed from that engine (the
caller passes its path), not rebuilt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: inferences per batch size in a probe (the peak is reached after the first; warm-ups included)
PROBE_RUNS = 3
#: the child's result line on stdout starts with this
MARK = "edgeprune-memory-probe: "


def probe_memory(targets: dict[str, str], config: dict[str, Any], profile: dict[str, Any],
                 load_from: dict[str, str] | None = None, timeout_s: float = 900.0) -> dict[str, dict[str, Any]]:
    """Each target's weights and own peak memory, each measured in its own child process.

    Args:
        targets: ``{"a": target, "b": target}`` (``.onnx``, engine, run directory, model name).
        config: ``dataclasses.asdict`` of the bench's :class:`runners.bench.BenchConfig`.
        profile: the device profile's ``to_dict()``.
        load_from: per key, the file the child loads instead (an engine the bench built from the
            ``.onnx`` target); the weights are still those of the target given.
        timeout_s: per child.

    Returns:
        ``{key: {"weights_mib", "weights_source", "peak_rss_mib", "baseline_rss_mib"[, "device_peak_mib"]}}``
        (MiB = 2**20 bytes); a child that failed gives ``{"error": its last line}`` instead (the
        bench's timings stand without it).
    """
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    procs = {}
    for key, target in targets.items():
        spec = {"target": (load_from or {}).get(key, target), "weights_of": target, "config": config,
                "profile": profile}
        procs[key] = subprocess.Popen([sys.executable, "-m", "runners.memory_child", json.dumps(spec, default=str)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out: dict[str, dict[str, Any]] = {}
    for key, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out[key] = {"error": f"the memory probe ran past {timeout_s:.0f} s"}
            continue
        found = [ln[len(MARK):] for ln in stdout.splitlines() if ln.startswith(MARK)]
        if proc.returncode == 0 and found:
            out[key] = json.loads(found[-1])
        else:
            last = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            out[key] = {"error": f"the memory probe failed: {last}"}
    return out


def memory_markdown(memory: dict[str, dict[str, Any]], labels: dict[str, str]) -> str:
    """A table: per model its weights, its own peak RSS (and what the model added to the
    interpreter's), and the device peak where there is one."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    rows = ["Memory, each model loaded and run in its own process (peak RSS of that process):", "",
            "| model | weights MiB | peak RSS MiB | RSS over the interpreter MiB | device peak MiB |",
            "|---|---:|---:|---:|---:|"]
    for key, m in memory.items():
        name = labels.get(key, key)
        if "error" in m:
            rows.append(f"| {name} | - | - | - | - ({m['error']}) |")
            continue
        added = m["peak_rss_mib"] - m["baseline_rss_mib"]
        rows.append(f"| {name} | {f(m.get('weights_mib'))} | {f(m['peak_rss_mib'])} | {f(added)} | "
                    f"{f(m.get('device_peak_mib'))} |")
    return "\n".join(rows)


__all__ = ["MARK", "PROBE_RUNS", "memory_markdown", "probe_memory"]
