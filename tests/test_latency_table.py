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
    (json.dumps({"format": FORMAT}), "is missing"),
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
    with pytest.raises(UserError, match="'attn.ms' must be a nested list"):
        LatencyTable.load(p)
    d = _hand_table().to_dict()
    d["mlp"]["widths"] = [16, 8, 48, 64]
    p.write_text(json.dumps(d))
    with pytest.raises(UserError, match="'mlp.widths' must be"):
        LatencyTable.load(p)


# -- profiles: [pruning] ------------------------------------------------------------------------

def test_shipped_profiles_pruning_rules() -> None:
    import devices

    assert devices.pruning_rules(devices.load_profile("cpu")) == {
        "mlp_round_to": 8, "head_dim_round_to": 8, "qk_equals_v": False}
    for name in ("orin-nx", "rtx3090"):
        assert devices.pruning_rules(devices.load_profile(name)) == {  # + TensorRT's fp16 fused-MHA head dims
            "mlp_round_to": 64, "head_dim_round_to": 16, "qk_equals_v": True, "head_dims": list(range(16, 257, 8))}


def _cpu_toml(tmp_path: Path, extra: str) -> Path:
    import devices

    text = devices.shipped_profile_path("cpu").read_text()
    text = text[: text.index("[pruning]")] + extra
    p = tmp_path / "cpu2.toml"
    p.write_text(text)
    return p


def test_pruning_section_defaults_and_overrides(tmp_path: Path) -> None:
    import json as _json

    import devices

    assert devices.pruning_rules(devices.load_profile(_cpu_toml(tmp_path, ""))) == {
        "mlp_round_to": 8, "head_dim_round_to": 8, "qk_equals_v": False}  # no section: backend defaults
    p = devices.load_profile(_cpu_toml(tmp_path, "[pruning]\nmlp_round_to = 32\nqk_equals_v = true\n"))
    assert devices.pruning_rules(p) == {"mlp_round_to": 32, "head_dim_round_to": 8, "qk_equals_v": True}
    assert devices.profile_from_record(_json.loads(_json.dumps(p.to_dict()))) == p


@pytest.mark.parametrize("extra,match", [("[pruning]\nmlp_round_to = 0\n", "pruning.mlp_round_to must be >= 1"),
                                         ("[pruning]\nqk_equals_v = 1\n", "pruning.qk_equals_v must be true or false"),
                                         ("[pruning]\nmlp_round = 8\n", "unknown key pruning.mlp_round")])
def test_bad_pruning_field_is_named(tmp_path: Path, extra: str, match: str) -> None:
    import devices

    with pytest.raises(UserError, match=match):
        devices.load_profile(_cpu_toml(tmp_path, extra))


# -- grid -------------------------------------------------------------------------------------

DEIT_S = {"embed_dim": 384, "depth": 12, "num_heads": 6, "head_dim": 64, "mlp_hidden": 1536, "tokens": 197}


def test_grid_for_deit_small_on_cpu_is_bounded_and_on_the_rules() -> None:
    from edgeprune.latency.grid import make_grid

    g = make_grid(DEIT_S, {"mlp_round_to": 8, "head_dim_round_to": 8, "qk_equals_v": False})
    assert g.mlp[0] == 8 and g.mlp[-1] == 1536 and len(g.mlp) <= 16
    assert all(w % 8 == 0 for w in g.mlp) and g.mlp == sorted(set(g.mlp))
    assert g.heads == [1, 2, 3, 4, 5, 6]
    assert g.qk[0] == 8 and g.qk[-1] == 64 and all(d % 8 == 0 for d in g.qk) and g.qk == g.v
    assert g.count() == len(g.mlp) + 6 * len(g.qk) * len(g.v) <= 120


