"""A user's network given by a Python file (issue 55): ``--model-file net.py:build [--backbone PATH]``.

The reference ``FILE.py:FUNCTION`` names a builder: a function of the file that returns the network (an
``nn.Module`` whose output is a tensor or a tuple/dict of tensors, with a timm ViT inside,
:mod:`edgeprune.backbone`). The builder loads its own weights; ``--model-kwargs K=V`` become its keyword
arguments. A spec's name is the canonical reference ``/abs/path/net.py:build`` (``#PATH`` appended when a backbone
is named), and the run record holds it with the file's sha256, so a run reloads by calling the same builder of the
same file (a changed file is refused, like a changed checkpoint).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from edgeprune._compat import import_timm
from edgeprune.backbone import BackboneError, backbone_of, set_backbone
from edgeprune.errors import UserError

__all__ = ["build_network", "is_network_ref", "network_ref", "network_spec_fields", "parse_ref", "probe_output_kind"]

_SEP = "#"


def is_network_ref(name: str | None) -> bool:
    """Whether a model name is a network file reference (``FILE.py:FUNCTION``, optionally ``#BACKBONE``)."""
    return isinstance(name, str) and ".py:" in name


def parse_ref(ref: str) -> tuple[Path, str, str | None]:
    """``(file, function, backbone or None)`` of a reference.

    Raises:
        UserError: not ``FILE.py:FUNCTION``.
    """
    body, _, backbone = ref.partition(_SEP)
    file, sep, func = body.rpartition(":")
    if not sep or not file.endswith(".py") or not func.isidentifier():
        raise UserError(f"--model-file takes FILE.py:FUNCTION (a builder function of a Python file), got {body!r}")
    return Path(file), func, (backbone or None)


def network_ref(model_file: str, backbone: str | None = None) -> str:
    """The canonical reference of ``--model-file`` / ``--backbone``: the file's absolute path.

    Raises:
        UserError: a malformed reference or a missing file.
    """
    file, func, inline = parse_ref(model_file)
    if backbone is not None and inline is not None and backbone != inline:
        raise UserError(f"two backbones named: {inline!r} and {backbone!r}")
    file = file.expanduser().resolve()
    if not file.is_file():
        raise UserError(f"--model-file: {file} is not a file")
    bb = backbone if backbone is not None else inline
    return f"{file}:{func}" + (f"{_SEP}{bb}" if bb else "")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_builder(file: Path, func: str) -> Callable[..., Any]:
    """The builder function, the file imported as a fresh module (its folder on ``sys.path`` while importing, so
    its own imports of neighbouring files work).

    Raises:
        UserError: the file cannot be imported (its first error line), or has no such function.
    """
    name = f"edgeprune_network_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise UserError(f"--model-file: cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 -- the user's file: one line
        raise UserError(f"--model-file: importing {file.name} failed: {type(err).__name__}: "
                        f"{_first_line(err)}") from None
    finally:
        if sys.path and sys.path[0] == str(file.parent):
            sys.path.pop(0)
    builder = getattr(module, func, None)
    if not callable(builder):
        raise UserError(f"--model-file: {file.name} has no function {func!r}")
    return builder


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


def build_network(ref: str, kwargs: dict[str, Any] | None = None, expected_sha256: str | None = None
                  ) -> tuple[nn.Module, str]:
    """Call the builder of ``ref`` and check what it returns.

    Args:
        ref: a canonical reference (:func:`network_ref`). kwargs: the builder's keyword arguments.
        expected_sha256: the file's recorded hash (a run being reloaded); None: not checked.

    Returns:
        ``(network in eval mode with its backbone named, the file's sha256)``.

    Raises:
        UserError: a missing or changed file, a builder that raises or returns no ``nn.Module``, no ViT inside,
            several without ``--backbone``, a backbone path that is not a ViT -- each in one line.
    """
    file, func, backbone = parse_ref(ref)
    if not file.is_file():
        raise UserError(f"the network file {file} is gone")
    digest = _sha256(file)
    if expected_sha256 is not None and digest != expected_sha256:
        raise UserError(f"the network file {file} changed since the run (sha256 {digest[:12]}..., recorded "
                        f"{expected_sha256[:12]}...)")
    builder = _load_builder(file, func)
    try:
        net = builder(**dict(kwargs or {}))
    except Exception as err:  # noqa: BLE001 -- the user's builder: one line
        raise UserError(f"the builder {file.name}:{func} raised {type(err).__name__}: {_first_line(err)}") from None
    if not isinstance(net, nn.Module):
        raise UserError(f"the builder {file.name}:{func} returned {type(net).__name__}, not a torch nn.Module")
    try:
        if backbone is not None:
            set_backbone(net, backbone)
        backbone_of(net)
    except BackboneError as err:
        raise BackboneError(f"{file.name}:{func}: {err}") from None
    return net.eval(), digest


def probe_output_kind(net: nn.Module, input_size: tuple[int, int, int]) -> str:
    """``"logits"`` when the network returns one (B, K) tensor (a classifier), else ``"dense"``; probed on two
    zero images.

    Raises:
        UserError: the network does not take the input, or returns something that is not a tensor or a
            tuple/dict of tensors.
    """
    x = torch.zeros(2, *input_size)
    try:
        with torch.no_grad():
            out = net(x)
    except Exception as err:  # noqa: BLE001 -- the user's network: one line
        raise UserError(f"the network does not take input of shape {tuple(x.shape)}: {type(err).__name__}: "
                        f"{_first_line(err)}") from None
    values = list(out.values()) if isinstance(out, dict) else out
    if isinstance(values, torch.Tensor):
        return "logits" if values.ndim == 2 else "dense"
    if isinstance(values, (tuple, list)) and values and all(isinstance(v, torch.Tensor) for v in values):
        return "dense"
    raise UserError(f"the network returns {type(out).__name__}; edgeprune needs a tensor or a tuple/dict of tensors")


def network_spec_fields(name: str, kwargs: dict[str, Any], sha256: str | None, seed: int, *,
                        checkpoint: Any = None, random_init: bool = False, num_classes: int | None = None,
                        img_size: int | None = None) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a network file: the network is built once (under ``seed``) to read its
    backbone's input size and preprocessing (timm's data config of the ViT) and its output kind.

    Raises:
        UserError: timm-only options (checkpoint, random init, classes, image size), or as :func:`build_network`.
    """
    given = [flag for flag, v in (("--checkpoint", checkpoint), ("--random-init", random_init),
                                  ("--num-classes", num_classes), ("--img-size", img_size)) if v]
    if given:
        raise UserError(f"{', '.join(given)} go with a timm model name, not --model-file (the builder makes the "
                        "network: pass its own arguments as --model-kwargs K=V)")
    import_timm()
    from timm.data import resolve_data_config

    ref = network_ref(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        net, digest = build_network(ref, kwargs, sha256)
    vit = backbone_of(net)
    size = vit.patch_embed.img_size
    h, w = (int(size[0]), int(size[1])) if isinstance(size, (tuple, list)) else (int(size), int(size))
    proj = getattr(vit.patch_embed, "proj", None)
    input_size = (int(getattr(proj, "in_channels", 3)), h, w)
    cfg = resolve_data_config({}, model=vit)
    pre = {"resize": h, "crop": h, "interpolation": cfg.get("interpolation", "bicubic"), "crop_pct": 1.0,
           "mean": list(cfg["mean"]), "std": list(cfg["std"])}
    return dict(name=ref, input_size=input_size, mean=tuple(pre["mean"]), std=tuple(pre["std"]), preprocessing=pre,
                output_kind=probe_output_kind(net, input_size), model_kwargs=dict(kwargs), checkpoint_sha256=digest)
