"""Export a (pruned or dense) timm ViT to a clean, deployable ONNX file.

Exporter choice
---------------
:func:`export_onnx` uses PyTorch's TorchScript-based exporter
(``torch.onnx.export(..., dynamo=False)``). At opset 17 (the default: TensorRT 10.3 on JetPack 6
parses it) it lowers ``F.scaled_dot_product_attention`` -- used by timm's ``Attention`` and by
:class:`edgeprune.layers.PrunedAttention` -- to plain ``MatMul``/``Softmax``, writes a dynamic
batch axis through ``dynamic_axes``, and needs no extra package. The ``torch.export``-based
("dynamo") exporter targets opset >= 18 and reaches 17 only through the ONNX version converter,
and it needs ``onnxscript``; it is available as ``exporter="dynamo"`` but is not the default.

After export the graph is cleaned with onnx-graphsurgeon (constant folding including shape
sub-graphs of static dims, dead-node removal, topological sort), checked with
``onnx.checker.check_model`` and written atomically: everything goes to a temporary directory
next to the destination and is moved into place with ``os.replace`` only once complete, so an
error or interrupt never leaves a half-written file. Weights are embedded unless the protobuf
would exceed 2 GB; then they go to ``<name>.onnx.data`` next to the file (ONNX external data).

Metadata
--------
Everything a deployer needs is stored in ``ModelProto.metadata_props`` as string key/values:
strings as they are, anything else JSON-encoded; the key ``edgeprune_json_keys`` lists the
JSON-encoded keys so that :func:`read_metadata` returns the original values. The exporter adds
the facts about the file itself: ``input_name``, ``input_shape`` (``"batch"`` for the dynamic
axis), ``input_dtype``, ``output_name``, ``output_shape``, ``opset``, ``dynamic_batch``,
``exporter``, ``torch_version``. :func:`build_metadata` assembles the rest (edgeprune version,
base model, method, sparsities, per-block dims, preprocessing) from a run record and/or a model
spec.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

from edgeprune.errors import UserError

INPUT_NAME = "input"
OUTPUT_NAME = "output"
DEFAULT_OPSET = 17
#: metadata key listing the JSON-encoded keys.
JSON_KEYS_KEY = "edgeprune_json_keys"
#: Serialized protobufs must stay below 2 GiB; above this many bytes of weights, use external data.
PROTOBUF_LIMIT = 2_000_000_000
#: Opsets the TorchScript exporter supports (LayerNormalization needs >= 17 to stay one op).
_TORCHSCRIPT_OPSETS = range(14, 21)


# --------------------------------------------------------------------------------------------
# metadata


def _edgeprune_version() -> str:
    try:
        from importlib.metadata import version

        return version("edgeprune")
    except Exception:  # pragma: no cover - not installed
        return "unknown"


def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        try:
            return obj.item()
        except Exception:
            pass
    if isinstance(obj, Path):
        return str(obj)
    return obj


def encode_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """String key/values for ``metadata_props``: strings kept, everything else JSON.

    The returned dict holds ``edgeprune_json_keys`` (JSON list of the encoded keys).

    Raises:
        ValueError: a value JSON cannot encode.
    """
    out: dict[str, str] = {}
    json_keys: list[str] = []
    for key, value in metadata.items():
        key = str(key)
        if key == JSON_KEYS_KEY:
            continue
        if isinstance(value, str):
            out[key] = value
        else:
            try:
                out[key] = json.dumps(_to_jsonable(value), sort_keys=False)
            except TypeError as err:
                raise ValueError(f"metadata {key!r}: cannot JSON-encode {type(value).__name__}") from err
            json_keys.append(key)
    out[JSON_KEYS_KEY] = json.dumps(sorted(json_keys))
    return out


def decode_metadata(props: Mapping[str, str]) -> dict[str, Any]:
    """Inverse of :func:`encode_metadata` (keys not listed as JSON stay strings)."""
    try:
        json_keys = set(json.loads(props.get(JSON_KEYS_KEY, "[]")))
    except json.JSONDecodeError:
        json_keys = set()
    out: dict[str, Any] = {}
    for key, value in props.items():
        if key == JSON_KEYS_KEY:
            continue
        if key in json_keys:
            try:
                out[key] = json.loads(value)
                continue
            except json.JSONDecodeError:
                pass
        out[key] = value
    return out


def block_dims(model: nn.Module) -> list[dict[str, int]]:
    """Per-block dims of a timm ViT (dense ``Attention`` or :class:`PrunedAttention`).

    Returns a list of ``{"index", "mlp_hidden", "qk_dim", "v_dim", "num_heads"}`` (the run
    record's ``blocks`` format); empty if the model has no ``blocks``.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        inner = getattr(model, "model", None) or getattr(model, "backbone", None)
        blocks = getattr(inner, "blocks", None) if inner is not None else None
    out: list[dict[str, int]] = []
    if blocks is None:
        return out
    for i, blk in enumerate(blocks):
        entry: dict[str, int] = {"index": i}
        fc1 = getattr(getattr(blk, "mlp", None), "fc1", None)
        if isinstance(fc1, nn.Linear):
            entry["mlp_hidden"] = fc1.out_features
        attn = getattr(blk, "attn", None)
        if attn is not None and hasattr(attn, "num_heads"):
            heads = int(attn.num_heads)
            qk = getattr(attn, "qk_dim", None)
            v = getattr(attn, "v_dim", None)
            hd = getattr(attn, "head_dim", None)
            qk = qk if qk is not None else hd
            v = v if v is not None else hd
            if qk is not None and v is not None:
                entry["qk_dim"] = int(qk)
                entry["v_dim"] = int(v)
            entry["num_heads"] = heads
        out.append(entry)
    return out


def build_metadata(*, record: Mapping[str, Any] | None = None, spec: Any = None,
                   model: nn.Module | None = None, model_name: str | None = None,
                   checkpoint: str | None = None) -> dict[str, Any]:
    """Deployment metadata from a run record (pruned) and/or a model spec (dense).

    Args:
        record: the run's ``run.json`` (see ``edgeprune.artifact.load_run``); ``None`` for a dense
            model.
        spec: the base model's ``ModelSpec`` (input size, preprocessing, output kind).
        model: the module (dense export: per-block dims and parameter count come from it).
        model_name, checkpoint: the base model when there is no record.

    Returns:
        A dict for :func:`export_onnx`'s ``metadata``.
    """
    md: dict[str, Any] = {}
    if record is not None:
        md["edgeprune_version"] = str(record.get("edgeprune_version") or _edgeprune_version())
        md["base_model"] = record.get("base_model", {})
        md["method"] = str(record.get("method", "unknown"))
        for key in ("targets", "sparsity", "calibration", "params", "flops"):
            if key in record:
                md[key] = record[key]
        sp = record.get("sparsity") or {}
        if isinstance(sp, Mapping):
            for k in ("mlp", "attn"):
                if k in sp:
                    md[f"sparsity_{k}"] = sp[k]
        if "blocks" in record:
            md["blocks"] = record["blocks"]
    else:
        name = model_name or (getattr(spec, "name", None) if spec is not None else None)
        md["edgeprune_version"] = _edgeprune_version()
        md["base_model"] = {"name": name, "checkpoint": checkpoint}
        md["method"] = "dense"
        md["sparsity"] = {"mlp": 0.0, "attn": 0.0}
        md["sparsity_mlp"] = 0.0
        md["sparsity_attn"] = 0.0
    if model is not None:
        if "blocks" not in md:
            md["blocks"] = block_dims(model)
        if "params" not in md:
            md["params"] = int(sum(p.numel() for p in model.parameters()))
    if spec is not None:
        md["input_size"] = list(getattr(spec, "input_size"))
        pre = dict(getattr(spec, "preprocessing", None) or {})
        pre.setdefault("mean", list(getattr(spec, "mean", []) or []))
        pre.setdefault("std", list(getattr(spec, "std", []) or []))
        md["preprocessing"] = pre
        for k in ("mean", "std", "resize", "crop", "interpolation"):
            if k in pre:
                md[k] = pre[k]
        if getattr(spec, "output_kind", None):
            md["output_kind"] = spec.output_kind
    return md


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of an exported ONNX file, decoded (see :func:`encode_metadata`).

    Raises:
        UserError: the file is missing or not an ONNX model.
    """
    import onnx

    p = Path(path)
    if not p.is_file():
        raise UserError(f"ONNX file not found: {p}")
    try:
        m = onnx.load(str(p), load_external_data=False)
    except Exception as err:
        raise UserError(f"{p} is not a valid ONNX model ({_first_line(err)})") from None
    if not m.graph.node and not m.graph.input:
        raise UserError(f"{p} is not a valid ONNX model (empty graph)")
    return decode_metadata({prop.key: prop.value for prop in m.metadata_props})


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


# --------------------------------------------------------------------------------------------
# export


def _single_tensor_output(model: nn.Module, dummy: torch.Tensor) -> torch.Tensor:
    try:
        with torch.no_grad():
            out = model(dummy)
    except Exception as err:
        raise UserError(f"the model does not take input of shape {tuple(dummy.shape)} "
                        f"({_first_line(err)})") from None
    if not isinstance(out, torch.Tensor):
        raise UserError(f"the model returns {type(out).__name__}; ONNX export needs one tensor output")
    return out


def _torchscript_export(model: nn.Module, dummy: torch.Tensor, path: Path, opset: int,
                        dynamic_batch: bool) -> None:
    if opset not in _TORCHSCRIPT_OPSETS:
        raise UserError(f"opset {opset} is not supported (use {_TORCHSCRIPT_OPSETS.start}.."
                        f"{_TORCHSCRIPT_OPSETS.stop - 1}; 17 for TensorRT 10.x)")
    axes = {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}} if dynamic_batch else None
    with warnings.catch_warnings():
        # TracerWarnings (timm's static input-size asserts) and the exporter's deprecation notice.
        warnings.simplefilter("ignore")
        with torch.no_grad():
            torch.onnx.export(
                model, (dummy,), str(path),
                input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                opset_version=opset, dynamic_axes=axes, do_constant_folding=True,
                export_params=True, dynamo=False,
            )


def _dynamo_export(model: nn.Module, dummy: torch.Tensor, path: Path, opset: int,
                   dynamic_batch: bool) -> None:
    try:
        import onnxscript  # noqa: F401
    except ImportError:
        raise UserError("exporter 'dynamo' needs onnxscript (pip install onnxscript)") from None
    dyn = None
    if dynamic_batch:
        batch = torch.export.Dim("batch", min=1, max=4096)
        dyn = ({0: batch},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            prog = torch.onnx.export(
                model, (dummy,), dynamo=True, opset_version=opset,
                input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                dynamic_shapes=dyn, optimize=True, verbose=False, report=False,
            )
            if prog is None:
                raise RuntimeError("torch.onnx.export(dynamo=True) returned no program")
            prog.save(str(path))


@contextlib.contextmanager
def _quiet_onnxruntime():
    """Silence ORT's optimizer warnings while graphsurgeon folds constants with it."""
    try:
        import onnxruntime as ort
    except ImportError:  # gs then folds with numpy only
        yield
        return
    ort.set_default_logger_severity(3)
    try:
        yield
    finally:
        ort.set_default_logger_severity(2)  # ORT's default (warning)


def _clean_graph(model_proto):
    """onnx-graphsurgeon: fold constants (incl. static shape arithmetic), drop dead nodes, sort."""
    import onnx_graphsurgeon as gs

    import onnx

    if model_proto.ByteSize() < PROTOBUF_LIMIT:
        # Static shapes for intermediate tensors let fold_shapes resolve Shape->Gather chains of
        # static dims (e.g. SDPA's 1/sqrt(head_dim) scale).
        try:
            model_proto = onnx.shape_inference.infer_shapes(model_proto, data_prop=True)
        except Exception:
            pass
    graph = gs.import_onnx(model_proto)
    with warnings.catch_warnings(), _quiet_onnxruntime():
        warnings.simplefilter("ignore")
        graph.fold_constants(fold_shapes=True)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    cleaned = gs.export_onnx(graph, do_type_check=True)
    # gs keeps the opset; carry over model-level fields gs does not.
    cleaned.ir_version = model_proto.ir_version
    return cleaned


def _weights_bytes(model_proto) -> int:
    total = 0
    for init in model_proto.graph.initializer:
        total += len(init.raw_data) if init.raw_data else init.ByteSize()
    return total


def _output_shape_of(model_proto) -> list:
    outs = model_proto.graph.output
    if not outs:
        return []
    dims = outs[0].type.tensor_type.shape.dim
    return [d.dim_param if d.dim_param else int(d.dim_value) for d in dims]


def export_onnx(model: nn.Module, path: str | os.PathLike, input_shape: Sequence[int],
                metadata: Mapping[str, Any] | None = None, opset: int = DEFAULT_OPSET,
                dynamic_batch: bool = True, *, batch_size: int = 1,
                exporter: str = "torchscript", fold_constants: bool = True,
                overwrite: bool = True) -> Path:
    """Export ``model`` to ``path`` as a clean ONNX graph with input ``"input"``, output ``"output"``.

    Args:
        model: the module; exported in eval mode (its mode is restored afterwards), on CPU in
            float32 (the caller moves it; a model on another device is exported there).
        path: destination ``.onnx`` file (parent dirs are created).
        input_shape: ``(C, H, W)`` of one image.
        metadata: deployment metadata (see :func:`build_metadata`); non-strings are JSON-encoded.
        opset: ONNX opset (default 17: no opset-23 ``Attention`` op; attention is MatMul/Softmax).
        dynamic_batch: make axis 0 of input and output symbolic (``"batch"``); otherwise fixed at
            ``batch_size``.
        batch_size: batch of the tracing input (and the fixed batch if not ``dynamic_batch``).
        exporter: ``"torchscript"`` (default) or ``"dynamo"`` (needs onnxscript).
        fold_constants: run onnx-graphsurgeon constant folding.
        overwrite: replace an existing ``path``; ``False`` raises :class:`UserError` instead.

    Returns:
        ``Path(path)``.

    Raises:
        UserError: bad ``input_shape``/opset/exporter, a model that does not take the input, an
            existing file with ``overwrite=False``.
    """
    import onnx

    path = Path(path)
    input_shape = tuple(int(s) for s in input_shape)
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise UserError(f"input_shape must be (C, H, W) with positive sizes, got {input_shape}")
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")
    if exporter not in ("torchscript", "dynamo"):
        raise UserError(f"unknown exporter {exporter!r} (torchscript or dynamo)")
    if path.exists() and not overwrite:
        raise UserError(f"{path} exists (use --force to overwrite)")
    if path.is_dir():
        raise UserError(f"{path} is a directory")
    path.parent.mkdir(parents=True, exist_ok=True)

    was_training = model.training
    model.eval()
    try:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        gen = torch.Generator().manual_seed(0)
        dummy = torch.randn((batch_size, *input_shape), generator=gen).to(device)
        if opset not in _TORCHSCRIPT_OPSETS and exporter == "torchscript":
            raise UserError(f"opset {opset} is not supported (use {_TORCHSCRIPT_OPSETS.start}.."
                            f"{_TORCHSCRIPT_OPSETS.stop - 1}; 17 for TensorRT 10.x)")

        tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            raw = tmpdir / "raw.onnx"
            try:
                if exporter == "torchscript":
                    _torchscript_export(model, dummy, raw, opset, dynamic_batch)
                else:
                    _dynamo_export(model, dummy, raw, opset, dynamic_batch)
            except UserError:
                raise
            except Exception:
                # Say so in one line if the model simply does not take this input (or returns no
                # single tensor); anything else is a real export problem: re-raise it.
                _single_tensor_output(model, dummy)
                raise
            proto = onnx.load(str(raw), load_external_data=True)
            if len(proto.graph.output) != 1:
                _single_tensor_output(model, dummy)
                raise UserError(f"the model has {len(proto.graph.output)} outputs; "
                                "ONNX export needs one tensor output")
            got_opset = next((i.version for i in proto.opset_import if i.domain in ("", "ai.onnx")), None)
            if got_opset != opset:
                raise UserError(f"the {exporter} exporter produced opset {got_opset}, not {opset}; "
                                "use the torchscript exporter or another opset")
            if fold_constants:
                proto = _clean_graph(proto)

            md = dict(metadata or {})
            md.update({
                "input_name": INPUT_NAME,
                "input_shape": ["batch" if dynamic_batch else batch_size, *input_shape],
                "input_dtype": "float32",
                "output_name": OUTPUT_NAME,
                "output_shape": _output_shape_of(proto),
                "opset": opset,
                "dynamic_batch": bool(dynamic_batch),
                "exporter": f"torch.onnx ({exporter})",
                "torch_version": torch.__version__,
            })
            md.setdefault("edgeprune_version", _edgeprune_version())
            del proto.metadata_props[:]
            for key, value in encode_metadata(md).items():
                entry = proto.metadata_props.add()
                entry.key, entry.value = key, value
            proto.producer_name = "edgeprune"
            proto.producer_version = _edgeprune_version()

            final = tmpdir / path.name
            data_name = path.name + ".data"
            external = _weights_bytes(proto) > PROTOBUF_LIMIT
            if external:
                onnx.save_model(proto, str(final), save_as_external_data=True,
                                all_tensors_to_one_file=True, location=data_name,
                                size_threshold=1024)
            else:
                onnx.save_model(proto, str(final))
            del proto
            onnx.checker.check_model(str(final))  # path-based: works above 2 GB too

            # Move into place: data first, then the graph file (the file users open).
            if external:
                os.replace(tmpdir / data_name, path.parent / data_name)
            os.replace(final, path)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    finally:
        model.train(was_training)
    return path


def graph_op_summary(path: str | os.PathLike) -> dict[str, Any]:
    """Op types and domains of an ONNX file (for tests and ``verify`` output)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    ops: dict[str, int] = {}
    domains: set[str] = set()
    for node in m.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
        domains.add(node.domain or "ai.onnx")
    opsets = {imp.domain or "ai.onnx": imp.version for imp in m.opset_import}
    return {"ops": ops, "domains": sorted(domains), "opsets": opsets}
