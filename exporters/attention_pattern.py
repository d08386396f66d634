"""Rewrite a ViT's attention into the ONNX pattern ONNX Runtime's transformer optimizer fuses.

The packed form (timm ``Attention``, :class:`edgeprune.layers.PrunedAttention`) exports one ``qkv``
MatMul, a Split/Reshape, and ``F.scaled_dot_product_attention`` lowered by torch to
``Mul(q, sqrt(scale))`` / ``Mul(k^T, sqrt(scale))``: a pattern no fusion of
``onnxruntime.transformers.optimizer`` (``fusion_attention.py``) matches. :func:`fusible_copy`
returns a copy of the model whose attention is written the way that fusion expects::

    q = Reshape(Add(MatMul(x, Wq), bq)) -> Transpose(0, 2, 1, 3)      (B, H, N, d_qk)
    k = Reshape(Add(MatMul(x, Wk), bk)) -> Transpose(0, 2, 3, 1)      (B, H, d_qk, N)
    v = Reshape(Add(MatMul(x, Wv), bv)) -> Transpose(0, 2, 1, 3)      (B, H, N, d_v)
    o = MatMul(Softmax(Div(MatMul(q, k), 1 / scale)), v) -> Transpose -> Reshape   (B, N, H*d_v)
    y = Add(MatMul(o, Wproj), bproj)                                   (B, N, D)

The function is the same (float rounding aside: the scale is a Div instead of SDPA's split Muls).
Missing biases become zero biases (the fusion needs the ``Add`` nodes). Different Q/K and V head
dims fuse into an ``Attention`` node with ``qkv_hidden_sizes``.

Two block-level details make every block fuse, the first one included:

* the residual sum is written ``attn(norm1(x)) + x`` (IEEE addition is commutative, so this is
  bit-exact). The fusion starts from the ``SkipLayerNormalization`` after the attention and takes
  the *first* of its inputs made by an ``Add`` as the output projection's bias ``Add``; in the
  first block the other input (the position-embedding ``Add``) is an ``Add`` too and came first.
* a ``LayerScale`` after the attention (``ls1``, DINOv2) is folded into ``proj`` (the fusion wants
  the projection's ``Add`` straight before the residual sum).

Converted (:data:`ATTENTION_CONVERTERS`, :data:`BLOCK_CONVERTERS`, exact types): timm ``Attention``
without q/k norm, scale norm or gate; :class:`~edgeprune.layers.PrunedAttention` (uneven qk_dim /
v_dim, kept heads, any layout, biases on or off); timm ``Block``. Left as they are: edgeprune's
:class:`~edgeprune.layers.rotary_attention.RotaryAttention` (RoPE between the projections and the
logits: no ORT fusion of this optimizer matches a rotary ViT attention), the class-token last
block and the token-merging block (:mod:`edgeprune.layers.class_token_block`,
:mod:`edgeprune.tokens.model`: they read ``attn.qkv`` directly; their query-subset / log-size-biased
attention matches no fusion either), and any module not in the registries.

:func:`count_fused_attention` runs the optimizer on a file and counts what it fused.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from edgeprune.backbone import keep_hooks
from edgeprune.errors import UserError
from edgeprune.layers.class_token_block import ClassTokenBlock
from edgeprune.layers.pruned_attention import PrunedAttention
from edgeprune.tokens.model import TokenMergeBlock
from edgeprune.tokens.unmerge import TokenUnmergeBlock

__all__ = ["ATTENTION_CHOICES", "STANDARD_ATTENTION_OPSET", "ATTENTION_CONVERTERS", "BLOCK_CONVERTERS",
           "FusibleAttention", "FusibleBlock",
           "check_attention_choice", "count_fused_attention", "fusible_copy", "fused_attention_line"]

#: ``export_onnx(attention=...)``: "fusible" (this module's pattern), "packed" (the model as it is) or "standard"
#: (ONNX's own ``Attention`` op, opset >= 23: :data:`STANDARD_ATTENTION_OPSET`)
ATTENTION_CHOICES = ("fusible", "packed", "standard")
#: the first opset with the standard ``Attention`` op (ONNX 1.18)
STANDARD_ATTENTION_OPSET = 23


def check_attention_choice(attention: str) -> str:
    """``attention`` if it is one of :data:`ATTENTION_CHOICES`.

    Raises:
        UserError: any other value.
    """
    if attention not in ATTENTION_CHOICES:
        raise UserError(f"unknown attention form {attention!r} (choose from {', '.join(ATTENTION_CHOICES)})")
    return attention


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Linear:
    """A Linear holding copies of ``weight`` (out, in) and ``bias`` (out,) or zeros."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=True, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is None:
            lin.bias.zero_()
        else:
            lin.bias.copy_(bias)
    return lin


