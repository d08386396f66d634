"""Where the ViT is inside a network (issue 55): the backbone's attribute path.

edgeprune prunes one timm ViT (``VisionTransformer``, DINOv2 included, or a timm ``Eva`` before its
conversion): the model itself, or a module *inside* a network -- a depth, segmentation or saliency
network whose head reads the ViT's tokens or intermediate blocks. The network keeps every other
module as it is; pruning edits the ViT's blocks in place, so any head that reads the ViT through
its own methods (``forward_features``, ``get_intermediate_layers``, ``forward_intermediates``) or
through hooks on ``vit.blocks[i]`` keeps working.

The path is found in this order:

1. the network itself is a ViT: ``""``;
2. the path the user named (``--backbone PATH`` / ``edgeprune.prune(..., backbone="PATH")``), kept on
   the network as the attribute :data:`BACKBONE_ATTR` (it survives ``copy.deepcopy``, which every
   trial prune does);
3. the only ViT among the network's modules (the outermost one: a ViT's own sub-modules are never
   candidates).

A ViT is a module with ``blocks`` and ``patch_embed`` (:func:`is_vit`).
"""

from __future__ import annotations

import torch.nn as nn

from edgeprune.errors import UserError

#: the attribute of a network that names its backbone's path (set by :func:`set_backbone`)
BACKBONE_ATTR = "edgeprune_backbone"

__all__ = ["BACKBONE_ATTR", "BackboneError", "backbone_of", "backbone_path", "is_vit", "keep_hooks", "replace_backbone",
           "set_backbone", "vit_paths"]

#: the hook tables of an ``nn.Module`` that a network's taps live in
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                "_forward_hooks_always_called")


def keep_hooks(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` (a module replacing ``old`` in a ViT: a merge block, an export form) with ``old``'s forward hooks, so a
    network's taps on ``vit.blocks[i]`` keep firing; returns ``new``."""
    for attr in _HOOK_TABLES:
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    return new


class BackboneError(UserError):
    """No ViT, several ViTs without a named one, or a named path that is not a ViT."""


def is_vit(module: nn.Module) -> bool:
    """Whether ``module`` is a ViT edgeprune can read: it has ``blocks`` and ``patch_embed``."""
    return hasattr(module, "blocks") and hasattr(module, "patch_embed")


def vit_paths(model: nn.Module) -> list[str]:
    """Attribute paths (``"encoder"``, ``"rgb.vit"``) of the outermost ViTs inside ``model``, in module order;
    ``[""]`` when ``model`` itself is one."""
    if is_vit(model):
        return [""]
    found: list[str] = []
    for name, module in model.named_modules():
        if name and is_vit(module) and not any(name.startswith(p + ".") for p in found):
            found.append(name)
    return found


def _resolve(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise BackboneError(f"{type(model).__name__} has no module at {path!r} "
                            f"(its ViTs: {_listing(vit_paths(model))})") from None


def _listing(paths: list[str]) -> str:
    return ", ".join(repr(p) for p in paths) if paths else "none"


def set_backbone(model: nn.Module, path: str) -> nn.Module:
    """Name ``model``'s backbone: check that ``path`` is a ViT inside it and record the path on it.

    Args:
        model: the network. path: a dotted attribute path (``"encoder"``, ``"rgb.vit"``, ``"blocks.0"`` style
            indices allowed); ``""`` names the model itself.

    Returns:
        ``model`` (marked with :data:`BACKBONE_ATTR`).

    Raises:
        BackboneError: nothing at ``path``, or what is there is not a ViT (one line, naming the ViTs found).
    """
    path = str(path).strip()
    target = model if path == "" else _resolve(model, path)
    if not is_vit(target):
        raise BackboneError(f"{type(model).__name__}.{path} is a {type(target).__name__}, not a timm ViT "
                            f"(no blocks/patch_embed; the network's ViTs: {_listing(vit_paths(model))})")
    if path:
        object.__setattr__(model, BACKBONE_ATTR, path)
    return model


def backbone_path(model: nn.Module) -> str:
    """The attribute path of ``model``'s ViT (module docstring: itself, the named one, the only one).

    Raises:
        BackboneError: no ViT inside ``model``; several and none named (naming every path); a recorded path that
            is gone.
    """
    if is_vit(model):
        return ""
    named = getattr(model, BACKBONE_ATTR, None)
    if isinstance(named, str) and named:
        set_backbone(model, named)  # still there and still a ViT
        return named
    paths = vit_paths(model)
    if len(paths) == 1:
        return paths[0]
    if not paths:
        raise BackboneError(f"{type(model).__name__} holds no timm ViT (no module with blocks and patch_embed; "
                            "edgeprune supports timm VisionTransformer models: deit_*, vit_*, deit3_*, dinov2)")
    raise BackboneError(f"{type(model).__name__} holds {len(paths)} ViTs, at {_listing(paths)}: name the one to "
                        "prune (--backbone PATH, or backbone='PATH' in Python)")


def backbone_of(model: nn.Module) -> nn.Module:
    """The ViT module of ``model`` (:func:`backbone_path`).

    Raises:
        BackboneError: as :func:`backbone_path`.
    """
    path = backbone_path(model)
    return model if path == "" else model.get_submodule(path)


def replace_backbone(model: nn.Module, new: nn.Module) -> nn.Module:
    """``model`` with its ViT replaced by ``new`` (in place for a network; ``new`` itself when ``model`` is the
    ViT)."""
    path = backbone_path(model)
    if path == "":
        return new
    parent, _, leaf = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if leaf.isdigit() and isinstance(owner, (nn.ModuleList, nn.Sequential)):
        owner[int(leaf)] = new
    else:
        setattr(owner, leaf, new)
    return model
