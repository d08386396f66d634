"""fp16 with ONNX Runtime's transformer float16 tools, keeping fp32 inputs and outputs.

``onnxruntime.transformers.float16.convert_float_to_float16`` converts initializers and ops to
float16 and inserts ``Cast`` nodes at the borders; ``keep_io_types=True`` leaves the graph input
and output float32, so callers feed and read fp32 exactly as for the exported model. Ops in
``op_block_list`` (ORT's default list plus :data:`~exporters.quantization.config.FP16_KEEP_OPS`:
LayerNorm, Softmax, reductions, exponentials) and nodes in ``node_block_list`` (``--exclude``)
stay fp32. The result is re-sorted topologically (onnx-graphsurgeon). This avoids a
dependency on ``onnxconverter-common``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import onnx
import onnxruntime

from edgeprune.errors import RuntimeFault, UserError
from exporters.quantization.config import FP16_KEEP_OPS, QuantizeConfig
from exporters.quantization.ort_int8 import match_patterns
from exporters.quantization.registry import Converted, Recipe, RecipeJob, register_recipe


class Fp16Recipe(Recipe):
    """fp16 with fp32 inputs/outputs (module docstring); no settings of its own besides ``exclude``."""

    name = "fp16"
    precisions = ("fp16",)

    def needs_calibration(self, cfg: QuantizeConfig) -> bool:
        """fp16 has no activation ranges: no calibration images."""
        return False

    def run(self, job: RecipeJob) -> Converted:
        """Convert, keeping the excluded nodes and the sensitive op types in fp32.

        Raises:
            UserError: an ``--exclude`` pattern matching no node, or the patterns matching every node.
            RuntimeFault: the conversion fails on a valid model.
        """
        names = [n.name for n in onnx.load(str(job.float_path), load_external_data=False).graph.node if n.name]
        excluded = match_patterns(job.cfg.common.exclude, names, "node", "nothing would be converted to fp16")
        job.say("fp16: converting (fp32 inputs/outputs; LayerNorm, Softmax, reductions kept fp32)")
        convert_fp16(job.float_path, job.quant_path, excluded)
        return Converted(f"onnxruntime {onnxruntime.__version__} transformers.float16.convert_float_to_float16",
                         excluded)


def convert_fp16(src: Path, dst: Path, keep_nodes: Sequence[str] = ()) -> Path:
    """Write an fp16 copy of ``src`` to ``dst`` (fp32 I/O, sensitive ops fp32).

    Args:
        keep_nodes: node names kept fp32 (besides the blocked op types).

    Raises:
        RuntimeFault: the conversion fails on a valid model.
    """
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.load(str(src))
    block = sorted(set(DEFAULT_OP_BLOCK_LIST) | set(FP16_KEEP_OPS))
    try:
        converted = convert_float_to_float16(model, keep_io_types=True, op_block_list=block,
                                             node_block_list=list(keep_nodes) or None)
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001
        msg = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise RuntimeFault(f"fp16 conversion failed: {msg}") from None
    onnx.save_model(_toposorted(converted), str(dst))
    return dst


def _toposorted(model):
    """The converter appends its input ``Cast`` nodes at the end of the node list; ONNX requires
    topological order (ORT tolerates it, ``onnx.checker`` and TensorRT's parser do not):
    onnx-graphsurgeon sorts the graph, keeping model-level fields."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    graph.toposort()
    out = gs.export_onnx(graph, do_type_check=False)
    out.ir_version = model.ir_version
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    out.producer_name, out.producer_version = model.producer_name, model.producer_version
    return out


register_recipe(Fp16Recipe())
