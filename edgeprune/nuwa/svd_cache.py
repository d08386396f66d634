"""Cache of OFP-MHA's SVD factors: they depend on the base model's attention weights only.

nuwa §4.2 ("Breakdown of derivation"): the SVD-based MHA pruning is data-free and reusable across
sub-tasks and budgets. :func:`get_factors` keys the factors by a SHA-256 of every block's ``qkv`` and
``proj`` weights and biases (plus head count, logit scale and a format version) and keeps them

* in memory (a small LRU dict in this process), and
* on disk as ``<root>/svd/<key>.safetensors`` with ``root = $EDGEPRUNE_CACHE`` or
  ``~/.cache/edgeprune``. Files are written to a temporary file in the same directory and renamed
  into place (atomic: readers never see half a file). Unreadable or mismatching files are ignored
  and recomputed.
"""

from __future__ import annotations

import collections
import hashlib
import os
from pathlib import Path

import torch

from edgeprune.anatomy import ViTAnatomy
from edgeprune.atomic import atomic_save_safetensors
from edgeprune.nuwa.ofp_mha import BlockFactors, block_factors

VERSION = "nuwa-svd-v1"
ENV_VAR = "EDGEPRUNE_CACHE"
_MEMORY: "collections.OrderedDict[str, list[BlockFactors]]" = collections.OrderedDict()
_MEMORY_SIZE = 4
_TENSORS = ("qk_u", "qk_s", "qk_v", "vo_u", "vo_s", "vo_v")


def cache_dir() -> Path:
    """``$EDGEPRUNE_CACHE/svd``, else ``~/.cache/edgeprune/svd``."""
    root = os.environ.get(ENV_VAR)
    return (Path(root) if root else Path.home() / ".cache" / "edgeprune") / "svd"


def attention_key(anatomy: ViTAnatomy, key_bias: str = "drop") -> str:
    """SHA-256 over every block's attention weights (qkv, proj; weights and biases), shapes,
    head counts and logit scales (and the key-bias mode)."""
    h = hashlib.sha256(f"{VERSION}|{key_bias}".encode())
    for b in anatomy.blocks:
        scale = getattr(b.attn, "scale", None)
        h.update(f"|{b.index}:{b.num_heads}:{b.qk_dim}:{b.v_dim}:{scale!r}".encode())
        for t in (b.qkv.weight, b.qkv.bias, b.proj.weight, b.proj.bias):
            if t is None:
                h.update(b"none")
                continue
            t = t.detach().to("cpu", torch.float32).contiguous()
            h.update(str(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()[:32]


def clear_memory() -> None:
    """Forget the in-memory factors (tests)."""
    _MEMORY.clear()


def _to_tensors(factors: list[BlockFactors]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    meta = {"version": VERSION, "num_blocks": str(len(factors))}
    for i, f in enumerate(factors):
        for name in _TENSORS:
            tensors[f"{i}.{name}"] = getattr(f, name).contiguous()
        if f.proj_bias is not None:
            tensors[f"{i}.proj_bias"] = f.proj_bias.contiguous()
        meta[f"{i}.scale"] = repr(f.scale)
        meta[f"{i}.flags"] = f"{int(f.qk_bias)}{int(f.k_bias_augmented)}{int(f.v_bias_augmented)}"
    return tensors, meta


def _from_file(path: Path) -> list[BlockFactors] | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("version") != VERSION:
                return None
            keys = set(fh.keys())
            out = []
            for i in range(int(meta["num_blocks"])):
                t = {name: fh.get_tensor(f"{i}.{name}") for name in _TENSORS}
                pb = fh.get_tensor(f"{i}.proj_bias") if f"{i}.proj_bias" in keys else None
                flags = meta[f"{i}.flags"]
                out.append(BlockFactors(**t, proj_bias=pb, scale=float(meta[f"{i}.scale"]),
                                        qk_bias=flags[0] == "1", k_bias_augmented=flags[1] == "1",
                                        v_bias_augmented=flags[2] == "1"))
            return out
    except Exception:  # noqa: BLE001 - a corrupt cache file is recomputed, never fatal
        return None


def _write_atomic(path: Path, factors: list[BlockFactors]) -> bool:
    tensors, meta = _to_tensors(factors)
    try:
        atomic_save_safetensors(path, tensors, meta)
        return True
    except OSError:
        return False  # a read-only or full cache directory only costs the speed-up


def get_factors(anatomy: ViTAnatomy, disk: bool = True,
                key_bias: str = "drop") -> tuple[list[BlockFactors], dict]:
    """The model's per-block SVD factors, from memory, disk or computed (and then stored).

    Args:
        anatomy: the base model's anatomy.
        disk: also read/write the on-disk cache.
        key_bias: see :func:`edgeprune.nuwa.ofp_mha.block_factors`.

    Returns:
        (factors, info) with info = {"key", "source": "memory"|"disk"|"computed", "path"}.
    """
    key = attention_key(anatomy, key_bias)
    path = cache_dir() / f"{key}.safetensors"
    info = {"key": key, "path": str(path) if disk else None}
    if key in _MEMORY:
        _MEMORY.move_to_end(key)
        return _MEMORY[key], {**info, "source": "memory"}
    factors = _from_file(path) if disk and path.is_file() else None
    source = "disk"
    if factors is None or len(factors) != len(anatomy.blocks):
        factors = [block_factors(b, key_bias) for b in anatomy.blocks]
        source = "computed"
        if disk:
            info["written"] = _write_atomic(path, factors)
    _MEMORY[key] = factors
    while len(_MEMORY) > _MEMORY_SIZE:
        _MEMORY.popitem(last=False)
    return factors, {**info, "source": source}