def test_gpu_grid_times_only_the_diagonal() -> None:
    from edgeprune.latency.grid import make_grid

    g = make_grid(DEIT_S, {"mlp_round_to": 64, "head_dim_round_to": 16, "qk_equals_v": True})
    assert g.mlp[0] == 64 and g.mlp[-1] == 1536 and all(w % 64 == 0 for w in g.mlp)
    assert g.qk == [16, 32, 48, 64]
    assert all(q == v for _, q, v in g.attn_points()) and len(g.attn_points()) == 6 * 4


def test_grid_keeps_a_dense_width_off_the_rule() -> None:
    from edgeprune.latency.grid import make_grid

    g = make_grid({**DEIT_S, "mlp_hidden": 100, "head_dim": 20},
                  {"mlp_round_to": 64, "head_dim_round_to": 16, "qk_equals_v": False})
    assert g.mlp == [64, 100] and g.qk == [16, 20]


# -- building: a fake backend that counts calls -------------------------------------------------

class _Counting:
    """The fake backends' machine: every run of a module costs a known function of its shape (:func:`_cost`);
    ``calls`` counts the opened modules, ``fail_after`` interrupts the build after N (a Ctrl-C).

    ``overhead``: ms a block costs inside a model beyond ``inside`` x its two sub-blocks' compute; ``call``: ms
    every run of
    a module pays once (a sub-block timed alone pays it, a block inside a model does not); ``outside``: the model
    without its blocks; ``model_factor`` / ``dense_factor``: pruned / dense whole models cost this times the sum
    of their parts; ``mixed_factor``: the same for pruned models whose blocks differ (what a table's uniformly cut
    models cannot see: it applies to the models the self-check times, :func:`_checking`); ``switch``: inside a model
    a block whose dims differ from the previous block's costs ``1 + switch`` times its in-model cost (what the
    table's shape-change models measure, :mod:`edgeprune.latency.shape_change`); ``alone_share``: a block or a chain of them timed alone also pays this x its first block's
    in-model cost (the real boxes' pattern: one dense block alone cost 2.5x a block inside a chain)."""

    calls: list = []
    fail_after: int | None = None
    overhead = 0.0
    inside = 1.0
    call = 0.0
    outside = 3.0
    model_factor = 1.0
    dense_factor = 1.0
    mixed_factor = 1.0
    switch = 0.0
    checking = False  # the self-check is timing (set by :func:`_checking`)
    alone_share = 0.0
    square = 0.0  # a block inside a model also costs ``square`` x its compute squared (a curved in-model cost)
    attn_inside = None  # inside a model the attention costs this x its compute (None: ``inside``, as the MLP)

    @classmethod
    def reset(cls, **kw) -> None:
        cls.calls, cls.fail_after, cls.overhead, cls.call, cls.outside, cls.square = [], None, 0.0, 0.0, 3.0, 0.0
        cls.attn_inside, cls.alone_share, cls.switch = None, 0.0, 0.0
        cls.model_factor = cls.dense_factor = cls.mixed_factor = cls.inside = 1.0
        for k, v in kw.items():
            setattr(cls, k, v)


def _mlp_cost(w: int) -> float:
    return 1.0 + w / 100.0


def _attn_cost(h: int, q: int, v: int) -> float:
    return 2.0 + h * (2 * q + v) / 100.0


def _block_dims(blk) -> tuple[int, int, int, int]:
    """(heads, qk, v, mlp) of a timm block (dense or rebuilt with a PrunedAttention)."""
    a = blk.attn
    return a.num_heads, getattr(a, "qk_dim", a.head_dim), getattr(a, "v_dim", a.head_dim), blk.mlp.fc1.out_features


def _inside(compute: float, attn: float = 0.0) -> float:
    """ms of a block inside a model (or a chain) whose two sub-blocks compute ``compute`` ms, ``attn`` ms of it the
    attention's (priced at ``attn_inside`` where set)."""
    c = _Counting
    shift = 0.0 if c.attn_inside is None else (c.attn_inside - c.inside) * attn
    return c.inside * compute + shift + c.square * compute ** 2 + c.overhead