class FusibleAttention(nn.Module):
    """Multi-head self-attention with separate ``q``, ``k``, ``v`` Linears, in ORT's fusible pattern.

    Args:
        q_weight, k_weight: (H*d_qk, D); v_weight: (H*d_v, D); rows head-major.
        q_bias, k_bias: (H*d_qk,) or None; v_bias: (H*d_v,) or None (None: zeros).
        proj_weight: (D_out, H*d_v); proj_bias: (D_out,) or None.
        num_heads: H.
        scale: the logit scale (the graph divides by ``1 / scale``).

    Shapes:
        forward: x (B, N, D) -> (B, N, D_out). An ``attn_mask`` (bool: True = attend, or float: added
        to the logits, as SDPA takes it) or ``is_causal`` is applied too (such a graph does not fuse).
    """

    def __init__(self, q_weight: torch.Tensor, q_bias: Optional[torch.Tensor], k_weight: torch.Tensor,
                 k_bias: Optional[torch.Tensor], v_weight: torch.Tensor, v_bias: Optional[torch.Tensor],
                 proj_weight: torch.Tensor, proj_bias: Optional[torch.Tensor], num_heads: int,
                 scale: float) -> None:
        super().__init__()
        H = int(num_heads)
        if q_weight.shape != k_weight.shape or q_weight.shape[0] % H or v_weight.shape[0] % H:
            raise ValueError(f"q/k/v rows {q_weight.shape[0]}/{k_weight.shape[0]}/{v_weight.shape[0]} "
                             f"do not split into {H} heads")
        self.num_heads = H
        self.qk_dim = q_weight.shape[0] // H
        self.v_dim = v_weight.shape[0] // H
        self.head_dim = self.v_dim
        self.scale = float(scale)
        self.q = _linear(q_weight, q_bias)
        self.k = _linear(k_weight, k_bias)
        self.v = _linear(v_weight, v_bias)
        self.proj = _linear(proj_weight, proj_bias)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                **_: Any) -> torch.Tensor:
        B, N, _ = x.shape
        H, dq, dv = self.num_heads, self.qk_dim, self.v_dim
        q = self.q(x).reshape(B, N, H, dq).transpose(1, 2)          # (B, H, N, d_qk)
        k = self.k(x).reshape(B, N, H, dq).permute(0, 2, 3, 1)      # (B, H, d_qk, N)
        v = self.v(x).reshape(B, N, H, dv).transpose(1, 2)          # (B, H, N, d_v)
        logits = torch.matmul(q, k) / (1.0 / self.scale)            # (B, H, N, N)
        if is_causal:
            causal = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
            logits = logits.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            logits = (logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                      else logits + attn_mask)
        out = torch.matmul(logits.softmax(dim=-1), v)                # (B, H, N, d_v)
        return self.proj(out.transpose(1, 2).reshape(B, N, H * dv))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, qk_dim={self.qk_dim}, v_dim={self.v_dim}, scale={self.scale:.6g}"


def _split_packed(attn: nn.Module, H: int, dq: int, dv: int) -> FusibleAttention:
    """A :class:`FusibleAttention` from a packed ``qkv`` with rows ``[q (H*dq); k (H*dq); v (H*dv)]``."""
    w, b = attn.qkv.weight.detach(), attn.qkv.bias
    b = None if b is None else b.detach()
    if w.shape[0] != H * (2 * dq + dv):
        raise ValueError(f"qkv has {w.shape[0]} rows, expected {H} x (2 x {dq} + {dv})")
    cuts = (slice(0, H * dq), slice(H * dq, 2 * H * dq), slice(2 * H * dq, H * (2 * dq + dv)))
    parts = [(w[c], None if b is None else b[c]) for c in cuts]
    proj = attn.proj
    return FusibleAttention(*parts[0], *parts[1], *parts[2], proj.weight.detach(),
                            None if proj.bias is None else proj.bias.detach(), H, float(attn.scale))


