"""Which layers of a pruned model STARFISH trains: the *reduced* ones (starfish App. B).

edgeprune's pruned models are physically smaller, so "the surviving weights of the pruned tensors"
are exactly the weights of the layers whose shapes differ from the dense model's: ``mlp.fc1`` /
``mlp.fc2`` of blocks with fewer MLP hidden channels, ``attn.qkv`` / ``attn.proj`` of blocks with
fewer Q/K or V head dims. Everything else stays frozen.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.nn as nn

from edgeprune.anatomy import find_anatomy
from edgeprune.errors import UserError


def reduced_modules(pruned: nn.Module, dense: nn.Module) -> list[str]:
    """Names (in ``pruned.named_modules()``) of the layers whose shapes differ from the dense model.

    For a block with fewer MLP hidden channels than the dense block: its ``mlp.fc1`` (a gated MLP's
    ``mlp.fc1_g`` and ``mlp.fc1_x``) and ``mlp.fc2``; with fewer heads or a smaller ``qk_dim`` or ``v_dim``: its
    ``attn.qkv`` and ``attn.proj``.
    Empty for a model pruned at sparsity 0.

    Raises:
        UserError: the two models do not have the same blocks (count, width).
    """
    pa, da = find_anatomy(pruned), find_anatomy(dense)
    if len(pa.blocks) != len(da.blocks) or pa.embed_dim != da.embed_dim:
        raise UserError(f"the pruned model ({len(pa.blocks)} blocks, width {pa.embed_dim}) is not a pruned "
                        f"version of the dense model ({len(da.blocks)} blocks, width {da.embed_dim})")
    names = {id(m): n for n, m in pruned.named_modules()}
    out: list[str] = []
    for p, d in zip(pa.blocks, da.blocks):
        if (p.num_heads, p.qk_dim, p.v_dim) != (d.num_heads, d.qk_dim, d.v_dim):
            out += [names[id(p.qkv)], names[id(p.proj)]]
        if p.mlp_hidden != d.mlp_hidden:
            out += [names[id(lin)] for _, lin in p.mlp_inputs] + [names[id(p.fc2)]]  # fc1 (gated: fc1_g, fc1_x)
    return out


def reduced_modules_from_record(record: dict[str, Any]) -> list[str]:
    """Like :func:`reduced_modules` but from a run record's ``blocks`` vs ``dense_blocks``; names
    relative to the ViT (``blocks.<i>.attn.qkv`` ...). Empty when nothing is pruned. The record does not say
    whether an MLP is gated: its layers are named as a plain MLP's (``mlp.fc1``); callers use the list to
    tell whether anything was reduced.

    Raises:
        UserError: the record lacks ``blocks`` / ``dense_blocks`` or they disagree in length.
    """
    blocks, dense = record.get("blocks"), record.get("dense_blocks")
    if not isinstance(blocks, list) or not isinstance(dense, list) or len(blocks) != len(dense):
        raise UserError("run record has no matching 'blocks' / 'dense_blocks' entries")
    out = []
    for b, d in zip(blocks, dense):
        i = b.get("index")
        if (b["num_heads"], b["qk_dim"], b["v_dim"]) != (d["num_heads"], d["qk_dim"], d["v_dim"]):
            out += [f"blocks.{i}.attn.qkv", f"blocks.{i}.attn.proj"]
        if b["mlp_hidden"] != d["mlp_hidden"]:
            out += [f"blocks.{i}.mlp.fc1", f"blocks.{i}.mlp.fc2"]
    return out


def _resolve_trainable(model: nn.Module, names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Module or parameter names -> (module-ish names as given, parameter names), model order."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    wanted: set[str] = set()
    given = list(dict.fromkeys(names))
    for n in given:
        if n in params:
            wanted.add(n)
        elif n in modules and n != "":
            sub = [f"{n}.{pn}" for pn, _ in modules[n].named_parameters()]
            if not sub:
                raise UserError(f"trainable module {n!r} has no parameters")
            wanted.update(sub)
        else:
            raise UserError(f"trainable: the model has no module or parameter named {n!r}")
    return given, [n for n in params if n in wanted]


resolve_trainable = _resolve_trainable
