"""Run directories: a pruned model as ``model.safetensors`` + ``run.json``, written atomically.

``run.json`` (the run record) holds: ``edgeprune_version``, ``base_model`` (name, checkpoint,
input size, preprocessing), ``method``, ``targets``, ``sparsity`` (requested per target),
``achieved_sparsity``, ``blocks`` (per-block num_heads, head_dim, qk_dim, v_dim, mlp_hidden),
``calibration`` (source, size, seed), ``settings`` (criterion, ridge alpha, round_to, ...),
``params``, ``flops`` and timings, ``config`` (the method's config object as
``dataclasses.asdict``), ``device`` and ``created``. :func:`new_record` builds it for every method
(prune, heal's input, derive). :func:`load_run` rebuilds the model from the record
(architecture + per-block shapes) and loads the weights strictly -- no pickle.

Output checks (:func:`check_new_dir`, :func:`check_writable`) run before any expensive work; a
write failure while saving (disk full, read-only file system, no permission) becomes one
:class:`~edgeprune.errors.RuntimeFault` line and leaves nothing half-written.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file

from edgeprune import atomic
from edgeprune._version import __version__
from edgeprune.atomic import atomic_dir, file_sha256
from edgeprune.errors import RuntimeFault, UserError
from edgeprune.residual import apply_embed_structure
from edgeprune.run_record import validate_record
from edgeprune.surgery import apply_head_structure, apply_structure
from edgeprune.tokens.apply import apply_token_merge
from edgeprune.zoo.registry import spec_from_record

WEIGHTS = "model.safetensors"
RECORD = "run.json"


def write_fault(path: str | os.PathLike, err: BaseException) -> RuntimeFault:
    """The one-line error for a failed write of ``path`` (disk full, read-only, no permission)."""
    reason = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
    return RuntimeFault(f"cannot write {path}: {reason} (free space / choose a writable -o)")


def check_writable(folder: str | os.PathLike) -> Path:
    """Create ``folder`` if needed and probe-write a file in it (removed at once).

    Call it before expensive work so that a read-only or missing output location fails first.

    Raises:
        UserError: a file is in the way (the folder or one of its parents is a file).
        RuntimeFault: the folder cannot be created or written (EROFS, EACCES, ENOSPC, ...).
    """
    d = Path(folder) if str(folder) else Path(".")
    for parent in (d, *d.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"cannot write into {d}: {parent} is a file, not a folder (choose another -o)")
            break
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".edgeprune-probe.", dir=d)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        raise write_fault(d, err) from None
    return d


def check_new_dir(path: str | os.PathLike) -> Path:
    """Check that a new run directory can be written at ``path``; return it as Path.

    The parent folder is created if needed and probed with a small write.

    Raises:
        UserError: ``path`` exists (edgeprune never overwrites a run).
        RuntimeFault: the parent folder cannot be created or written.
    """
    p = Path(path)
    if p.exists():
        raise UserError(f"output directory {p} already exists; choose another -o/--out")
    check_writable(p.parent)
    return p


def save_run(path: str | os.PathLike, model: nn.Module, record: dict[str, Any]) -> Path:
    """Write ``model.safetensors`` and ``run.json`` into a new directory, atomically.

    Everything is written into a temporary sibling directory first and renamed into place, so an
    interrupted or failed save leaves no half-written run directory. The written ``run.json`` is
    ``record`` plus ``weights_sha256``, the sha256 of the written ``model.safetensors``
    (:func:`load_run` refuses weights that no longer match it); ``record`` itself is not changed.

    Raises:
        UserError: the directory already exists.
        RuntimeFault: the write failed (disk full, read-only file system, no permission).
    """
    out = check_new_dir(path)
    try:
        with atomic_dir(out) as tmp:
            state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            # deterministic bytes (sorted names and metadata): identical runs, identical files
            atomic.write_safetensors(tmp / WEIGHTS, state, {"format": "pt", "edgeprune_record": RECORD})
            record = {**record, "weights_sha256": file_sha256(tmp / WEIGHTS)}  # the caller's dict untouched
            (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")
            if out.exists():
                raise UserError(f"output directory {out} appeared while saving; not overwriting it")
    except (OSError, SafetensorError) as err:
        if isinstance(err, OSError) and err.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise UserError(f"output directory {out} appeared while saving; not overwriting it") from None
        raise write_fault(out, err) from None
    return out


def _version() -> str:
    return __version__


def config_record(config: Any) -> dict[str, Any]:
    """A config object as it goes into the record: ``dataclasses.asdict`` (tuples as lists)."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return json.loads(json.dumps(dataclasses.asdict(config), default=str))
    return dict(config)