def _from_timm_attention(attn: nn.Module) -> Optional[nn.Module]:
    """timm ``Attention`` -> :class:`FusibleAttention`; None (leave it) with q/k norm, scale norm or a gate."""
    if not all(isinstance(getattr(attn, n, nn.Identity()), nn.Identity) for n in ("q_norm", "k_norm", "norm")):
        return None
    if getattr(attn, "gate", None) is not None:
        return None
    d = int(attn.head_dim)
    return _split_packed(attn, int(attn.num_heads), d, d)


def _from_pruned_attention(attn: nn.Module) -> nn.Module:
    """:class:`~edgeprune.layers.PrunedAttention` (H heads, d_qk, d_v) -> :class:`FusibleAttention`."""
    return _split_packed(attn, int(attn.num_heads), int(attn.qk_dim), int(attn.v_dim))


def _attention_converters() -> dict[type, Callable[[nn.Module], Optional[nn.Module]]]:
    from timm.layers.attention import Attention

    return {Attention: _from_timm_attention, PrunedAttention: _from_pruned_attention}


class FusibleBlock(nn.Module):
    """A pre-norm ViT block (timm ``Block``'s submodules) with the residual sums written branch-first.

    ``x = attn(norm1(x)) + x;  x = ls2(mlp(norm2(x))) + x`` (``ls1`` folded into ``attn.proj``;
    drop paths are the identity in eval mode and kept).

    Shapes:
        forward: x (B, N, D) -> (B, N, D).
    """

    _PARTS = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        for name in self._PARTS:
            part = getattr(block, name, None)
            setattr(self, name, nn.Identity() if part is None else part)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        x = self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal))) + x
        return self.drop_path2(self.ls2(self.mlp(self.norm2(x)))) + x


def _fold_layer_scale(block: nn.Module) -> None:
    """Fold a timm ``LayerScale`` ``ls1`` (gamma (D,)) into ``block.attn.proj`` (a FusibleAttention's), in place."""
    from timm.layers import LayerScale

    ls, attn = getattr(block, "ls1", None), block.attn
    if type(ls) is not LayerScale or not isinstance(attn, FusibleAttention):
        return
    gamma = ls.gamma.detach()
    with torch.no_grad():
        attn.proj.weight.mul_(gamma[:, None])
        attn.proj.bias.mul_(gamma)
    block.ls1 = nn.Identity()


def _from_timm_block(block: nn.Module) -> nn.Module:
    """timm ``Block`` -> :class:`FusibleBlock` with its attention converted (if registered)."""
    _convert_children(block)
    out = FusibleBlock(block)
    _fold_layer_scale(out)
    return out


def _block_converters() -> dict[type, Callable[[nn.Module], nn.Module]]:
    from timm.models.vision_transformer import Block

    return {Block: _from_timm_block}


def _leave_alone() -> tuple[type, ...]:
    """Blocks that read their ``attn``'s ``qkv`` directly (converting it would break them)."""
    return (ClassTokenBlock, TokenMergeBlock, TokenUnmergeBlock)


#: exact attention class -> converter (module -> export-form module, or None to leave it); add entries to extend
ATTENTION_CONVERTERS: dict[type, Callable[[nn.Module], Optional[nn.Module]]] = _attention_converters()
#: exact block class -> converter (block -> export-form block, its attention converted)
BLOCK_CONVERTERS: dict[type, Callable[[nn.Module], nn.Module]] = _block_converters()


def _convert_children(module: nn.Module) -> None:
    """Replace, in place, every registered block / attention below ``module`` by its export form."""
    skip = _leave_alone()
    for name, child in list(module.named_children()):
        kind = type(child)
        if kind in BLOCK_CONVERTERS:  # a network's taps (forward hooks on the block) kept
            setattr(module, name, keep_hooks(child, BLOCK_CONVERTERS[kind](child)))
        elif kind in ATTENTION_CONVERTERS:
            new = ATTENTION_CONVERTERS[kind](child)
            if new is not None:
                setattr(module, name, new.train(child.training))
        elif not isinstance(child, skip):
            _convert_children(child)