def _cost(module) -> tuple[tuple, float]:
    """(what it is, ms of one run) of any module a build times (module doc of :class:`_Counting`)."""
    from edgeprune.latency.measure import AttnSubBlock, MlpSubBlock

    import torch.nn as nn

    c = _Counting
    if isinstance(module, MlpSubBlock):
        return ("mlp", module.fc1.out_features), _mlp_cost(module.fc1.out_features) + c.call
    if isinstance(module, AttnSubBlock):
        a = module.attn
        return ("attn", a.num_heads, a.qk_dim, a.v_dim), _attn_cost(a.num_heads, a.qk_dim, a.v_dim) + c.call
    if not hasattr(module, "blocks"):  # one whole block, or a chain of them
        chain = list(module) if isinstance(module, nn.Sequential) else [module]
        each = [_inside(_attn_cost(h, q, v) + _mlp_cost(m), _attn_cost(h, q, v)) for h, q, v, m in map(_block_dims, chain)]
        return (("chain", len(chain)) if len(chain) > 1 else ("block",)), sum(each) + c.call + c.alone_share * each[0]
    dims = [_block_dims(b) for b in module.blocks]
    if not dims:
        return ("outside",), c.outside + c.call
    ms = c.outside + c.call + sum(_inside(_attn_cost(h, q, v) + _mlp_cost(m), _attn_cost(h, q, v))
                                  * (1.0 + c.switch if i and dims[i - 1] != (h, q, v, m) else 1.0)
                                  for i, (h, q, v, m) in enumerate(dims))
    dense = all(d == (3, 64, 64, 768) for d in dims)
    mixed = len(set(dims)) > 1 and c.checking
    return ("model", tuple(dims)), ms * (c.dense_factor if dense else c.model_factor * (c.mixed_factor if mixed else 1))


@pytest.fixture(autouse=True)
def _checking(monkeypatch):
    """``_Counting.checking`` is True while :func:`edgeprune.latency.selfcheck.run_check` runs: the fake's
    ``mixed_factor`` hits the models a table did not time (its shape-change models are timed by the build)."""
    from edgeprune.latency import selfcheck

    inner = selfcheck.run_check

    def run_check(*args, **kwargs):
        _Counting.checking = True
        try:
            return inner(*args, **kwargs)
        finally:
            _Counting.checking = False

    monkeypatch.setattr(selfcheck, "run_check", run_check)


@pytest.fixture(scope="module", autouse=True)
def _unregister_fake_timers():
    """The fake backends registered by this module's tests leave the registry afterwards."""
    yield
    from edgeprune.latency.measure import unregister_timer

    for name in ("fake-count", "fake-drift"):
        unregister_timer(name)


