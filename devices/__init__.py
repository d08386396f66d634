"""Device profiles (TOML) for TensorRT builds and benchmarks.

>>> from devices import load_profile, list_profiles
>>> list_profiles()
['cpu', 'orin-nx', 'rtx3090']
>>> load_profile("orin-nx").build.precision
'fp16'

``load_profile`` takes a shipped profile's name or the path of a user's TOML file (see
:mod:`devices.profile` for the format).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from devices.profile import (
    BatchRange,
    BenchSettings,
    BuildSettings,
    DeviceProfile,
    ProfileError,
    PruningRules,
    load_profile_file,
    profile_from_dict,
    pruning_rules,
)

__all__ = [
    "BatchRange",
    "BenchSettings",
    "BuildSettings",
    "DeviceProfile",
    "ProfileError",
    "PruningRules",
    "is_profile",
    "list_profiles",
    "load_profile",
    "load_profile_file",
    "profile_from_dict",
    "profile_from_record",
    "pruning_rules",
    "shipped_profile_path",
]


def _shipped_dir() -> Path:
    return Path(str(resources.files("devices")))


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.name[: -len(".toml")] for p in _shipped_dir().glob("*.toml"))


def is_profile(value: str) -> bool:
    """Whether ``value`` names a profile: a shipped profile's name, or a path of a profile file (.toml, or an
    existing file)."""
    return (value in list_profiles() or value.endswith(".toml") or "/" in value or os.sep in value
            or Path(value).is_file())


def shipped_profile_path(name: str) -> Path:
    """Path of the shipped profile ``name`` (it may not exist)."""
    return _shipped_dir() / f"{name}.toml"


def load_profile(name_or_path: str | os.PathLike[str] | DeviceProfile) -> DeviceProfile:
    """A shipped profile by name (``"rtx3090"``), or a user profile from a ``.toml`` path.

    A :class:`DeviceProfile` is returned unchanged, so callers can accept either.

    Raises:
        ProfileError: unknown name, missing file, invalid profile.
    """
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    text = os.fspath(name_or_path)
    looks_like_path = (
        text.endswith(".toml") or os.sep in text or "/" in text or text.startswith("~")
    )
    if looks_like_path or (Path(text).is_file() and text not in list_profiles()):
        return load_profile_file(text)
    shipped = shipped_profile_path(text)
    if shipped.is_file():
        return load_profile_file(shipped)
    raise ProfileError(
        f"unknown device {text!r} (shipped profiles: {', '.join(list_profiles())}; "
        "or pass the path of a .toml profile)"
    )


def profile_from_record(record: Mapping[str, Any]) -> DeviceProfile:
    """Rebuild a profile from its :meth:`DeviceProfile.to_dict` form (e.g. an engine's sidecar).

    The settings an engine was built and meant to be benchmarked with travel in its sidecar;
    this validates them again exactly as a TOML file would be.

    Raises:
        ProfileError: the record is not a valid profile.
    """
    name = str(record.get("name") or "recorded")
    device = {k: record[k] for k in ("name", "description", "backend", "architecture", "compute_capability",
                                     "memory_gb", "shared_memory", "gpu_names", "tensorrt", "jetpack")
              if record.get(k) not in (None, [], "")}
    data: dict[str, Any] = {"device": device, "bench": dict(record.get("bench") or {})}
    if record.get("build"):
        data["build"] = dict(record["build"])
    if record.get("onnxruntime"):
        data["onnxruntime"] = dict(record["onnxruntime"])
    if record.get("pruning"):
        data["pruning"] = dict(record["pruning"])
    src = record.get("source")
    return profile_from_dict(data, label=f"recorded profile {name!r}", default_name=name,
                             source=Path(src) if src else None)

