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

Metadata (``metadata_props``: :func:`build_metadata`, :func:`read_metadata`, JSON encoding) lives in
:mod:`exporters.onnx_metadata`; graph clean-up and inspection (:func:`graph_op_summary`) in
:mod:`exporters.onnx_graph`. Both are re-exported here, so ``from exporters.onnx import ...`` keeps
working.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

from edgeprune.errors import UserError
from edgeprune.settings import SettingError
from exporters.attention_pattern import STANDARD_ATTENTION_OPSET, check_attention_choice, fusible_copy
from exporters.onnx_graph import (PROTOBUF_LIMIT, _clean_graph, _output_shape_of,  # noqa: F401
                                  _quiet_onnxruntime, _weights_bytes, graph_op_summary)
from exporters.onnx_metadata import (JSON_KEYS_KEY, _edgeprune_version, _first_line,  # noqa: F401
                                     _to_jsonable, block_dims, build_metadata, decode_metadata,
                                     encode_metadata, read_metadata)

INPUT_NAME = "input"
OUTPUT_NAME = "output"
DEFAULT_OPSET = 17
#: Opsets the TorchScript exporter supports (LayerNormalization needs >= 17 to stay one op).
_TORCHSCRIPT_OPSETS = range(14, 21)

__all__ = ["export_onnx", "build_metadata", "read_metadata", "encode_metadata", "decode_metadata",
           "block_dims", "graph_op_summary", "INPUT_NAME", "OUTPUT_NAME", "DEFAULT_OPSET", "PROTOBUF_LIMIT",
           "JSON_KEYS_KEY"]


def _single_tensor_output(model: nn.Module, dummy: torch.Tensor):
    """``model(dummy)``, checked to be a tensor or a tuple/list/dict of tensors (a network's several outputs).

    Raises:
        UserError: the model does not take ``dummy``, or returns something else (one line).
    """
    try:
        with torch.no_grad():
            out = model(dummy)
    except Exception as err:
        raise UserError(f"the model does not take input of shape {tuple(dummy.shape)} "
                        f"({_first_line(err)})") from None
    values = list(out.values()) if isinstance(out, dict) else out
    if isinstance(values, torch.Tensor):
        return out
    if not (isinstance(values, (tuple, list)) and values and all(isinstance(t, torch.Tensor) for t in values)):
        raise UserError(f"the model returns {type(out).__name__}; ONNX export needs a tensor or a tuple/dict of "
                        "tensors")
    return out


def output_names(model: nn.Module, dummy: torch.Tensor) -> list[str]:
    """The graph's output names: ``["output"]`` for one tensor, a dict's keys (as text) for a dict, ``output_0``,
    ``output_1``, ... for a tuple or list (issue 55: a network's several outputs, in the order it returns them).

    Raises:
        UserError: as :func:`_single_tensor_output`; two dict keys with the same text.
    """
    out = _single_tensor_output(model, dummy)
    if isinstance(out, torch.Tensor):
        return [OUTPUT_NAME]
    if isinstance(out, dict):
        names = [str(k) for k in out]
        if len(set(names)) != len(names):
            raise UserError(f"the model's output keys {names} are not distinct as text")
        return names
    return [f"{OUTPUT_NAME}_{i}" for i in range(len(out))]


def _torchscript_export(model: nn.Module, dummy: torch.Tensor, path: Path, opset: int,
                        dynamic_batch: bool) -> None:
    if opset not in _TORCHSCRIPT_OPSETS:
        raise UserError(f"opset {opset} is not supported (use {_TORCHSCRIPT_OPSETS.start}.."
                        f"{_TORCHSCRIPT_OPSETS.stop - 1}; 17 for TensorRT 10.x)")
    names = output_names(model, dummy)
    axes = {n: {0: "batch"} for n in (INPUT_NAME, *names)} if dynamic_batch else None
    with warnings.catch_warnings():
        # TracerWarnings (timm's static input-size asserts) and the exporter's deprecation notice.
        warnings.simplefilter("ignore")
        with torch.no_grad():
            torch.onnx.export(
                model, (dummy,), str(path),
                input_names=[INPUT_NAME], output_names=names,
                opset_version=opset, dynamic_axes=axes, do_constant_folding=True,
                export_params=True, dynamo=False,
            )


