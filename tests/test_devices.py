"""Device profiles: the shipped TOMLs load, bad fields are named, user profiles load from paths."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import devices
from devices import DeviceProfile, ProfileError, list_profiles, load_profile
from edgeprune.errors import UserError

SHIPPED = Path(devices.__file__).parent


def test_list_profiles_names_the_shipped_files() -> None:
    assert list_profiles() == ["cpu", "orin-nx", "rtx3090"]


@pytest.mark.parametrize("name", ["cpu", "orin-nx", "rtx3090"])
def test_every_shipped_profile_loads(name: str) -> None:
    p = load_profile(name)
    assert p.name == name
    assert p.source == (SHIPPED / f"{name}.toml").resolve()
    json.dumps(p.to_dict())  # JSON-able for engine sidecars
    assert p.bench.batch_sizes and p.bench.iterations >= 1
    if p.build is not None:
        assert all(p.build.batch.min <= b <= p.build.batch.max for b in p.bench.batch_sizes)


def test_rtx3090_profile() -> None:
    p = load_profile("rtx3090")
    assert p.backend == "tensorrt" and p.architecture == "Ampere"
    assert p.compute_capability == (8, 6) and p.compute_capability_str == "8.6"
    assert p.memory_gb == (24,) and not p.shared_memory
    assert p.build is not None and p.build.precision == "fp16"
    assert p.build.timing_cache == Path("~/.cache/edgeprune/timing/rtx3090.cache").expanduser()


def test_orin_nx_profile() -> None:
    p = load_profile("orin-nx")
    assert p.compute_capability == (8, 7)
    assert p.memory_gb == (8, 16) and p.shared_memory
    assert p.tensorrt == "10.3" and p.jetpack == "6"
    assert p.build is not None and p.build.precision == "fp16"
    assert 0 <= p.build.builder_optimization_level <= 5


def test_cpu_profile_has_no_tensorrt_section() -> None:
    p = load_profile("cpu")
    assert p.backend == "onnxruntime" and p.build is None and p.compute_capability is None
    assert not p.bench.cuda_graphs and not p.uses_tensorrt


def test_load_profile_accepts_a_profile_object() -> None:
    p = load_profile("cpu")
    assert load_profile(p) is p


def test_unknown_device_lists_the_shipped_ones() -> None:
    with pytest.raises(ProfileError, match=r"unknown device 'jetson-nano' \(shipped profiles: cpu, orin-nx, rtx3090"):
        load_profile("jetson-nano")


def test_missing_profile_file() -> None:
    with pytest.raises(ProfileError, match="not found"):
        load_profile("/nonexistent/dir/mine.toml")


def test_profile_error_is_a_user_error() -> None:
    assert issubclass(ProfileError, UserError)


# ---------------------------------------------------------------------------------------------
# user profiles from a path

USER_PROFILE = """
[device]
name = "lab-a4000"
backend = "tensorrt"
architecture = "Ampere"
compute_capability = "8.6"
memory_gb = 16

[build]
precision = "fp32"
workspace_mib = 2048
batch = { min = 2, opt = 4, max = 8 }
timing_cache = "caches/a4000.cache"

