"""Messages about kept dims: the ``--sparsity`` rounding warning and the allocation summary."""

from __future__ import annotations

from edgeprune.errors import UserError
from edgeprune.plan import kept_dim, kept_heads

ROUNDING_WARN = 0.02  # warn when rounding moves a module's sparsity by more than 2 points


def rounding_warnings(anatomy, cfg) -> list[str]:
    """One warning per (module, dense dim) whose rounded kept count moves the achieved sparsity
    more than 2 points away from the one asked (e.g. ``--sparsity 0.3`` on 64 Q/K dims with
    ``--round-to 16`` keeps 48, sparsity 0.25).

    Args:
        anatomy: the model's anatomy; cfg: a :class:`~edgeprune.corp.CorpConfig` (sparsities,
            ``round_to``). Modules set by ``cfg.dims`` or a budget are not checked.

    Returns:
        messages (without a "warning:" prefix), empty when nothing moves that much, and empty
        when rounding leaves some module no dims (planning raises that error, alone).
    """
    if cfg.budget is not None:
        return []
    out, seen = [], set()
    what = {"mlp": ("MLP hidden channels", "mlp_hidden"), "qk": ("Q/K dims", "qk_dim"), "v": ("V dims", "v_dim")}
    for b in anatomy.blocks:
        for key, (name, attr) in what.items():
            s = cfg.sparsity_of(key)
            if cfg.layout == "fused" and key in ("qk", "v"):
                s = max(cfg.sparsity_of("qk"), cfg.sparsity_of("v"))
            dense = getattr(b, attr)
            if s <= 0 or (key, dense, s) in seen:
                continue
            seen.add((key, dense, s))
            try:
                k = kept_dim(dense, s, cfg.round_to)
            except UserError:  # planning reports it (one error line, no warnings before it)
                return []
            got = 1 - k / dense
            if abs(got - s) > ROUNDING_WARN:
                out.append(f"sparsity {s:g} on {dense} {name} keeps {k} with --round-to {cfg.round_to}: "
                           f"achieved sparsity {got:.3g}")
        s = cfg.sparsity_of("heads")
        if s > 0 and ("heads", b.num_heads, s) not in seen:
            seen.add(("heads", b.num_heads, s))
            k = kept_heads(b.num_heads, s)
            got = 1 - k / b.num_heads
            if abs(got - s) > ROUNDING_WARN:
                out.append(f"head sparsity {s:g} on {b.num_heads} heads keeps {k}: achieved sparsity {got:.3g}")
    return out


def allocation_lines(alloc: dict) -> list[str]:
    """Human-readable summary of an allocation report (``record["allocation"]``)."""
    b = alloc["budget"]
    lines = [f"allocation: {b['kind']} budget {float(b['value']):g} -> {alloc['target_cost']:,.0f}; "
             f"achieved {alloc['flops']:,.0f} FLOPs (x{alloc['flops_fraction']:.3f}), "
             f"{alloc['params']:,.0f} params (x{alloc['params_fraction']:.3f}); "
             f"chosen {alloc['chosen']} (proxy error "
             + ", ".join(f"{k} {v:.4g}" for k, v in alloc["proxy_error"].items()) + ")"]
    sel = alloc.get("selection")
    if sel:
        lines.append(f"  kept {sel['chosen']}: lowest output error vs dense on {sel['images']} calibration images ("
                     + ", ".join(f"{k} {v:.4g}" for k, v in sel["measured_output_error"].items()) + ")")
    if not alloc.get("within_tolerance", True):
        lines.append("  (the achieved cost is more than 1% under the budget: --round-to steps are too coarse)")
    for blk in alloc["blocks"]:
        lines.append(f"  block {blk['index']}: " + " ".join(f"{k}={v}" for k, v in blk["dims"].items()))
    return lines
