"""What the benchmark scripts share: the model and its data, top-1, the machine, JSON and doc output.

Every script in ``benchmarks/`` starts with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
    from benchmarks import common

and builds its model, calibration set and evaluation batches here, so that a zoo name
(``fmnist-vit``, ``dinov2-s14``, ``dinov2-s14-fmnist``) and a timm name (``deit_small_patch16_224``,
random init for latency) are handled one way in all of them.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without reinstalling
    sys.path.insert(0, str(REPO))

from edgeprune.atomic import atomic_write_text  # noqa: E402
from edgeprune.latency.measure import cpu_name  # noqa: E402,F401  (re-exported: the one CPU-name helper)
from edgeprune.zoo.registry import get_model_spec  # noqa: E402

#: the models edgeprune ships weights and data for (anything else is a timm name)
ZOO = ("fmnist-vit", "fmnist-dinov3", "dinov2-s14", "dinov2-s14-fmnist")


# -- command-line lists -------------------------------------------------------------------------

def floats(text: str) -> list[float]:
    """``"0.3,0.5"`` -> ``[0.3, 0.5]`` (empty items skipped)."""
    return [float(t) for t in text.split(",") if t.strip()]


def ints(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]`` (empty items skipped)."""
    return [int(t) for t in text.split(",") if t.strip()]


def names(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]`` (stripped, empty items skipped)."""
    return [t.strip() for t in text.split(",") if t.strip()]


def log(msg: str) -> None:
    """Progress on stderr (stdout carries the tables)."""
    print(msg, file=sys.stderr, flush=True)


# -- model and data ----------------------------------------------------------------------------

def model(name: str, *, random_init: bool = False, img_size: int | None = None):
    """(spec, model in eval mode) for a zoo or timm name.

    ``random_init``: the architecture without weights (latency depends on the shapes only; the
    init is seeded by the spec, the same every run). ``img_size``: the input side (``None``: the
    model's own)."""
    kwargs: dict[str, Any] = {"img_size": img_size} if img_size else {}
    if random_init and name not in ZOO:
        kwargs["random_init"] = True
    spec = get_model_spec(name, **kwargs)
    return spec, spec.create(pretrained=not random_init).eval()


def noise(spec: Any, n: int, seed: int) -> torch.Tensor:
    """``n`` seeded N(0, 1) images of the spec's input size, shape (n, C, H, W)."""
    return torch.randn(n, *spec.input_size, generator=torch.Generator().manual_seed(seed))


def calibration(spec: Any, n: int, seed: int, *, real: bool = True) -> Any:
    """The calibration set: the zoo model's own (its ``calibration_source``) when ``real`` and the
    model ships data, else :func:`noise` (latency does not depend on it)."""
    if real and spec.name in ZOO:
        return spec.calibration_source(n, seed=seed)
    return noise(spec, n, seed)


def eval_batches(spec: Any, n: int | None, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's held-out split (disjoint from calibration), first ``n`` images (``None``: all),
    loaded once as (x, y) batches of ``batch``."""
    return [(x, y) for x, y in spec.eval_source(None, n=n).batches(batch)]


@torch.no_grad()
def top1(m: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
         dense_preds: Sequence[torch.Tensor] | None = None) -> dict[str, Any]:
    """Top-1 (fraction) and agreement with ``dense_preds`` (fraction; 1.0 without them) over
    (x, y) batches, and the per-batch predictions (to pass as ``dense_preds`` of other models)."""
    correct = agree = n = 0
    preds = []
    for i, (x, y) in enumerate(batches):
        p = m(x).argmax(-1)
        preds.append(p)
        correct += int((p == y).sum())
        if dense_preds is not None:
            agree += int((p == dense_preds[i]).sum())
        n += x.shape[0]
    return {"top1": correct / n, "agreement": agree / n if dense_preds is not None else 1.0, "preds": preds}


def ratios(record: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs, params) of a pruned model as fractions of the dense model's, from its run record."""
    return record["flops"] / record["dense_flops"], record["params"] / record["dense_params"]


# -- machine and output ------------------------------------------------------------------------

def machine() -> str:
    """One line naming the machine: CPU model, logical CPUs, torch threads and version."""
    return (f"{cpu_name()}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def write_json(path: str | os.PathLike[str], payload: dict[str, Any], tool: str,
               argv: Sequence[str] | None = None) -> Path:
    """Write ``payload`` plus the tool's name, its arguments, the time and the machine as JSON,
    atomically (parent folders made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"tool": tool, "argv": list(sys.argv[1:] if argv is None else argv),
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "machine": machine(), **payload}
    atomic_write_text(path, json.dumps(doc, indent=2, default=str) + "\n")
    return path


def write_between(doc: Path, start: str, end: str, block: str, heading: str = "") -> None:
    """Replace the text between the ``start`` and ``end`` markers of ``doc`` with ``block``; when
    the markers are missing they are appended (after ``heading``, e.g. ``"## fmnist-vit"``). Atomic."""
    text = doc.read_text() if doc.exists() else ""
    if start not in text or end not in text:
        text = text.rstrip() + "\n\n" + (f"{heading}\n\n" if heading else "") + f"{start}\n{end}\n"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    atomic_write_text(doc, f"{head}{start}\n{block}\n{end}{tail}")


def run_main(main: Callable[[list[str] | None], int | None]) -> None:
    """``sys.exit(main())`` with a :class:`edgeprune.errors.UserError` as a one-line error (exit 2,
    or the error's own exit code)."""
    from edgeprune.errors import UserError

    try:
        code = main(None)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        code = int(getattr(err, "exit_code", 2))
    sys.exit(code or 0)