class _Fixed:
    """A runner whose every run takes ``ms``."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def prepare(self, x) -> None: ...

    def time_once(self, x) -> float:
        return self.ms

    def close(self) -> None: ...


def _fake_timer():
    from edgeprune.latency.measure import Timer, get_timer, list_timers, register_timer, unregister_timer

    if "fake-count" in list_timers():
        if type(get_timer("fake-count")).__module__ == __name__:
            return
        # registered by the other copy of this module (``from tests.test_latency_table import ...`` in another test
        # file imports it a second time): that timer would count in the other copy's _Counting
        unregister_timer("fake-count")

    @register_timer("fake-count")
    class FakeTimer(Timer):
        def version(self) -> str:
            return "1"

        def device_name(self, s) -> str:
            return "fake-device"

        def open(self, module, x, s, workdir):
            if _Counting.fail_after is not None and len(_Counting.calls) >= _Counting.fail_after:
                raise KeyboardInterrupt
            key, ms = _cost(module)
            _Counting.calls.append(key)
            return _Fixed(ms), x


@pytest.fixture
def tiny_vit(timm):
    from edgeprune.anatomy import find_anatomy

    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2).eval()
    return find_anatomy(m)


def _opts(**kw):
    from edgeprune.latency.build import BuildOptions

    base = dict(backend="fake-count", threads=1, batch=2, warmup=0, iterations=1, clock="wall", interleave=False,
                repeats=1,
                grid={"max_mlp": 3, "max_dims": 2, "max_heads": 2})
    base.update(kw)
    return BuildOptions(**base)


def test_resume_skips_measured_entries(tmp_path: Path, tiny_vit) -> None:
    import devices
    from edgeprune.latency.build import build_table

    _fake_timer()
    out = tmp_path / "t.json"
    _Counting.reset(fail_after=4, overhead=-0.25, call=0.5)
    with pytest.raises(KeyboardInterrupt):
        build_table(tiny_vit, devices.load_profile("cpu"), _opts(), out, show_progress=False)
    first = list(_Counting.calls)
    assert len(first) == 4
    with pytest.raises(UserError, match="incomplete"):
        LatencyTable.load(out)
    part = LatencyTable.load(out, allow_partial=True)
    assert len(part.measured["mlp"]) + len(part.measured["attn"]) == 4
    _Counting.calls, _Counting.fail_after = [], None
    t = build_table(tiny_vit, devices.load_profile("cpu"), _opts(), out, show_progress=False)
    assert not set(first) & set(_Counting.calls)  # nothing timed twice
    # the grid, the dense model, the model without blocks, the dense block, nine chains (three uniform, six mixed: the
    # in-model cost surface), the half and quarter models (each chain's call), the two shape-change models, then 3
    # self-check models and the dense model once more (issue 52: how far the load moved it during the build)
    total = len(t.mlp["widths"]) + len(t.attn["heads"]) * len(t.attn["qk"]) * len(t.attn["v"]) + 16 + 3 + 1
    assert len(first) + len(_Counting.calls) == total
    assert LatencyTable.load(out).complete
    assert t.mlp_ms(768) == 1.0 + 7.68 + 0.5 and t.attn_ms(3, 64, 8) == 2.0 + 3 * 136 / 100.0 + 0.5
    # timed directly: the model without blocks (one call); per block: its cost beyond the two calls of its sub-blocks
    assert t.fixed_ms == _Counting.outside + 0.5 and t.block_overhead_ms == pytest.approx(-0.25 - 2 * 0.5)
    _Counting.calls = []
    build_table(tiny_vit, devices.load_profile("cpu"), _opts(), out, show_progress=False)
    assert _Counting.calls == []  # a complete table of the same key: nothing to time


def test_another_key_is_refused_without_force(tmp_path: Path, tiny_vit) -> None:
    import devices
    from edgeprune.latency.build import build_table

    _fake_timer()
    out = tmp_path / "t.json"
    _Counting.reset()
    build_table(tiny_vit, devices.load_profile("cpu"), _opts(), out, show_progress=False)
    before = out.read_bytes()
    _Counting.calls = []
    with pytest.raises(UserError, match="another key .*batch") as err:
        build_table(tiny_vit, devices.load_profile("cpu"), _opts(batch=4), out, show_progress=False)
    assert _Counting.calls == [] and out.read_bytes() == before and "\n" not in str(err.value)
    with pytest.raises(UserError, match="another grid"):
        build_table(tiny_vit, devices.load_profile("cpu"), _opts(grid={"max_mlp": 4}), out, show_progress=False)
    t = build_table(tiny_vit, devices.load_profile("cpu"), _opts(batch=4, force=True), out, show_progress=False)
    assert t.key["batch"] == 4 and LatencyTable.load(out).key["batch"] == 4


def test_a_pruned_or_mixed_model_is_refused(tiny_vit) -> None:
    from edgeprune.latency.grid import shape_of

    assert shape_of(tiny_vit) == {"embed_dim": 192, "depth": 2, "num_heads": 3, "head_dim": 64,
                                  "mlp_hidden": 768, "tokens": 5}
    tiny_vit.blocks[1].mlp_hidden = 384  # as a model with a pruned MLP reads
    with pytest.raises(UserError, match="blocks of one shape"):
        shape_of(tiny_vit)
    tiny_vit.blocks[1].mlp_hidden = 768
    tiny_vit.blocks[0].qk_dim = 32
    with pytest.raises(UserError, match="needs the dense model"):
        shape_of(tiny_vit)


# -- a real build (torch CPU backend) -----------------------------------------------------------

def test_real_tiny_build_matches_the_whole_model(tmp_path: Path, tiny_vit) -> None:
    import devices
    from edgeprune.latency.build import build_table
    from edgeprune.latency.measure import TimingSettings, get_timer

    out = tmp_path / "t.json"
    t = build_table(tiny_vit, devices.load_profile("cpu"),
                    _opts(backend="torch", batch=4, warmup=2, iterations=15, clock="auto", force=True), out,
                    show_progress=False)  # --force: a self-check missed on this shared box keeps the table
    assert t.meta["settings"]["clock"] == "cpu"  # one CPU thread: its CPU time
    chk = t.meta["self_check"]
    assert [m["name"] for m in chk["models"]] == ["dense", "x0.7", "x0.5", "x0.3"]
    assert chk["forced"] is (not chk["passed"]) and t.measured["outside"] and t.measured["block"]
    assert all(m["measured_ms"] > 0 and m["predicted_ms"] > 0 for m in chk["models"])
    assert t.fixed_ms == t.meta["parts"]["outside_ms"] > 0
    assert t.complete and t.key["backend"] == "torch" and t.rules["mlp_round_to"] == 8
    assert all(math.isfinite(x) and x > 0 for x in t.mlp["ms"])
    assert sorted(t.measured["mlp"]) == t.mlp["widths"] and t.measured["model"] is True
    # the blocks are timed apart from the model: together they cannot take much longer than it
    blocks = t.key["depth"] * t.block_ms(t.dense_dims())
    assert blocks < 1.6 * t.dense_model_ms and t.fixed_ms >= 0
    # the whole model timed again, independently: the table's dense prediction is near it
    again = get_timer("torch").time(tiny_vit.model, (4, 3, 32, 32),
                                    TimingSettings(threads=1, warmup=2, iterations=15, clock="cpu"))
    assert 0.5 < t.dense_ms() / again < 2.0
    assert LatencyTable.load(out).dense_ms() == pytest.approx(t.dense_ms())


@pytest.mark.parametrize("shape,module", [((2, 5, 192), "attn"), ((2, 5, 192), "mlp")])
def test_onnxruntime_timer_times_a_sub_block(tiny_vit, shape, module) -> None:
    pytest.importorskip("onnxruntime")
    from edgeprune.latency.measure import TimingSettings, attn_subblock, get_timer, mlp_subblock

    m = attn_subblock(tiny_vit.blocks[0], 192, 2, 16, 32) if module == "attn" else mlp_subblock(tiny_vit.blocks[0], 192, 64)
    ms = get_timer("onnxruntime").time(m, shape, TimingSettings(threads=1, warmup=1, iterations=3))
    assert math.isfinite(ms) and ms > 0


def test_sub_blocks_compute_the_block_formula(tiny_vit) -> None:
    import torch

    from edgeprune.latency.measure import attn_subblock, mlp_subblock

    b = tiny_vit.blocks[0]
    x = torch.randn(2, 5, 192)
    a = attn_subblock(b, 192, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(a(x), x + a.attn(b.block.norm1(x)), atol=1e-6)
        m = mlp_subblock(b, 192, 768)
        assert torch.allclose(m(x), x + m.fc2(b.act(m.fc1(b.block.norm2(x)))), atol=1e-6)
    assert m.fc1.out_features == 768 and a.attn.qkv.out_features == 3 * (2 * 64 + 64)


# -- command line -----------------------------------------------------------------------------

def _cli(*args):
    from tests.conftest import run_cli

    return run_cli(["latency-table", *args])


@pytest.mark.parametrize("args,code,match", [
    (["--device", "nope"], 2, "unknown device 'nope'"),
    (["--batch", "0"], 2, "--batch must be >= 1"),
    (["--threads", "0"], 2, "--threads must be >= 1"),
    (["--backend", "cuda-magic"], 2, "Invalid value for '--backend'"),
    (["--device", "orin-nx"], 1, "run `edgeprune latency-table --model vit_tiny_patch16_224 --device orin-nx"),
])
def test_cli_bad_input_is_one_line(tmp_path: Path, args, code, match) -> None:
    r = _cli("--model", "vit_tiny_patch16_224", "--random-init", "-o", tmp_path / "t.json", *args)
    assert r.exit_code == code, r.output
    assert match in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()


def test_cli_builds_resumes_and_refuses_another_key(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    base = ["--model", "vit_tiny_patch16_224", "--random-init", "--img-size", "32", "--model-kwargs", "depth=1",
            "--backend", "torch", "--threads", "1", "--warmup", "0", "--iterations", "3", "--quiet", "-o", out]
    r = _cli(*base, "--force")  # --force: keep it should its self-check miss on this shared box
    assert r.exit_code == 0, r.output
    assert "entries on" in r.stdout and "self-check" in r.stdout and LatencyTable.load(out).complete
    r = _cli(*base[:-2], "--batch", "2", "-o", out)
    assert r.exit_code == 2 and "exists with another key (batch" in r.stderr and "--force" in r.stderr
    r = _cli(*base[:-2], "-o", tmp_path)
    assert r.exit_code == 2 and "is a folder" in r.stderr


def test_statistic_min_is_the_fastest_run_and_is_part_of_resume(tmp_path: Path, tiny_vit) -> None:
    import devices
    from edgeprune.latency.build import build_table
    from edgeprune.latency.measure import TimingSettings, Timer

    class Seq:
        """A runner whose time_once returns a fixed sequence."""

        def __init__(self) -> None:
            self.seq = iter([9.0, 5.0, 7.0, 3.0, 8.0])

        def prepare(self, x) -> None: ...

        def time_once(self, x) -> float:
            return next(self.seq)

        def close(self) -> None: ...

    class SeqTimer(Timer):
        def open(self, module, x, s, workdir):
            return Seq(), x

    t = SeqTimer()
    assert t.time(None, (1, 2), TimingSettings(warmup=0, iterations=5, statistic="min", repeats=1)) == 3.0
    assert t.time(None, (1, 2), TimingSettings(warmup=0, iterations=5, repeats=1)) == 7.0
    assert t.time(None, (1, 2), TimingSettings(warmup=1, iterations=4, repeats=1)) == 5.0 + (7.0 - 5.0) / 2
    _fake_timer()
    out = tmp_path / "t.json"
    build_table(tiny_vit, devices.load_profile("cpu"), _opts(), out, show_progress=False)
    with pytest.raises(UserError, match="another statistic"):
        build_table(tiny_vit, devices.load_profile("cpu"), _opts(statistic="min"), out, show_progress=False)


def _drifting_timer():
    """A backend whose every run costs a known function of the module's shape times a machine
    load that steps up and down every 7 runs (as on a box shared with other jobs)."""
    from edgeprune.latency.measure import Timer, get_timer, list_timers, register_timer, unregister_timer

    if "fake-drift" in list_timers():
        if type(get_timer("fake-drift")).__module__ == __name__:
            return
        # registered by the other copy of this module (``from tests.test_latency_table import ...`` in another test
        # file imports it a second time): that timer would count in the other copy's _Counting
        unregister_timer("fake-drift")

    def cost(module) -> float:
        return _cost(module)[1]

    class Run:
        calls = 0

        def __init__(self, ms: float) -> None:
            self.ms = ms

        def prepare(self, x) -> None: ...

        def time_once(self, x) -> float:
            Run.calls += 1
            return self.ms * (1.0 + (Run.calls // 7) % 3)

        def close(self) -> None: ...

    @register_timer("fake-drift")
    class DriftTimer(Timer):
        def version(self) -> str:
            return "1"

        def device_name(self, s) -> str:
            return "fake-device"

        def open(self, module, x, s, workdir):
            return Run(cost(module)), x


def test_interleave_cancels_a_drifting_load(tmp_path: Path, tiny_vit) -> None:
    import devices
    from edgeprune.latency.build import build_table

    _drifting_timer()
    cpu = devices.load_profile("cpu")
    _Counting.reset()
    plain = build_table(tiny_vit, cpu, _opts(backend="fake-drift", iterations=5, force=True), tmp_path / "a.json",
                        show_progress=False)
    il = build_table(tiny_vit, cpu, _opts(backend="fake-drift", iterations=5, interleave=True, force=True),
                     tmp_path / "b.json",
                     show_progress=False)
    true = [1.0 + w / 100.0 for w in il.mlp["widths"]]
    rel_il = [ms / il.mlp["ms"][-1] for ms in il.mlp["ms"]]
    rel_plain = [ms / plain.mlp["ms"][-1] for ms in plain.mlp["ms"]]
    assert rel_il == pytest.approx([c / true[-1] for c in true], rel=1e-9)
    assert rel_plain != pytest.approx([c / true[-1] for c in true], rel=1e-3)  # the drift shows without it
    h, d = il.key["num_heads"], il.key["head_dim"]
    for (a, q, v) in il.measured["attn"]:
        want = (2.0 + a * (2 * q + v) / 100.0) / (2.0 + h * 3 * d / 100.0)
        assert il.attn_ms(a, q, v) / il.attn_ms(h, d, d) == pytest.approx(want, rel=1e-9)
    assert il.meta["settings"]["interleave"] is True and LatencyTable.load(tmp_path / "b.json").complete
    with pytest.raises(UserError, match="another interleave"):
        build_table(tiny_vit, cpu, _opts(backend="fake-drift"), tmp_path / "b.json", show_progress=False)


def test_cpu_clock_counts_compute_not_waiting() -> None:
    import time as _time

    from edgeprune.latency.measure import TimingSettings, time_once

    class Sleeper:
        def time_once(self, x) -> float:
            t0 = _time.perf_counter()
            _time.sleep(0.05)  # the core held by someone else: wall time, no CPU time of ours
            return (_time.perf_counter() - t0) * 1000.0

    assert time_once(Sleeper(), None, TimingSettings()) >= 50.0
    assert time_once(Sleeper(), None, TimingSettings(clock="cpu")) < 10.0


@pytest.mark.parametrize("args,match", [(["--clock", "cpu", "--threads", "2"], "--clock cpu measures one CPU thread"),
                                        (["--clock", "cpu"], "--clock cpu measures one CPU thread")])
def test_cli_cpu_clock_needs_one_thread(tmp_path: Path, args, match) -> None:
    r = _cli("--model", "vit_tiny_patch16_224", "--random-init", "-o", tmp_path / "t.json", *args)
    assert r.exit_code == 2 and match in r.stderr, r.output


@pytest.mark.parametrize("threads,clock", [(1, "cpu"), (2, "wall"), (None, "wall")])
def test_auto_clock_is_cpu_for_one_cpu_thread(threads, clock) -> None:
    import devices
    from edgeprune.latency.build import BuildOptions, settings_for

    _t, s, _b = settings_for(devices.load_profile("cpu"), BuildOptions(threads=threads))
    assert s.clock == clock


def test_cli_refuses_an_unrelated_existing_file_and_an_unwritable_folder(tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    out.write_bytes(b"not a table")
    args = ["--model", "vit_tiny_patch16_224", "--random-init", "--img-size", "32", "--model-kwargs", "depth=1",
            "--backend", "torch", "--threads", "1", "--quiet"]
    r = _cli(*args, "-o", out)
    assert r.exit_code == 2 and "is not a latency table" in r.stderr and "--force" in r.stderr
    assert out.read_bytes() == b"not a table"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = _cli(*args, "-o", blocker / "sub" / "t.json")
    assert r.exit_code == 2 and "is a file, not a folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1
