"""Latency tables (issue 30, items 1, 3, 7): interpolation, files, grid, resume, a real tiny build, CLI."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest

from edgeprune.errors import UserError
from edgeprune.latency.table import FORMAT, LatencyTable


def _hand_table(qk_equals_v: bool = False) -> LatencyTable:
    """A table whose entries follow a known non-linear rule (so interpolation is testable)."""
    widths = [8, 16, 48, 64]
    heads, dims = [1, 2, 4], [8, 12, 16]
    mlp_ms = [0.1 + (w / 10.0) ** 2 for w in widths]

    def att(h, q, v):
        if qk_equals_v and q != v:
            return math.nan
        return 0.2 + h * h * 0.05 + q * 0.01 + (v ** 1.5) * 0.003 + h * q * 0.001

    ms = [[[att(h, q, v) for v in dims] for q in dims] for h in heads]
    return LatencyTable(
        key={"embed_dim": 32, "depth": 3, "num_heads": 4, "head_dim": 16, "mlp_hidden": 64, "tokens": 17,
             "batch": 2, "precision": "fp32", "backend": "torch", "backend_version": "x",
             "device_name": "test", "profile": "cpu", "threads": 1},
        rules={"mlp_round_to": 8, "head_dim_round_to": 4, "qk_equals_v": qk_equals_v},
        mlp={"widths": widths, "ms": mlp_ms},
        attn={"heads": heads, "qk": dims, "v": dims, "ms": ms},
        fixed_ms=0.5, dense_model_ms=0.5 + 3 * (mlp_ms[-1] + ms[-1][-1][-1]),
        measured={"mlp": widths, "attn": [[h, q, v] for h in heads for q in dims for v in dims]},
        meta={})


def test_interpolation_equals_the_measured_points() -> None:
    t = _hand_table()
    for i, w in enumerate(t.mlp["widths"]):
        assert t.mlp_ms(w) == t.mlp["ms"][i]
    for a, h in enumerate(t.attn["heads"]):
        for b, q in enumerate(t.attn["qk"]):
            for c, v in enumerate(t.attn["v"]):
                assert t.attn_ms(h, q, v) == t.attn["ms"][a][b][c]
                got = t.block_ms({"mlp": 16, "heads": h, "qk": q, "v": v})
                assert got == pytest.approx(t.mlp["ms"][1] + t.attn["ms"][a][b][c], rel=1e-12)


def test_interpolation_is_linear_between_points() -> None:
    t = _hand_table()
    m = t.mlp["ms"]
    assert t.mlp_ms(24) == pytest.approx(m[1] + (m[2] - m[1]) * (24 - 16) / 32)
    assert t.mlp_ms(60) == pytest.approx(m[2] + (m[3] - m[2]) * (60 - 48) / 16)
    a = t.attn["ms"]
    # along heads (2 -> 4) at a measured (qk, v)
    assert t.attn_ms(3, 12, 16) == pytest.approx(0.5 * a[1][1][2] + 0.5 * a[2][1][2])
    # along v only (12 -> 16), weight 1/4 toward 16
    assert t.attn_ms(2, 8, 13) == pytest.approx(0.75 * a[1][0][1] + 0.25 * a[1][0][2])
    # trilinear at the centre of a cell is the mean of its 8 corners
    corners = [a[i][j][k] for i in (0, 1) for j in (0, 1) for k in (0, 1)]
    assert t.attn_ms(1.5, 10, 10) == pytest.approx(sum(corners) / 8)
    # monotone in each axis for a monotone table
    assert t.mlp_ms(17) > t.mlp_ms(16)


def test_qk_equals_v_table_interpolates_on_the_diagonal() -> None:
    t = _hand_table(qk_equals_v=True)
    a = t.attn["ms"]
    assert t.attn_ms(2, 12, 12) == a[1][1][1]
    assert t.attn_ms(2, 14, 14) == pytest.approx(0.5 * a[1][1][1] + 0.5 * a[1][2][2])
    with pytest.raises(UserError, match="qk == v"):
        t.attn_ms(2, 12, 16)


@pytest.mark.parametrize("dims,what", [({"mlp": 4}, "mlp width"), ({"mlp": 72}, "mlp width"),
                                       ({"heads": 5}, "kept heads"), ({"heads": 0}, "kept heads"),
                                       ({"qk": 4}, "qk head dim"), ({"v": 20}, "v head dim")])
def test_out_of_range_dims_are_user_errors(dims: dict, what: str) -> None:
    with pytest.raises(UserError, match=what):
        _hand_table().block_ms(dims)


def test_dense_ms_is_fixed_plus_depth_blocks() -> None:
    t = _hand_table()
    assert t.dense_ms() == pytest.approx(t.dense_model_ms)
    assert t.block_ms({}) == t.block_ms(t.dense_dims())


def _anatomy(**over):
    d = dict(embed_dim=32, depth=3, num_heads=4, head_dim=16, mlp_hidden=64, tokens=17)
    d.update(over)
    blk = types.SimpleNamespace(num_heads=d["num_heads"], head_dim=d["head_dim"], mlp_hidden=d["mlp_hidden"])
    return types.SimpleNamespace(embed_dim=d["embed_dim"], blocks=[blk] * d["depth"], num_tokens=d["tokens"])


@pytest.mark.parametrize("field,value", [("embed_dim", 48), ("depth", 4), ("num_heads", 2), ("head_dim", 8),
                                         ("mlp_hidden", 128), ("tokens", 65)])
def test_check_model_names_the_mismatch(field: str, value: int) -> None:
    t = _hand_table()
    t.check_model(_anatomy())
    with pytest.raises(UserError, match=f"{field} = ") as err:
        t.check_model(_anatomy(**{field: value}))
    assert "\n" not in str(err.value)


def test_save_load_round_trip(tmp_path: Path) -> None:
    t = _hand_table(qk_equals_v=True)
    p = tmp_path / "t.json"
    t.save(p)
    data = json.loads(p.read_text())
    assert data["format"] == FORMAT and data["attn"]["ms"][0][0][1] is None
    u = LatencyTable.load(p)
    assert u.key == t.key and u.rules == t.rules and u.mlp == t.mlp and u.measured == t.measured
    assert math.isnan(u.attn["ms"][0][0][1])
    for h, d in [(1, 8), (3, 14), (4, 16)]:
        assert u.attn_ms(h, d, d) == t.attn_ms(h, d, d)
    assert u.dense_ms() == t.dense_ms()
    assert [x.name for x in tmp_path.iterdir()] == ["t.json"]  # no temporaries left


@pytest.mark.parametrize("content,match", [
    (None, "not found"), ("{not json", "not JSON"), ('{"a": 1}', "not an edgeprune latency table"),
    (json.dumps({"format": FORMAT}), "missing field"),
])
def test_load_bad_files(tmp_path: Path, content, match: str) -> None:
    p = tmp_path / "bad.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(UserError, match=match) as err:
        LatencyTable.load(p)
    assert "\n" not in str(err.value)


def test_load_refuses_a_malformed_grid(tmp_path: Path) -> None:
    d = _hand_table().to_dict()
    d["attn"]["ms"] = d["attn"]["ms"][:2]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(UserError, match="attn.ms must be a nested list"):
        LatencyTable.load(p)
    d = _hand_table().to_dict()
    d["mlp"]["widths"] = [16, 8, 48, 64]
    p.write_text(json.dumps(d))
    with pytest.raises(UserError, match="mlp.widths must be"):
        LatencyTable.load(p)
