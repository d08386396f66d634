"""Validation of a run directory's ``run.json``: a run directory is user input.

Every field that edgeprune reads back from a record (``load_run``, ``spec_from_record``, ``eval``,
``info``, ``export``, ``heal``) is checked here, once, when the record is read
(:func:`edgeprune.artifact.read_record`); a field of the wrong type or value becomes one
:class:`~edgeprune.errors.UserError` line naming the field and the file, never a ``KeyError`` or
``TypeError`` from deep inside the loader. Fields that are absent from older records keep their
defaults (``seed`` 0, no ``weights_sha256``, ...).
"""

from __future__ import annotations

import os
import re
from typing import Any

from edgeprune.errors import UserError

__all__ = ["validate_record", "BLOCK_INT_KEYS"]

#: per-block entries ``edgeprune.surgery.apply_structure`` reads (positive integers)
BLOCK_INT_KEYS = ("num_heads", "qk_dim", "v_dim", "mlp_hidden")
#: optional per-block entries (positive integers when present)
BLOCK_OPTIONAL_INT_KEYS = ("head_dim", "query_tokens")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _bad(path: Any, field: str, want: str, got: Any) -> UserError:
    shown = repr(got)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return UserError(f"{path}: field {field!r} must be {want}, got {shown} (the run directory is damaged)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(path, rec: dict, field: str, ok, want: str, *, required: bool = False) -> None:
    """``rec[field]`` (dotted for nested entries in messages) passes ``ok`` or is absent/None."""
    key = field.rsplit(".", 1)[-1]
    if key not in rec:
        if required:
            raise UserError(f"{path}: field {field!r} is missing (the run directory is damaged)")
        return
    v = rec[key]
    if not ok(v):
        raise _bad(path, field, want, v)


def _pos_int_or_none(v: Any) -> bool:
    return v is None or (_is_int(v) and v >= 1)


def _str_or_none(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _sha_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, str) and _SHA256.fullmatch(v) is not None)


def _check_base_model(path, base: Any) -> None:
    if not isinstance(base, dict):
        raise _bad(path, "base_model", "an object", base)
    _check(path, base, "base_model.name", lambda v: isinstance(v, str) and v.strip() != "", "a model name",
           required=True)
    _check(path, base, "base_model.checkpoint", _str_or_none, "a path or null")
    _check(path, base, "base_model.checkpoint_sha256", _sha_or_none, "a sha256 hex digest or null")
    _check(path, base, "base_model.random_init", lambda v: v is None or isinstance(v, bool), "true or false")
    _check(path, base, "base_model.seed", lambda v: v is None or _is_int(v), "an integer")
    _check(path, base, "base_model.num_classes", _pos_int_or_none, "a positive integer or null")
    _check(path, base, "base_model.img_size", _pos_int_or_none, "a positive integer or null")
    _check(path, base, "base_model.model_kwargs", lambda v: v is None or isinstance(v, dict), "an object or null")
    _check(path, base, "base_model.input_size",
           lambda v: isinstance(v, list) and len(v) == 3 and all(_is_int(x) and x >= 1 for x in v),
           "a list of 3 positive integers")
    _check(path, base, "base_model.output_kind", lambda v: isinstance(v, str), "a string")
    _check(path, base, "base_model.preprocessing", lambda v: v is None or isinstance(v, dict), "an object")


def _check_blocks(path, blocks: Any) -> None:
    if not isinstance(blocks, list):
        raise _bad(path, "blocks", "a list of per-block dims", blocks)
    for i, b in enumerate(blocks):
        if not isinstance(b, dict):
            raise _bad(path, f"blocks[{i}]", "an object", b)
        for key in BLOCK_INT_KEYS:
            _check(path, b, f"blocks[{i}].{key}", lambda v: _is_int(v) and v >= 0, "an integer >= 0",
                   required=True)
        for key in BLOCK_OPTIONAL_INT_KEYS:
            _check(path, b, f"blocks[{i}].{key}", _pos_int_or_none, "a positive integer or null")


def validate_record(rec: Any, path: str | os.PathLike) -> dict:
    """Check every field edgeprune reads from a run record; return the record.

    Args:
        rec: the parsed ``run.json``.
        path: the file, for the messages.

    Raises:
        UserError: ``"<path>: field 'base_model.name' is missing ..."`` / ``"... must be <what>,
            got <value> ..."`` -- one line naming the field and the file.
    """
    if not isinstance(rec, dict):
        raise UserError(f"{path}: not a run record (a JSON object), got {type(rec).__name__}")
    for key in ("base_model", "blocks"):
        if key not in rec:
            raise UserError(f"{path} has no {key!r} entry (the run directory is damaged)")
    _check_base_model(path, rec["base_model"])
    _check_blocks(path, rec["blocks"])
    _check(path, rec, "weights_sha256", _sha_or_none, "a sha256 hex digest")
    for key in ("head", "calibration", "allocation", "settings", "evaluation", "config", "bias_correction"):
        _check(path, rec, key, lambda v: v is None or isinstance(v, dict), "an object or null")
    for key in ("sparsity", "achieved_sparsity"):
        _check(path, rec, key, lambda v: v is None or isinstance(v, dict), "an object or null")
    for key in ("method", "targets", "edgeprune_version"):
        _check(path, rec, key, lambda v: v is None or isinstance(v, str), "a string")
    head = rec.get("head")
    if isinstance(head, dict) and "classes" in head:
        _check(path, head, "head.classes", lambda v: isinstance(v, list) and all(_is_int(c) for c in v),
               "a list of class indices")
    return rec
