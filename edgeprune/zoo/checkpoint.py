"""Checkpoint files of timm models: hashed, loaded without pickle, resampled to the model's size.

A run records the checkpoint's absolute path and sha256 (issue 12, defect 5); rebuilding the dense
model from that record goes through :func:`load_checkpoint` with ``expected_sha256`` and refuses a
file that is gone or changed instead of silently comparing against other weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file

from edgeprune._compat import import_timm
from edgeprune.atomic import file_sha256
from edgeprune.settings import SettingError
from edgeprune.errors import UserError


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks).

    Raises:
        UserError: the file is missing or unreadable.
    """
    p = Path(path)
    if not p.is_file():
        raise SettingError(f"checkpoint not found: {SettingError.literal(p)} (restore it or pass another "
                           "{checkpoint})")
    try:
        return file_sha256(p)
    except OSError as err:
        raise UserError(f"cannot read checkpoint {p}: {err.strerror or err}") from None


def check_checkpoint(path: str | Path, expected_sha256: str | None) -> str:
    """The checkpoint's sha256, checked against the one a run recorded.

    Raises:
        UserError: the file is gone, unreadable, or its hash differs.
    """
    p = Path(path)
    if not p.is_file():
        what = "recorded by the run " if expected_sha256 else ""
        raise UserError(f"checkpoint {p} {what}not found (restore it or re-run prune)")
    got = sha256_file(p)
    if expected_sha256 and got != expected_sha256:
        raise UserError(f"checkpoint {p} changed since the run was made (sha256 {got[:12]}... != "
                        f"{expected_sha256[:12]}...); restore it or re-run prune")
    return got


def _read_state_dict(p: Path) -> dict:
    try:
        if p.suffix == ".safetensors":
            sd = load_file(str(p))
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any parse failure is a bad file
        text = str(err).strip().splitlines()
        raise UserError(f"cannot read checkpoint {p}: {text[0] if text else type(err).__name__}") from None
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict):
        raise UserError(f"checkpoint {p} does not hold a state dict")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def _resample_for(model: nn.Module, sd: dict) -> dict:
    """timm's own adaptation of a ViT checkpoint to the model's grid (position embedding via
    ``resample_abs_pos_embed``, patch embedding via ``resample_patch_embed``), only when the
    checkpoint's position embedding does not fit the model."""
    pos = getattr(model, "pos_embed", None)
    if pos is None or "pos_embed" not in sd or tuple(sd["pos_embed"].shape) == tuple(pos.shape):
        return sd
    import_timm()
    from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

    if not isinstance(model, VisionTransformer):
        return sd
    return checkpoint_filter_fn(sd, model)


def load_checkpoint(model: nn.Module, path: str, name: str, expected_sha256: str | None = None) -> str:
    """Load a safetensors or timm/PyTorch weights file into ``model`` strictly, without pickle.

    A checkpoint saved at another input size (position embedding of another grid) is resampled
    with timm's ``checkpoint_filter_fn`` (bicubic, as timm does for pretrained weights).

    Args:
        model: the timm model (built at the wanted img_size).
        path: the file; name: the model name (messages).
        expected_sha256: the hash a run recorded; a different file is refused.

    Returns:
        The file's sha256.

    Raises:
        UserError: missing, changed, unreadable or ill-fitting file (the message names the first
            missing / unexpected / mis-shaped keys).
    """
    p = Path(path)
    digest = check_checkpoint(p, expected_sha256)
    sd = _resample_for(model, _read_state_dict(p))
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shape = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shape:
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:3]}")
        if shape:
            k = shape[0]
            parts.append(f"{k} has shape {tuple(sd[k].shape)}, model wants {tuple(own[k].shape)}")
        raise UserError(f"checkpoint {p} does not fit {name}: " + "; ".join(parts))
    model.load_state_dict(sd, strict=True)
    return digest
