"""The local CUDA GPU (name, compute capability, memory) and the profile compatibility check.

:func:`local_gpu` asks, in order: cuda-python (``cuda.bindings.runtime``), ``nvidia-smi``, and on
Jetson the device tree (``/proc/device-tree/compatible`` naming a Tegra234 = Orin SoC, compute
capability 8.7). The parsers and :func:`check_compute_capability` are pure functions so the
logic is testable without a GPU.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from edgeprune.errors import UserError

if TYPE_CHECKING:
    from devices.profile import DeviceProfile

# Tegra SoCs whose device-tree "compatible" string identifies the integrated GPU.
_TEGRA_SOCS: dict[str, tuple[str, tuple[int, int]]] = {
    "nvidia,tegra234": ("Orin (nvgpu)", (8, 7)),   # Jetson AGX Orin / Orin NX / Orin Nano
    "nvidia,tegra194": ("Xavier (nvgpu)", (7, 2)),  # Jetson AGX Xavier / Xavier NX
}


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as seen by this process."""

    name: str
    compute_capability: tuple[int, int]
    total_memory_mb: float
    source: str = "cuda-python"
    """Which probe found it: ``cuda-python``, ``nvidia-smi`` or ``device-tree``."""

    @property
    def compute_capability_str(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "compute_capability": self.compute_capability_str,
            "total_memory_mb": round(self.total_memory_mb, 1),
            "source": self.source,
        }


@dataclasses.dataclass(frozen=True)
class CapabilityCheck:
    """Outcome of :func:`check_compute_capability` when the build may go ahead."""

    matches: bool
    message: str
    """Empty on a clean match; otherwise a warning to print (forced mismatch, other GPU model)."""


# --------------------------------------------------------------------------------------------
# probes


def _from_cuda_python(device_index: int = 0) -> GpuInfo | None:
    try:
        from cuda.bindings import runtime as cudart
    except Exception:  # not installed, or its libraries do not load
        try:
            from cuda import cudart  # cuda-python < 12.6 layout
        except Exception:
            return None
    try:
        err, count = cudart.cudaGetDeviceCount()
        if int(err) != 0 or count <= device_index:
            return None
        err, prop = cudart.cudaGetDeviceProperties(device_index)
        if int(err) != 0:
            return None
        raw = prop.name
        name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return GpuInfo(name=name.strip(), compute_capability=(int(prop.major), int(prop.minor)),
                       total_memory_mb=int(prop.totalGlobalMem) / 2**20, source="cuda-python")
    except Exception:
        return None


def parse_nvidia_smi(text: str, device_index: int = 0) -> GpuInfo | None:
    """Parse ``nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader``.

    Lines look like ``NVIDIA GeForce RTX 3090, 8.6, 24576 MiB``. Returns ``None`` when the
    requested line is missing or unparsable (old drivers print ``[N/A]`` or reject compute_cap).
    """
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if len(lines) <= device_index:
        return None
    parts = [p.strip() for p in lines[device_index].rsplit(",", 2)]
    if len(parts) != 3:
        return None
    name, cc_text, mem_text = parts
    try:
        major, minor = (int(x) for x in cc_text.split("."))
    except ValueError:
        return None
    mem_fields = mem_text.split()
    try:
        mem = float(mem_fields[0])
    except (ValueError, IndexError):
        mem = 0.0
    if len(mem_fields) > 1 and mem_fields[1].lower().startswith("gib"):
        mem *= 1024
    return GpuInfo(name=name, compute_capability=(major, minor), total_memory_mb=mem,
                   source="nvidia-smi")


def _from_nvidia_smi(device_index: int = 0) -> GpuInfo | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return parse_nvidia_smi(out.stdout, device_index)


