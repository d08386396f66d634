"""A network's output as the checks compare it: one tensor, or one tensor per output (issue 55).

A classifier returns logits; a dense-prediction network returns a map, or a tuple or dict of tensors (a depth map
and features, a mask and scores). :func:`output_tensor` gives the comparable form, :func:`output_error` the
relative squared error to the dense network's output -- per output, averaged, so that a small output counts as
much as a large one (METHODS.md §6, "Dense outputs") -- and the other helpers slice, compare and move that form.
"""

from __future__ import annotations

import torch

__all__ = ["detached_cpu", "output_error", "output_tensor", "outputs_equal", "take_rows"]


def output_error(out, ref) -> float:
    """Relative squared error ``||out - ref||^2 / ||ref||^2`` (float64); for a network with several outputs (tuples
    from :func:`output_tensor`) the mean of the per-output relative errors, so that a small output counts as much as
    a large one (METHODS.md §6, "Dense outputs").

    Raises:
        ValueError: ``out`` and ``ref`` hold different numbers of outputs.
    """
    if isinstance(ref, tuple) or isinstance(out, tuple):
        outs, refs = tuple(out) if isinstance(out, tuple) else (out,), tuple(ref) if isinstance(ref, tuple) else (ref,)
        if len(outs) != len(refs):
            raise ValueError(f"{len(outs)} outputs against {len(refs)} reference outputs")
        return sum(output_error(o, r) for o, r in zip(outs, refs)) / len(refs)
    o, r = out.double().flatten(), ref.double().flatten()
    return float((o - r).pow(2).sum() / r.pow(2).sum().clamp_min(1e-300))


def output_tensor(y):
    """A model's output in the form :func:`output_error` compares: a tensor as it is; a tuple, list or dict (its
    values in order) of tensors as a tuple of (B, F_i) tensors, one per output, each flattened per image (one
    tensor: itself); None for anything else."""
    if isinstance(y, torch.Tensor):
        return y
    if isinstance(y, dict):
        y = list(y.values())
    if isinstance(y, (tuple, list)) and y and all(isinstance(t, torch.Tensor) for t in y):
        return y[0] if len(y) == 1 else tuple(t.flatten(1) for t in y)
    return None


def take_rows(out, n: int):
    """The first ``n`` images' rows of an :func:`output_tensor` value (a tensor or a tuple of them)."""
    return tuple(t[:n] for t in out) if isinstance(out, tuple) else out[:n]


def outputs_equal(a, b) -> bool:
    """Bitwise equality of two :func:`output_tensor` values."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(
            torch.equal(x, y) for x, y in zip(a, b))
    return bool(torch.equal(a, b))


def detached_cpu(out):
    """An :func:`output_tensor` value detached and on the CPU."""
    return tuple(t.detach().cpu() for t in out) if isinstance(out, tuple) else out.detach().cpu()
