"""ONNX deployment metadata: what a deployer needs, stored in ``ModelProto.metadata_props``.

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

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn

from edgeprune.backbone import BackboneError, backbone_of
from edgeprune.errors import UserError

#: metadata key listing the JSON-encoded keys.
JSON_KEYS_KEY = "edgeprune_json_keys"


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


def _vit_inside(model: nn.Module) -> nn.Module | None:
    try:
        return backbone_of(model)
    except BackboneError:
        return None


def block_dims(model: nn.Module) -> list[dict[str, int]]:
    """Per-block dims of a timm ViT (dense ``Attention`` or :class:`PrunedAttention`).

    Returns a list of ``{"index", "mlp_hidden", "qk_dim", "v_dim", "num_heads"}`` (the run
    record's ``blocks`` format); empty if the model has no ``blocks``.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        inner = getattr(model, "model", None) or _vit_inside(model)
        blocks = getattr(inner, "blocks", None) if inner is not None else None
    out: list[dict[str, int]] = []
    if blocks is None:
        return out
    for i, blk in enumerate(blocks):
        entry: dict[str, int] = {"index": i}
        mlp = getattr(blk, "mlp", None)
        fc1 = getattr(mlp, "fc1", None) or getattr(mlp, "fc1_x", None)  # plain MLP, or a gated one's up projection
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
        if spec is not None and hasattr(spec, "to_record"):  # seed, img_size, checkpoint sha256 ...
            try:
                md["base_model"] = spec.to_record()
            except UserError:  # the checkpoint cannot be hashed: keep the name and path
                pass
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