def parse_tegra(compatible: bytes, model: str, meminfo: str) -> GpuInfo | None:
    """Jetson: identify the integrated GPU from the device tree.

    Args:
        compatible: contents of ``/proc/device-tree/compatible`` (NUL-separated strings).
        model: contents of ``/proc/device-tree/model`` (``"NVIDIA Jetson Orin NX ..."``).
        meminfo: contents of ``/proc/meminfo`` (the GPU shares system memory).
    """
    entries = [e.decode(errors="replace") for e in compatible.split(b"\0") if e]
    for soc, (gpu, cc) in _TEGRA_SOCS.items():
        if soc in entries:
            mem_mb = 0.0
            for line in meminfo.splitlines():
                if line.startswith("MemTotal:"):
                    mem_mb = float(line.split()[1]) / 1024  # kB -> MiB
            label = model.strip("\0 \n") or gpu
            return GpuInfo(name=f"{label} [{gpu}]", compute_capability=cc,
                           total_memory_mb=mem_mb, source="device-tree")
    return None


def _from_device_tree() -> GpuInfo | None:
    dt = Path("/proc/device-tree")
    try:
        compatible = (dt / "compatible").read_bytes()
    except OSError:
        return None
    try:
        model = (dt / "model").read_text(errors="replace")
    except OSError:
        model = ""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        meminfo = ""
    return parse_tegra(compatible, model, meminfo)


def local_gpu(device_index: int = 0) -> GpuInfo | None:
    """The local CUDA GPU ``device_index``, or ``None`` when none is visible."""
    return _from_cuda_python(device_index) or _from_nvidia_smi(device_index) or (
        _from_device_tree() if device_index == 0 else None
    )


# --------------------------------------------------------------------------------------------
# compatibility


def check_compute_capability(profile: DeviceProfile, gpu: GpuInfo | None, *,
                             force: bool = False) -> CapabilityCheck:
    """May an engine for ``profile`` be built on ``gpu``?

    A TensorRT engine only runs on GPUs of the compute capability it was built on (the RTX
    3090 is 8.6, Orin 8.7), so a build on the wrong GPU produces an engine that the target
    refuses to load.

    Returns:
        :class:`CapabilityCheck`; ``matches`` is False only when ``force`` let a mismatch
        through, and ``message`` then says so. A matching capability with a GPU name outside
        ``profile.gpu_names`` matches, with a warning (same kernels, different SM count).

    Raises:
        UserError: ``gpu`` is None (no CUDA GPU visible); the profile is not a TensorRT one;
            the capabilities differ and ``force`` is False.
    """
    if profile.compute_capability is None or not profile.uses_tensorrt:
        raise UserError(f"device profile {profile.name!r} is for {profile.backend}, not TensorRT: "
                        "pick a TensorRT profile (e.g. rtx3090, orin-nx)")
    if gpu is None:
        raise UserError("no CUDA GPU visible: TensorRT builds and runs need an NVIDIA GPU "
                        "(check the driver with nvidia-smi, or CUDA_VISIBLE_DEVICES)")
    want = profile.compute_capability_str
    if gpu.compute_capability != profile.compute_capability:
        msg = (f"device profile {profile.name!r} targets compute capability {want}, but the local "
               f"GPU {gpu.name!r} is {gpu.compute_capability_str}")
        if not force:
            raise UserError(msg + ": the engine would not run on the target; build on the target "
                                  "device, or pass --force-device to build anyway")
        return CapabilityCheck(matches=False, message="warning: " + msg +
                               " (--force-device: building anyway; the engine will only run on "
                               f"compute capability {gpu.compute_capability_str} GPUs)")
    if profile.gpu_names and not any(n.lower() in gpu.name.lower() for n in profile.gpu_names):
        return CapabilityCheck(matches=True, message=(
            f"warning: local GPU {gpu.name!r} is compute capability {want} like {profile.name!r}, "
            f"but not one of {', '.join(profile.gpu_names)}: the engine will load there, but its "
            "kernels were timed on this GPU"))
    return CapabilityCheck(matches=True, message="")