def fusible_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every registered attention (and timm ``Block``) in the fusible form.

    Args:
        model: a timm ViT, a pruned edgeprune model, or any module holding them.

    Returns:
        the copy (same training mode, device and dtype); ``model`` itself is not changed. It computes
        the same function up to float rounding (module docstring); what is not registered is copied as
        it is.
    """
    out = copy.deepcopy(model)
    if type(out) in BLOCK_CONVERTERS:
        out = BLOCK_CONVERTERS[type(out)](out)
    elif type(out) in ATTENTION_CONVERTERS:
        out = ATTENTION_CONVERTERS[type(out)](out) or out
    else:
        _convert_children(out)
    return out.train(model.training)


def count_fused_attention(onnx_path: str | os.PathLike, *, output: str | os.PathLike | None = None,
                          opt_level: int = 0) -> dict[str, int]:
    """Run ``onnxruntime.transformers.optimizer`` (model type ``vit``) on a file and count its fusions.

    ``num_heads=0, hidden_size=0``: the optimizer reads heads and sizes of each block from its Q
    ``Reshape`` (so per-block and uneven Q/K vs V dims work). ``opt_level=0``: its Python fusions only
    (what its CLI does for ``vit``).

    Args:
        onnx_path: the exported graph.
        output: where to write the optimized graph (None: not written).
        opt_level: ONNX Runtime graph optimization level before the fusions (0, 1, 2, 99).

    Returns:
        ``{"attention": fused Attention nodes, "multi_head_attention": fused MultiHeadAttention nodes,
        "fused": their sum, "attention_blocks": Softmax nodes in the input graph (one per attention)}``.

    Raises:
        ImportError: onnxruntime (with its ``transformers`` tools) is not installed.
    """
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    blocks = sum(n.op_type == "Softmax" for n in onnx.load(str(onnx_path), load_external_data=False).graph.node)
    names = ("onnxruntime.transformers", "optimizer", "fusion_base", "onnx_model", "onnx_model_bert",
             "fusion_attention", "fusion_utils", "shape_infer_helper", "fusion_skiplayernorm")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        opt = optimize_model(str(onnx_path), model_type="vit", num_heads=0, hidden_size=0, opt_level=opt_level)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    ops = [n.op_type for n in opt.model.graph.node]
    if output is not None:
        opt.save_model_to_file(str(output))
    counts = {"attention": ops.count("Attention"), "multi_head_attention": ops.count("MultiHeadAttention")}
    counts["fused"] = counts["attention"] + counts["multi_head_attention"]
    counts["attention_blocks"] = int(blocks)
    return counts


def fused_attention_line(onnx_path: str | os.PathLike) -> str:
    """One line for ``edgeprune verify``: how many attention blocks ONNX Runtime's optimizer fuses.

    Never raises: an unavailable optimizer (or one that fails on this graph) is said in the line. A graph that
    already holds ONNX's standard ``Attention`` op (``attention="standard"``) is counted, not optimized.
    """
    try:
        import onnx

        nodes = onnx.load(str(onnx_path), load_external_data=False).graph.node
        standard = sum(n.op_type == "Attention" and n.domain in ("", "ai.onnx") for n in nodes)
        if standard:
            return (f"attention: {standard} ONNX Attention ops (opset {STANDARD_ATTENTION_OPSET}, one per attention "
                    f"block; the runtime's own kernel, no fusion needed)")
    except Exception:  # unreadable here: the optimizer's count below says why
        pass
    try:
        c = count_fused_attention(onnx_path)
    except ImportError as err:
        return f"ORT attention fusion: not checked (onnxruntime.transformers unavailable: {err})"
    except Exception as err:  # a diagnostic must never fail verify
        msg = str(err).strip().splitlines()
        return f"ORT attention fusion: not checked ({type(err).__name__}: {msg[0] if msg else ''})"
    kinds = f"{c['attention']} Attention, {c['multi_head_attention']} MultiHeadAttention"
    hint = "" if c["fused"] >= c["attention_blocks"] else " (export with --attention fusible to fuse them all)"
    return (f"ORT attention fusion (onnxruntime.transformers.optimizer, vit): {c['fused']} of "
            f"{c['attention_blocks']} attention blocks fused ({kinds}){hint}")