def _dynamo_export(model: nn.Module, dummy: torch.Tensor, path: Path, opset: int,
                   dynamic_batch: bool) -> None:
    try:
        import onnxscript  # noqa: F401
    except ImportError:
        raise UserError("the torch.export-based exporter (exporter 'dynamo', attention 'standard') needs onnxscript "
                        "(pip install onnxscript)") from None
    dyn = None
    if dynamic_batch:
        batch = torch.export.Dim("batch", min=1, max=4096)
        dyn = ({0: batch},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            prog = torch.onnx.export(
                model, (dummy,), dynamo=True, opset_version=opset,
                input_names=[INPUT_NAME], output_names=output_names(model, dummy),
                dynamic_shapes=dyn, optimize=True, verbose=False, report=False,
            )
            if prog is None:
                raise RuntimeError("torch.onnx.export(dynamo=True) returned no program")
            prog.save(str(path))


def export_onnx(model: nn.Module, path: str | os.PathLike, input_shape: Sequence[int],
                metadata: Mapping[str, Any] | None = None, opset: int = DEFAULT_OPSET,
                dynamic_batch: bool = True, *, batch_size: int = 1,
                exporter: str = "torchscript", fold_constants: bool = True,
                overwrite: bool = True, attention: str = "packed") -> Path:
    """Export ``model`` to ``path`` as a clean ONNX graph with input ``"input"``, output ``"output"`` (a network
    with several outputs: one graph output per tensor, named by :func:`output_names`).

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
        attention: ``"packed"`` (default): the model's own packed ``qkv`` + SDPA (what the quantizer, SmoothQuant and
            the TensorRT int8 plan read); ``"fusible"``: attention written as separate q/k/v MatMuls and
            ``Softmax(QK^T / sqrt(d)) V``, the pattern ONNX Runtime's transformer optimizer fuses
            (:mod:`exporters.attention_pattern`); ``"standard"``: ONNX's own ``Attention`` op (opset >= 23), one
            per attention block, written by the torch.export-based exporter (needs onnxscript; ``exporter`` is
            then "dynamo").

    Returns:
        ``Path(path)``.

    Raises:
        UserError: bad ``input_shape``/opset/exporter, ``attention="standard"`` below opset 23 or without
            onnxscript, a model that does not take the input, an existing file with ``overwrite=False``.
    """
    path, input_shape = _checked_target(path, input_shape, batch_size, exporter, overwrite)
    was_training = model.training
    model.eval()
    try:
        dummy = _tracing_input(model, input_shape, batch_size)
        if check_attention_choice(attention) == "standard":
            if opset < STANDARD_ATTENTION_OPSET:
                raise SettingError(f"{{attention}} standard writes ONNX's Attention op, which needs opset >= "
                                   f"{STANDARD_ATTENTION_OPSET} (give {{opset}} {STANDARD_ATTENTION_OPSET}; 17 stays "
                                   "the default for JetPack's TensorRT 10.3)")
            exporter = "dynamo"
        if opset not in _TORCHSCRIPT_OPSETS and exporter == "torchscript":
            raise UserError(f"opset {opset} is not supported (use {_TORCHSCRIPT_OPSETS.start}.."
                            f"{_TORCHSCRIPT_OPSETS.stop - 1}; 17 for TensorRT 10.x)")

        tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            raw = tmpdir / "raw.onnx"
            _export_raw(model, dummy, raw, opset, dynamic_batch, exporter, attention)
            proto = _load_exported(raw, model, dummy, opset, exporter)
            if fold_constants:
                proto = _clean_graph(proto)
            _stamp_metadata(proto, metadata, input_shape, opset, dynamic_batch, batch_size, exporter)
            final, external = _save_model(proto, tmpdir / path.name, path.name + ".data")
            del proto
            _check_and_move(final, external, path)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    finally:
        model.train(was_training)
    return path


def _checked_target(path: str | os.PathLike, input_shape: Sequence[int], batch_size: int, exporter: str,
                    overwrite: bool) -> tuple[Path, tuple[int, ...]]:
    """Step 1 of :func:`export_onnx`: check the arguments and the destination, create its folder.

    Returns:
        ``(Path(path), input_shape as a tuple of ints)``.

    Raises:
        UserError: bad ``input_shape``/``batch_size``/``exporter``, an existing file with
            ``overwrite=False``, a directory at ``path``.
    """
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
    return path, input_shape


def _tracing_input(model: nn.Module, input_shape: tuple[int, ...], batch_size: int) -> torch.Tensor:
    """The tracing input: seeded noise, ``(batch_size, C, H, W)`` float32, on the model's device."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    return torch.randn((batch_size, *input_shape), generator=gen).to(device)


def _export_raw(model: nn.Module, dummy: torch.Tensor, raw: Path, opset: int, dynamic_batch: bool,
                exporter: str, attention: str = "packed") -> None:
    """Run the chosen torch exporter into ``raw`` (on :func:`~exporters.attention_pattern.fusible_copy`
    of ``model`` for ``attention="fusible"``).

    Raises:
        UserError: the model does not take ``dummy`` or returns no single tensor (one line);
            any other export failure is re-raised as it is.
    """
    if check_attention_choice(attention) == "fusible":
        model = fusible_copy(model)
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


def _load_exported(raw: Path, model: nn.Module, dummy: torch.Tensor, opset: int, exporter: str):
    """The exported graph as an ``onnx.ModelProto``, checked: one output per tensor the model returns, the
    requested opset.

    Raises:
        UserError: another number of outputs, or the exporter produced another opset.
    """
    import onnx

    proto = onnx.load(str(raw), load_external_data=True)
    want = output_names(model, dummy)
    if len(proto.graph.output) != len(want):
        raise UserError(f"the exported graph has {len(proto.graph.output)} outputs, the model returns "
                        f"{len(want)} tensors ({', '.join(want)})")
    got_opset = next((i.version for i in proto.opset_import if i.domain in ("", "ai.onnx")), None)
    if got_opset != opset:
        raise UserError(f"the {exporter} exporter produced opset {got_opset}, not {opset}; "
                        "use the torchscript exporter or another opset")
    return proto


def _stamp_metadata(proto, metadata: Mapping[str, Any] | None, input_shape: tuple[int, ...], opset: int,
                    dynamic_batch: bool, batch_size: int, exporter: str) -> None:
    """Replace ``proto``'s metadata by ``metadata`` plus the input/output/exporter entries, in place;
    producer ``edgeprune``."""
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


def _save_model(proto, final: Path, data_name: str) -> tuple[Path, bool]:
    """Write ``proto`` to ``final`` (weights to ``data_name`` beside it above the 2 GB protobuf
    limit). Returns ``(final, whether the weights went to the external file)``."""
    import onnx

    external = _weights_bytes(proto) > PROTOBUF_LIMIT
    if external:
        onnx.save_model(proto, str(final), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_name,
                        size_threshold=1024)
    else:
        onnx.save_model(proto, str(final))
    return final, external


def _check_and_move(final: Path, external: bool, path: Path) -> None:
    """Check the written file with the ONNX checker, then move it (data first) to ``path``."""
    import onnx

    onnx.checker.check_model(str(final))  # path-based: works above 2 GB too

    # Move into place: data first, then the graph file (the file users open).
    if external:
        data_name = path.name + ".data"
        os.replace(final.parent / data_name, path.parent / data_name)
    os.replace(final, path)
