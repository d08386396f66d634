"""The child process of :func:`runners.memory.probe_memory`: ``python -m runners.memory_child SPEC_JSON``.

Loads one bench target the way the bench does, runs every batch size :data:`runners.memory.PROBE_RUNS`
times, and prints one line ``MARK + JSON`` (:mod:`runners.memory` says what it holds).
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from devices import profile_from_record
from runners.base import make_batch, peak_rss_mb, reset_peak_rss
from runners.bench import BenchConfig, open_runner
from runners.memory import MARK, PROBE_RUNS


def _rss_mib() -> float:
    """This process's resident set size now (``VmRSS``), else its lifetime peak (``ru_maxrss``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _weights(target: str, runner: Any) -> tuple[float | None, str]:
    """(MiB, source) of a loaded target's weights; see the module doc."""
    p = Path(target)
    if p.is_file():
        size = p.stat().st_size
        data = p.with_name(p.name + ".data")
        if p.suffix == ".onnx" and data.is_file():
            size += data.stat().st_size
        return size / 2**20, "file"
    model = getattr(runner, "model", None)
    if model is not None and hasattr(model, "parameters"):
        tensors = [*model.parameters(), *model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20, "parameters"
    return None, "unknown"


def _probe(spec: dict[str, Any]) -> dict[str, Any]:
    """In the child: load one target, run the bench batch sizes, measure (module doc)."""
    cfg_dict = dict(spec["config"])
    cfg = BenchConfig(**{**cfg_dict, "batch_sizes": tuple(cfg_dict["batch_sizes"])})
    profile = profile_from_record(spec["profile"])
    gc.collect()
    baseline = _rss_mib()
    windowed = reset_peak_rss()  # the peak from here on: not the imports' (their peak can exceed a small model's)
    with tempfile.TemporaryDirectory(prefix="edgeprune-memory-") as tmp:
        runner, _info = open_runner(spec["target"], cfg, profile, Path(tmp))
        try:
            device_peaks = []
            for bs in cfg.batch_sizes:
                x = make_batch(runner.input_shape or (), int(bs), None, 0)
                runner.prepare(x)
                for _ in range(PROBE_RUNS - 1):
                    runner.infer(x)
                # the runner's own peak (samples device memory where it is a GPU backend's)
                device_peaks.append(runner.result(int(bs), [runner.time_once(x)], 0).peak_memory_mb)
            weights, source = _weights(spec["weights_of"], runner)
            out = {"weights_mib": weights, "weights_source": source, "peak_rss_mib": peak_rss_mb(),
                   "baseline_rss_mib": baseline,
                   "peak_scope": "since the model started loading" if windowed else "process lifetime"}
            if str(getattr(runner, "device", "cpu")) != "cpu" and any(p is not None for p in device_peaks):
                out["device_peak_mib"] = max(p for p in device_peaks if p is not None)
        finally:
            runner.close()
    return out


def main(argv: Sequence[str]) -> int:
    """Probe the target of the JSON spec ``argv[0]`` (keys target, weights_of, config, profile)."""
    result = _probe(json.loads(argv[0]))
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
