"""Known-answer tests for ``edgeprune.artifact`` (issue 17: mutation check of the run directory code).

Exact one-line messages of ``write_fault`` (strerror, first message line, type name), the output
checks (a file in the way, a probe that leaves nothing behind, a failing write), ``save_run``'s
two files and their exact contents, the record built by ``new_record`` / ``config_record`` (keys,
order, defaults), ``read_record``'s refusals, and a ``load_run`` round trip of a small pruned
structure (and its refusal of weights that do not fit). All on tmp_path, < 2 s in total.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from edgeprune import artifact
from edgeprune.artifact import (RECORD, WEIGHTS, check_new_dir, check_writable, config_record, load_run,
                                new_record, read_record, save_run, write_fault)
from edgeprune.errors import RuntimeFault, UserError


# ---- write_fault ---------------------------------------------------------------------------------
def test_write_fault_messages():
    f = write_fault("/x/run", OSError(errno.ENOSPC, "No space left on device"))
    assert isinstance(f, RuntimeFault)
    assert str(f) == "cannot write /x/run: No space left on device (free space / choose a writable -o)"
    assert str(write_fault("p", RuntimeError("first line\nsecond line"))) == \
        "cannot write p: first line (free space / choose a writable -o)"
    assert str(write_fault("p", ValueError())) == "cannot write p: ValueError (free space / choose a writable -o)"


# ---- check_writable / check_new_dir -------------------------------------------------------------------
def test_check_writable_creates_probes_and_cleans_up(tmp_path, monkeypatch):
    d = tmp_path / "a" / "b"
    assert check_writable(d) == d and d.is_dir() and list(d.iterdir()) == []
    assert check_writable(str(d)) == d and list(d.iterdir()) == []  # existing folder, str path
    monkeypatch.chdir(tmp_path)
    assert check_writable("") == artifact.Path(".") and sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_check_writable_refuses_a_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("x")
    for target in (tmp_path / "f", tmp_path / "f" / "sub" / "deeper"):
        with pytest.raises(UserError, match=f"cannot write into {re.escape(str(target))}: "
                                            f"{re.escape(str(tmp_path / 'f'))} is a file, not a folder"):
            check_writable(target)


def test_check_writable_turns_os_errors_into_one_fault(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(artifact.tempfile, "mkstemp", refuse)
    with pytest.raises(RuntimeFault, match=f"^cannot write {re.escape(str(tmp_path))}: Read-only file system"):
        check_writable(tmp_path)


def test_check_writable_probes_the_folder_itself(tmp_path, monkeypatch):
    real = artifact.tempfile.mkstemp
    target = tmp_path / "ro"
    target.mkdir()

    def refuse_in_target(*a, **k):  # a folder that refuses new files (as a read-only mount would)
        if k.get("dir") is not None and artifact.Path(k["dir"]) == target:
            raise OSError(errno.EACCES, "Permission denied")
        return real(*a, **k)

    monkeypatch.setattr(artifact.tempfile, "mkstemp", refuse_in_target)
    with pytest.raises(RuntimeFault, match="Permission denied"):
        check_writable(target)
    assert check_writable(tmp_path) == tmp_path


def test_check_new_dir(tmp_path):
    p = tmp_path / "parent" / "run"
    assert check_new_dir(p) == p and (tmp_path / "parent").is_dir() and not p.exists()
    p.mkdir()
    with pytest.raises(UserError, match="output directory .*run already exists"):
        check_new_dir(str(p))


# ---- save_run -----------------------------------------------------------------------------------
def test_save_run_writes_exactly_the_weights_and_the_record(tmp_path):
    from safetensors import safe_open

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    rec = {"method": "m", "base_model": {"name": "x"}, "blocks": [], "tuple": (1, 2), "path": tmp_path}
    out = save_run(tmp_path / "run", model, rec)
    assert out == tmp_path / "run"
    assert sorted(p.name for p in out.iterdir()) == sorted([WEIGHTS, RECORD])
    text = (out / RECORD).read_text()
    assert text.endswith("}\n") and text.startswith('{\n  "method"')  # indent 2
    sha = hashlib.sha256((out / WEIGHTS).read_bytes()).hexdigest()  # issue 32: the weights' own hash
    assert list(json.loads(text).items()) == [("method", "m"), ("base_model", {"name": "x"}), ("blocks", []),
                                              ("tuple", [1, 2]), ("path", str(tmp_path)),
                                              ("weights_sha256", sha)]  # order kept
    assert "weights_sha256" not in rec  # the caller's record is not changed
    with safe_open(str(out / WEIGHTS), "pt") as f:
        assert f.metadata() == {"format": "pt", "edgeprune_record": RECORD}
        assert sorted(f.keys()) == sorted(model.state_dict())
        for k, v in model.state_dict().items():
            assert torch.equal(f.get_tensor(k), v)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary left behind


@pytest.mark.parametrize("err,kind,msg", [
    (OSError(errno.ENOSPC, "No space left on device"), RuntimeFault, "cannot write .*/run: No space left on device"),
    (OSError(errno.EEXIST, "File exists"), UserError, "appeared while saving; not overwriting it"),
    (OSError(errno.ENOTEMPTY, "Directory not empty"), UserError, "appeared while saving; not overwriting it"),
])
def test_save_run_write_errors(tmp_path, monkeypatch, err, kind, msg):
    import edgeprune.atomic

    def fail(*a, **k):
        raise err

    monkeypatch.setattr(edgeprune.atomic, "write_safetensors", fail)
    with pytest.raises(kind, match=msg):
        save_run(tmp_path / "run", torch.nn.Linear(2, 2), {"base_model": {}, "blocks": []})
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    import edgeprune.atomic

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(edgeprune.atomic, "write_safetensors", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_run(tmp_path / "run", torch.nn.Linear(2, 2), {"base_model": {}, "blocks": []})
    assert list(tmp_path.iterdir()) == []


# ---- config_record / new_record ---------------------------------------------------------------------
@dataclasses.dataclass
class _Cfg:
    alpha: float = 1e-3
    dims: tuple = (1, 2)
    name: str = "x"
    where: Path = Path("/data/calib")


def test_config_record():
    assert config_record(None) == {}
    assert config_record(_Cfg()) == {"alpha": 1e-3, "dims": [1, 2], "name": "x", "where": "/data/calib"}
    src = {"a": 1}
    out = config_record(src)
    assert out == src and out is not src
    with pytest.raises(TypeError):  # a dataclass *type* is not a config object
        config_record(_Cfg)


def test_new_record_keys_order_and_values():
    dense = {"params": 10, "flops": 100, "blocks": [{"index": 0, "mlp_hidden": 8}]}
    pruned = {"params": 6, "flops": 50, "blocks": [{"index": 0, "mlp_hidden": 4}]}
    rec = new_record("corp", {"name": "m"}, _Cfg(), dense, pruned, calibration={"n": 4},
                     timing={"total_s": 1.5}, device=torch.device("cpu"), targets=["mlp"], sparsity={"mlp": 0.5})
    assert list(rec) == ["edgeprune_version", "base_model", "method", "targets", "sparsity", "config", "device",
                         "calibration", "blocks", "dense_blocks", "params", "dense_params", "flops",
                         "dense_flops", "timing", "created"]
    from edgeprune import __version__
    assert rec["edgeprune_version"] == __version__
    assert (rec["base_model"], rec["method"], rec["targets"], rec["sparsity"]) == \
        ({"name": "m"}, "corp", ["mlp"], {"mlp": 0.5})
    assert rec["config"] == {"alpha": 1e-3, "dims": [1, 2], "name": "x", "where": "/data/calib"}
    assert rec["device"] == "cpu" and rec["calibration"] == {"n": 4} and rec["timing"] == {"total_s": 1.5}
    assert (rec["blocks"], rec["dense_blocks"]) == (pruned["blocks"], dense["blocks"])
    assert (rec["params"], rec["dense_params"], rec["flops"], rec["dense_flops"]) == (6, 10, 50, 100)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", rec["created"]), rec["created"]
    rec = new_record("nuwa", {"name": "m"}, None, dense, pruned)
    assert (rec["config"], rec["calibration"], rec["timing"], rec["device"]) == ({}, {}, {}, "cpu")
    json.dumps(rec)  # serialisable as it is


# ---- read_record / load_run ---------------------------------------------------------------------
def test_read_record_refusals(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    for present in ([], [RECORD], [WEIGHTS]):
        for name in (RECORD, WEIGHTS):
            (d / name).unlink(missing_ok=True)
        for name in present:
            (d / name).write_text("{}")
        with pytest.raises(UserError, match=f"{re.escape(str(d))} is not an edgeprune run directory "
                                            f"\\(needs {RECORD} and {WEIGHTS}\\)"):
            read_record(d)
    (d / WEIGHTS).write_text("")
    (d / RECORD).write_text("{not json")
    with pytest.raises(UserError, match="cannot read .*run.json"):
        read_record(d)
    for rec, missing in (({"blocks": []}, "base_model"), ({"base_model": {"name": "m"}}, "blocks")):
        (d / RECORD).write_text(json.dumps(rec))
        with pytest.raises(UserError, match=f"field '{missing}' is missing"):
            read_record(str(d))
    (d / RECORD).write_text(json.dumps({"base_model": {"name": "m"}, "blocks": [], "x": 1}))
    assert read_record(d) == {"base_model": {"name": "m"}, "blocks": [], "x": 1}


def test_load_run_rebuilds_a_pruned_structure_and_refuses_weights_that_do_not_fit(tmp_path):
    from safetensors.torch import load_file, save_file

    from edgeprune.anatomy import find_anatomy
    from edgeprune.nuwa.head import slice_head
    from edgeprune.surgery import apply_structure, block_dims
    from edgeprune.zoo.registry import spec_from_record

    # a timm model whose recorded checkpoint is gone: load_run builds the architecture only
    base = {"name": "deit_tiny_patch16_224", "checkpoint": str(tmp_path / "gone.pth"),
            "checkpoint_sha256": "0" * 64, "img_size": 32, "model_kwargs": {"depth": 2}, "num_classes": 4}
    model = spec_from_record(base).create(pretrained=False)
    dims = block_dims(find_anatomy(model))
    dims[0].update(num_heads=1, qk_dim=16, v_dim=24, mlp_hidden=100)
    dims[1].update(qk_dim=8, mlp_hidden=64)
    apply_structure(model, dims)
    slice_head(model, [2, 0])  # a NuWa-style record: the head keeps 2 of the 4 classes
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    model.train()
    rec = {"base_model": base, "blocks": dims, "head": {"mode": "slice", "classes": [2, 0], "num_classes": 2}}
    save_run(tmp_path / "run", model, rec)
    loaded, rec2 = load_run(tmp_path / "run")
    assert rec2 == {**json.loads(json.dumps(rec)), "weights_sha256": rec2["weights_sha256"]} and not loaded.training
    assert block_dims(find_anatomy(loaded)) == dims
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert list(sd) == list(sd2) and all(torch.equal(sd[k], sd2[k]) for k in sd)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))
    # a weight file that lacks one tensor is refused (strict load), naming the run
    weights = load_file(str(tmp_path / "run" / WEIGHTS))
    save_file({k: v for k, v in weights.items() if k != "blocks.1.mlp.fc2.bias"}, str(tmp_path / "run" / WEIGHTS))
    with pytest.raises(UserError, match=r"model.safetensors changed since the run was saved"):  # recorded sha256
        load_run(tmp_path / "run")
    (tmp_path / "run" / RECORD).write_text(json.dumps(rec))  # a run without weights_sha256 (older edgeprune)
    with pytest.raises(UserError, match=r"run: weights do not fit the recorded model: Error\(s\) in loading"):
        load_run(tmp_path / "run")
    save_file(weights, str(tmp_path / "run" / WEIGHTS))
    # a record whose block 0 MLP is dense: the weights do not fit
    (tmp_path / "run" / RECORD).write_text(json.dumps(dict(rec, blocks=[dict(dims[0], mlp_hidden=768)] + dims[1:])))
    with pytest.raises(UserError, match="run: weights do not fit the recorded model: "):
        load_run(tmp_path / "run")
    # a record with more heads than the model has: apply_structure's ValueError, as a UserError
    (tmp_path / "run" / RECORD).write_text(json.dumps(dict(rec, blocks=[dict(b, num_heads=4) for b in dims])))
    with pytest.raises(UserError, match="weights do not fit the recorded model: block 0: record has 4 heads"):
        load_run(tmp_path / "run")
