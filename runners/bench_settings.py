"""The settings of a bench, declared once (issue 53): the section ``[bench]``.

``edgeprune bench``'s setting options are generated from :class:`BenchSection` (``edgeprune.cli.generate``); the
field names are the keywords of :func:`edgeprune.jobs.bench.bench` (and of :func:`runners.bench.resolve_config`,
``memory`` aside). ``None`` means "not given": the device profile's value is used, and the report says which
value came from where. The job's own inputs (the targets A and ``--vs`` B, the profile ``--device``, the report
files) are not settings.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprune.settings import Declared, Section, declared_of, setting
from runners.bench import DEFAULT_MIN_BLOCK_MS, PRECISIONS
from runners.registry import backend_names


def backend_choices() -> list[str]:
    """``auto`` and the registered backends (asked when the option is built: plugins registered late count)."""
    return ["auto", *backend_names()]


@dataclasses.dataclass(frozen=True)
class BenchSection(Section):
    """What a bench overrides of its device profile: the backend, the batch sizes, the runs, the timing blocks and
    the memory columns."""

    name: ClassVar[str] = "bench"
    title: ClassVar[str] = "Bench"

    backend: str = setting("auto", "auto: .onnx -> the profile's backend, .engine -> tensorrt, run dir / model name "
                           "-> torch", choices=backend_choices)
    provider: str | None = setting(None, "ONNX Runtime provider: cpu (default), cuda, tensorrt")
    batch_sizes: tuple[int, ...] | None = setting(None, "e.g. 1,8", metavar="N,...", minimum=1,
                                                  shown_default="profile's")
    iterations: int | None = setting(None, "timed runs", minimum=1, shown_default="profile's")
    warmup: int | None = setting(None, "untimed runs first", minimum=0, shown_default="profile's")
    threads: int | None = setting(None, "intra-op threads", minimum=1, shown_default="profile's")
    cuda_graphs: bool | None = setting(None, "TensorRT or torch on CUDA: replay CUDA graphs", switch="pair",
                                       shown_default="profile's")
    precision: str | None = setting(None, "TensorRT build precision for .onnx; for ONNX Runtime, int8 checks the "
                                    "file is quantized (Q/DQ); torch on CUDA: fp32, tf32, fp16, bf16",
                                    choices=PRECISIONS, shown_default="profile's")
    random_init: bool = setting(False, "model names without weights (latency only)", switch="flag")
    min_block_ms: float | None = setting(None, "each timed turn runs one model back to back for at least MS ms (runs "
                                         "per block chosen in warm-up; latency = block time / runs); 0: one run per "
                                         "turn", metavar="MS", unit="ms", minimum=0,
                                         shown_default=f"{DEFAULT_MIN_BLOCK_MS:g} on the CPU, 0 on a GPU")
    memory: bool | None = setting(None, "per model its weights and its own peak memory, each model loaded and run "
                                  "in its own process after the timing", switch="pair", shown_default="on with --vs")


#: the sections of a bench, in help order
BENCH_SECTIONS: tuple[type[Section], ...] = (BenchSection,)


def bench_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every bench setting."""
    return declared_of(BENCH_SECTIONS)


__all__ = ["BENCH_SECTIONS", "BenchSection", "backend_choices", "bench_declared"]