def new_record(method: str, base_model: dict[str, Any], config: Any, dense: dict[str, Any],
               pruned: dict[str, Any], *, calibration: dict[str, Any] | None = None,
               timing: dict[str, float] | None = None, device: str = "cpu",
               **extra: Any) -> dict[str, Any]:
    """The run record of a pruned / derived model -- built here and only here.

    Args:
        method: "corp", "uncompensated", "nuwa", ...
        base_model: the base model's ``ModelSpec.to_record()`` (or ``{"name": ...}``).
        config: the method's config object (a dataclass: CorpConfig, DeriveConfig, ...),
            recorded as ``dataclasses.asdict(config)`` under ``config``.
        dense, pruned: :func:`edgeprune.api.structure_summary` of the dense and the result model
            (``params``, ``flops``, ``blocks``).
        calibration: source description, number of images, seed, ...
        timing: seconds per stage (``total_s`` at least).
        device: the torch device the work ran on.
        **extra: further top-level entries (``targets``, ``sparsity``, ``achieved_sparsity``,
            ``settings``, ``solve``, ``head``, ``derivation`` ...), kept in the order given.

    Returns:
        the JSON-serialisable record read by :func:`load_run`, ``edgeprune eval/info``, the ONNX
        exporter's metadata and ``edgeprune heal``.
    """
    record: dict[str, Any] = {
        "edgeprune_version": _version(),
        "base_model": base_model,
        "method": method,
    }
    record.update(extra)
    record.update({
        "config": config_record(config),
        "device": str(device),
        "calibration": calibration or {},
        "blocks": pruned["blocks"],
        "dense_blocks": dense["blocks"],
        "params": pruned["params"], "dense_params": dense["params"],
        "flops": pruned["flops"], "dense_flops": dense["flops"],
        "timing": timing or {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    return record


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """The run record of a run directory.

    Raises:
        UserError: not a run directory, an unreadable record, or a field of the wrong type or
            value (:func:`edgeprune.run_record.validate_record`: one line naming field and file).
    """
    p = Path(path)
    if not (p / RECORD).is_file() or not (p / WEIGHTS).is_file():
        raise UserError(f"{p} is not an edgeprune run directory (needs {RECORD} and {WEIGHTS})")
    try:
        rec = json.loads((p / RECORD).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {p / RECORD}: {err}") from None
    return validate_record(rec, p / RECORD)


def check_weights(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Refuse a run's ``model.safetensors`` whose sha256 differs from ``record["weights_sha256"]``
    (recorded by :func:`save_run`; records of older runs have none and are not checked).

    Raises:
        UserError: the file changed since the run was saved (damaged or altered), or cannot be read.
    """
    want = record.get("weights_sha256")
    if not want:
        return
    f = Path(path) / WEIGHTS
    try:
        got = file_sha256(f)
    except OSError as err:
        raise UserError(f"cannot read {f}: {err.strerror or err}") from None
    if got != want:
        raise UserError(f"{f} changed since the run was saved (sha256 {got[:12]}... != recorded "
                        f"{want[:12]}...): the weights are damaged or were altered")


def _load_weights(f: Path) -> dict:
    """The tensors of a run's weights file; a truncated, empty or garbled file is named as damaged.

    Raises:
        UserError: the file is not a readable safetensors file.
    """
    from safetensors import SafetensorError

    try:
        return load_file(str(f))
    except (SafetensorError, OSError) as err:
        if isinstance(err, OSError) and err.errno is not None and err.errno not in (errno.EIO, errno.EINVAL):
            raise UserError(f"cannot read {f}: {err.strerror or err}") from None
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise UserError(f"{f} is damaged (truncated, empty or not a safetensors file: {reason})") from None


def load_run(path: str | os.PathLike) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a run's model (eval mode, float32, CPU) and return it with its record.

    Raises:
        UserError: not a run directory, a damaged record or weights file, weights changed since the
            run was saved (``weights_sha256``), or weights that do not fit the recorded structure.
    """
    p = Path(path)
    rec = read_record(p)
    check_weights(p, rec)
    spec = spec_from_record(rec["base_model"])
    model = spec.create(pretrained=False)
    try:
        apply_embed_structure(model, rec.get("embed"))  # issue 33: the sliced residual width first
        apply_structure(model, rec["blocks"])
        if rec.get("head"):  # NuWa: head suppressed or sliced to the target classes
            apply_head_structure(model, rec["head"])
        state = _load_weights(p / WEIGHTS)
        model.load_state_dict(state, strict=True)
        if rec.get("tokens_merge"):  # issue 44: token merging (its modules hold no weights of their own)
            try:
                apply_token_merge(model, list(rec["tokens_merge"]["r"]))
            except UserError as err:
                raise UserError(f"{p}: the recorded token merging does not fit the model: {err}") from None
    except (ValueError, RuntimeError, KeyError) as err:
        raise UserError(f"{p}: weights do not fit the recorded model: {str(err).splitlines()[0]}") from None
    return model.eval(), rec