[bench]
batch_sizes = [2, 8]
"""


def test_user_profile_from_path(tmp_path: Path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text(USER_PROFILE)
    p = load_profile(str(f))
    assert isinstance(p, DeviceProfile)
    assert p.name == "lab-a4000" and p.memory_gb == (16,)
    assert p.build is not None and p.build.precision == "fp32"
    assert p.build.builder_optimization_level == 3  # default
    assert p.build.timing_cache == tmp_path / "caches" / "a4000.cache"  # relative to the file
    assert p.bench.warmup == 10 and p.bench.iterations == 100 and not p.bench.cuda_graphs  # defaults


def test_name_defaults_to_file_stem_and_cache_to_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    f = tmp_path / "bench-box.toml"
    f.write_text(USER_PROFILE.replace('name = "lab-a4000"\n', "").replace('timing_cache = "caches/a4000.cache"\n', ""))
    p = load_profile(f)
    assert p.name == "bench-box"
    assert p.build is not None
    assert p.build.timing_cache == tmp_path / "home" / ".cache" / "edgeprune" / "timing" / "bench-box.cache"


def test_tilde_in_timing_cache_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    f = tmp_path / "x.toml"
    f.write_text(USER_PROFILE.replace('"caches/a4000.cache"', '"~/tc/a.cache"'))
    p = load_profile(f)
    assert p.build is not None and p.build.timing_cache == tmp_path / "tc" / "a.cache"


# ---------------------------------------------------------------------------------------------
# validation: each bad field is named

ORIN = (SHIPPED / "orin-nx.toml").read_text()


def _edit(text: str, pattern: str, replacement: str) -> str:
    new, n = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
    assert n == 1, pattern
    return new


BAD = [
    (r'^precision = "fp16"', 'precision = "fp8"',
     "orin-nx.toml: build.precision must be one of fp16, fp32, int8 (got 'fp8')"),
    (r"^builder_optimization_level = 3", "builder_optimization_level = 7",
     "orin-nx.toml: build.builder_optimization_level must be between 0 and 5 (got 7)"),
    (r"^workspace_mib = 1024", 'workspace_mib = "1G"',
     "orin-nx.toml: build.workspace_mib must be an integer (got '1G')"),
    (r"^workspace_mib = 1024", "workspace_mib = true",
     "orin-nx.toml: build.workspace_mib must be an integer (got True)"),
    (r"^batch = .*$", "batch = { min = 4, opt = 2, max = 16 }",
     "orin-nx.toml: build.batch must satisfy min <= opt <= max (got min=4, opt=2, max=16)"),
    (r"^batch = .*$", "batch = { min = 1, opt = 1 }",
     "orin-nx.toml: build.batch.max is required"),
    (r"^batch = .*$", "batch = { min = 0, opt = 1, max = 4 }",
     "orin-nx.toml: build.batch.min must be >= 1 (got 0)"),
    (r'^compute_capability = "8.7"', 'compute_capability = "8"',
     "orin-nx.toml: device.compute_capability must look like \"8.6\""),
    (r'^compute_capability = "8.7"\n', "",
     "orin-nx.toml: device.compute_capability is required for backend 'tensorrt'"),
    (r'^backend = "tensorrt"', 'backend = "tflite"',
     "orin-nx.toml: device.backend must be one of tensorrt, onnxruntime (got 'tflite')"),
    (r"^memory_gb = \[8, 16\]", "memory_gb = []",
     "orin-nx.toml: device.memory_gb must be a non-empty list of integers"),
    (r"^workspace_mib = 1024", "workspace_mb = 1024",
     "orin-nx.toml: unknown key build.workspace_mb"),
    (r"^batch_sizes = \[1, 4, 16\]", "batch_sizes = [1, 32]",
     "orin-nx.toml: bench.batch_sizes must lie within build.batch min..max (1..16) (got 32)"),
    (r"^iterations = 200", "iterations = 0",
     "orin-nx.toml: bench.iterations must be >= 1 (got 0)"),
    (r"^cuda_graphs = true", 'cuda_graphs = "yes"',
     "orin-nx.toml: bench.cuda_graphs must be true or false (got 'yes')"),
    (r"^\[bench\]", "[bench",
     "orin-nx.toml: invalid TOML"),
    (r'^name = "orin-nx"', 'name = "orin nx"',
     "orin-nx.toml: device.name must be a non-empty name without spaces or slashes"),
]


@pytest.mark.parametrize("pattern,replacement,message", BAD, ids=[b[2].split(": ", 1)[1][:40] for b in BAD])
def test_bad_field_is_named(tmp_path: Path, pattern: str, replacement: str, message: str) -> None:
    f = tmp_path / "orin-nx.toml"
    f.write_text(_edit(ORIN, pattern, replacement))
    with pytest.raises(ProfileError) as info:
        load_profile(f)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_missing_build_section_for_tensorrt(tmp_path: Path) -> None:
    text = USER_PROFILE.split("[build]")[0] + "[bench]\nbatch_sizes = [1]\n"
    f = tmp_path / "nobuild.toml"
    f.write_text(text)
    with pytest.raises(ProfileError, match=r"^nobuild.toml: \[build\] section is required for backend 'tensorrt'"):
        load_profile(f)


def test_cpu_profile_rejects_build_and_cuda_graphs(tmp_path: Path) -> None:
    cpu = (SHIPPED / "cpu.toml").read_text()
    f = tmp_path / "cpu.toml"
    f.write_text(cpu.replace("cuda_graphs = false", "cuda_graphs = true"))
    with pytest.raises(ProfileError, match=r"^cpu.toml: bench.cuda_graphs must be false for backend 'onnxruntime'"):
        load_profile(f)
    f.write_text(cpu + "\n[build]\nprecision = \"fp16\"\n")
    with pytest.raises(ProfileError, match=r"^cpu.toml: \[build\] is only allowed for backend 'tensorrt'"):
        load_profile(f)


def test_unknown_top_level_table(tmp_path: Path) -> None:
    f = tmp_path / "orin-nx.toml"
    f.write_text(ORIN + "\n[benchmark]\nwarmup = 3\n")
    with pytest.raises(ProfileError, match=r"^orin-nx.toml: unknown key benchmark"):
        load_profile(f)


# ---------------------------------------------------------------------------------------------
# precision: int8 (issue 16) and the CPU profile's settings


def test_int8_build_precision_is_accepted(tmp_path: Path) -> None:
    f = tmp_path / "orin-int8.toml"
    f.write_text(_edit(ORIN, r'^precision = "fp16"', 'precision = "int8"'))
    p = load_profile(f)
    assert p.build is not None and p.build.precision == "int8" and p.precision == "int8"
    assert p.to_dict()["build"]["precision"] == "int8"


def test_cpu_profile_precision_and_threads(tmp_path: Path) -> None:
    cpu = load_profile("cpu")
    assert cpu.precision == "fp32" and cpu.threads is None  # threads = 0: ONNX Runtime's default
    text = (SHIPPED / "cpu.toml").read_text()
    f = tmp_path / "cpu8.toml"
    f.write_text(_edit(_edit(text, r"^threads = 0", "threads = 2"), r'^precision = "fp32"', 'precision = "int8"'))
    p = load_profile(f)
    assert p.precision == "int8" and p.threads == 2
    assert p.to_dict()["onnxruntime"] == {"threads": 2, "precision": "int8"}
    f.write_text(_edit(text, r'^precision = "fp32"', 'precision = "int4"'))
    with pytest.raises(ProfileError, match=r"^cpu8.toml: onnxruntime.precision must be one of fp32, fp16, int8 "
                                           r"\(got 'int4'\)"):
        load_profile(f)


@pytest.mark.parametrize("name", ["cpu", "orin-nx", "rtx3090"])
def test_profile_round_trips_through_its_record(name: str) -> None:
    """An engine's sidecar carries ``to_dict()``; rebuilding it gives the same validated profile."""
    p = load_profile(name)
    assert devices.profile_from_record(json.loads(json.dumps(p.to_dict()))) == p
    bad = {**p.to_dict(), "bench": {**p.to_dict()["bench"], "iterations": 0}}
    with pytest.raises(ProfileError, match="bench.iterations must be >= 1"):
        devices.profile_from_record(bad)

