"""TensorRT runtime: run, time, inspect and check engines built by ``edgeprune build``.

One job per module:

* :mod:`runners.tensorrt.cuda` -- cuda-python / pycuda buffers, streams, events, CUDA graphs;
* :mod:`runners.tensorrt.engine` -- deserialize an engine, check it matches this GPU/TensorRT;
* :mod:`runners.tensorrt.runner` -- :class:`TrtRunner` (the :class:`runners.base.Runner`);
* :mod:`runners.tensorrt.inspect` -- layer listing, attention-fusion report;
* :mod:`runners.tensorrt.check` -- agreement with ONNX Runtime;
* :mod:`runners.tensorrt.bench` -- :func:`bench_engine` (profile-driven engine benchmark);
* :mod:`runners.tensorrt.backend` -- the ``tensorrt`` backend of :mod:`runners.registry` (its
  runner and its bench behaviour).

Importing this package does not import TensorRT; the functions that need it raise a one-line
:class:`~edgeprune.errors.RuntimeFault` when it (or cuda-python, or a GPU) is missing.
"""

from runners.tensorrt.backend import TensorRTBackend
from runners.tensorrt.bench import bench_engine
from runners.tensorrt.check import FP16_ATOL, FP16_RTOL, Agreement, check_against_onnxruntime, compare_outputs
from runners.tensorrt.engine import check_engine_matches_gpu, load_engine
from runners.tensorrt.inspect import (FusionReport, attention_fusion_report, detect_attention_fusion,
                                      engine_information)
from runners.tensorrt.runner import TrtRunner

__all__ = ["FP16_ATOL", "FP16_RTOL", "Agreement", "FusionReport", "TensorRTBackend", "TrtRunner",
           "attention_fusion_report",
           "bench_engine",
           "check_against_onnxruntime", "check_engine_matches_gpu", "compare_outputs",
           "detect_attention_fusion", "engine_information", "load_engine"]
