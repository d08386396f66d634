"""Runners and benchmarks: one :class:`runners.base.Runner` per backend, chosen by name through
:mod:`runners.registry`; :mod:`runners.bench` is the one bench path.

Importing this package registers the built-in backends (each module registers its
:class:`runners.registry.Backend`: the runner it builds and how a bench runs on it).
"""

from runners import onnxruntime_runner, torch_runner  # noqa: F401  (register onnxruntime, torch)
from runners.tensorrt import backend  # noqa: F401  (registers tensorrt)
