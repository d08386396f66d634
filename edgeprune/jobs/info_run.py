"""The job of ``edgeprune info``: the structure of a run or a dense model (per-block dims, params, FLOPs), printed
as the command prints it.

    import edgeprune
    info = edgeprune.info_run("runs/fm-50")                  # or model_name="fmnist-vit" (dense, no weights)
    info["total"]["params"], [b["qk_dim"] for b in info["blocks"]]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeprune.allocation.report import allocation_lines
from edgeprune.anatomy import find_anatomy
from edgeprune.flops import block_tokens, count_params, model_flops
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import load_model, make_spec


def info_run(run_dir: str | Path | None = None, *, model_name: str | None = None, checkpoint: str | Path | None = None,
             random_init: bool = False, num_classes: int | None = None, img_size: int | None = None,
             model_kwargs: dict[str, Any] | None = None, echo: Echo = _echo) -> dict[str, Any]:
    """The structure of ``run_dir`` or of the dense ``model_name`` [fmnist-vit when neither; built without
    weights], said line by line (``echo``) as ``edgeprune info`` prints it: a header, a run's method line and the
    allocation lines of a budgeted run, a markdown table of the blocks, the totals.

    Returns:
        ``{"name", "num_blocks", "embed_dim", "num_tokens", "num_prefix_tokens", "input_size", "run", "allocation",
        "merged", "blocks", "total"}``: ``run`` the run's ``{"method", "targets", "sparsity", "calibration"}``
        (calibration: its source; None for a dense model), ``allocation`` the allocation lines of a budgeted run
        (else empty), ``merged`` whether a block merges tokens, ``blocks`` one dict per block (``index``,
        ``query_tokens``, ``tokens``, ``merge_r``, ``num_heads``, ``head_dim``, ``qk_dim``, ``v_dim``,
        ``mlp_hidden``, ``params``, ``flops``, ``mflops``), ``total`` ``{"params", "flops", "gflops",
        "patch_embed_gflops", "head_gflops"}`` (FLOPs per image).

    Raises:
        UserError: both a run and a model, a missing run directory, an unknown model, ``img_size`` /
            ``model_kwargs`` with a run.
    """
    if run_dir is None and model_name is None:
        model_name = "fmnist-vit"
    if run_dir is not None:
        model, rec, spec = load_model(run_dir, model_name, checkpoint, random_init, num_classes, img_size,
                                      model_kwargs)
    else:  # the structure needs no weights
        spec = make_spec(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs)
        model, rec = spec.create(pretrained=False), None
    info = _structure(model, rec, spec, run_dir)
    for line in info_lines(info):
        echo(line)
    return info


def _structure(model: Any, rec: dict | None, spec: Any, run_dir: Any) -> dict[str, Any]:
    """:func:`info_run`'s result for a built model (its record ``rec`` or None)."""
    an = find_anatomy(model)
    fl = model_flops(an)
    run = None
    if rec:
        run = {"method": rec.get("method"), "targets": rec.get("targets"), "sparsity": rec.get("sparsity"),
               "calibration": (rec.get("calibration") or {}).get("source")}
    blocks = []
    for b, f, t in zip(an.blocks, fl["blocks"], block_tokens(an)):
        blocks.append({"index": b.index, "query_tokens": b.query_tokens, "tokens": t, "merge_r": b.merge_r,
                       "num_heads": b.num_heads, "head_dim": b.head_dim, "qk_dim": b.qk_dim, "v_dim": b.v_dim,
                       "mlp_hidden": b.mlp_hidden, "params": sum(p.numel() for p in b.block.parameters()),
                       "flops": f["total"], "mflops": f["total"] / 1e6})
    return {"name": f"{run_dir or spec.name}", "num_blocks": len(an.blocks), "embed_dim": an.embed_dim,
            "num_tokens": an.num_tokens, "num_prefix_tokens": an.num_prefix_tokens, "input_size": spec.input_size,
            "run": run, "allocation": allocation_lines(rec["allocation"]) if rec and rec.get("allocation") else [],
            "merged": any(b.merge_r for b in an.blocks),  # token merging (issue 44): tokens in, merged away
            "blocks": blocks,
            "total": {"params": count_params(model), "flops": fl["total"], "gflops": fl["total"] / 1e9,
                      "patch_embed_gflops": fl["patch_embed"] / 1e9, "head_gflops": fl["head"] / 1e9}}


def info_lines(info: dict[str, Any]) -> list[str]:
    """The lines ``edgeprune info`` prints for :func:`info_run`'s result ``info``."""
    lines = [f"{info['name']}: {info['num_blocks']} blocks, width {info['embed_dim']}, "
             f"{info['num_tokens']} tokens ({info['num_prefix_tokens']} prefix), input {info['input_size']}"]
    run, merged = info["run"], info["merged"]
    if run is not None:
        lines.append(f"method {run['method']} targets {run['targets']} sparsity {run['sparsity']} "
                     f"calibration: {run['calibration']}")
        lines += info["allocation"]  # budgeted run: the allocator's per-block dims and costs
    lines.append("| block | " + ("tokens | merged | " if merged else "")
                 + "heads | head_dim | qk_dim | v_dim | mlp_hidden | params | MFLOPs |")
    lines.append("|------:|" + ("-------:|-------:|" if merged else "")
                 + "------:|---------:|-------:|------:|-----------:|-------:|-------:|")
    for b in info["blocks"]:
        only = "" if b["query_tokens"] is None else f" (computes {b['query_tokens']} token(s): class-token block)"
        tokens = f"{b['tokens']} | {b['merge_r']} | " if merged else ""
        lines.append(f"| {b['index']}{only} | {tokens}{b['num_heads']} | {b['head_dim']} | {b['qk_dim']} | "
                     f"{b['v_dim']} | {b['mlp_hidden']} | {b['params']:,} | {b['flops'] / 1e6:.1f} |")
    t = info["total"]
    lines.append(f"total: {t['params']:,} params, {t['flops'] / 1e9:.3f} GFLOPs per image "
                 f"(patch embedding {t['patch_embed_gflops']:.3f}, head {t['head_gflops']:.3f})")
    return lines


__all__ = ["info_lines", "info_run"]
