"""benchmarks/tokens_table.py: its arguments and its table, without pruning (fast)."""

from __future__ import annotations

import pytest

from benchmarks import tokens_table as tt


def _bad(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        tt.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]


def test_bad_arguments_one_line(capsys, tmp_path):
    table = tmp_path / "t.json"
    table.write_text("{}")
    base = ["--table", str(table), "--out", str(tmp_path / "o.json")]
    assert "unknown row(s) nope" in _bad(capsys, [*base, "--rows", "dense,nope"])
    assert "--budget must be a fraction" in _bad(capsys, [*base, "--budget", "1.5"])
    assert "--eval-size must be at least 1" in _bad(capsys, [*base, "--eval-size", "0"])
    assert "--table: no file" in _bad(capsys, ["--table", str(tmp_path / "missing.json"), "--out", "o.json"])
    args = tt.parse_args([*base, "--rows", "tokens"])
    assert args.rows == "tokens" and args.budget == 0.5


def test_schedules_and_settings(tmp_path):
    assert tt.schedule("9") == 9
    assert tt.schedule("8,8,4") == (8, 8, 4)
    assert tt.schedule("decreasing:4") == "decreasing:4"
    assert tt.candidates("0, 6,decreasing:4") == [0, 6, "decreasing:4"]
    args = tt.parse_args(["--table", __file__, "--out", str(tmp_path / "o.json"), "--tokens-r", "7",
                          "--candidates", "0,3"])
    assert tt.prune_settings("tokens", args) == {"target": "mlp", "sparsity": 0.0, "tokens_merge": 7}
    both = tt.prune_settings("both", args)
    assert both["latency"] == 0.5 and both["tokens_merge"] == "auto" and both["tokens_candidates"] == [0, 3]
    assert "tokens_merge" not in tt.prune_settings("widths", args)


def test_rows_saved_replaced_and_rendered(tmp_path):
    out = tmp_path / "rows.json"
    row = {"seed": 0, "row": "tokens", "budget": 0.5, "tokens_r": "9", "candidates": "0,6", "calib_size": 8,
           "eval_size": 10, "measured": {"ratio": 0.8}, "flops": 0.7, "top1": 0.9, "agreement": 0.95,
           "dense_top1": 0.91, "prune_s": 3.0, "tokens_merge": {"schedule": 9, "r": [9, 9]}}
    tt.save_row(out, row)
    tt.save_row(out, {**row, "top1": 0.85})  # the same row again: replaced
    tt.save_row(out, {**row, "row": "dense", "measured": None, "flops": 1.0, "tokens_merge": None})
    rows = tt.load_rows(out)
    assert len(rows) == 2 and [r["top1"] for r in rows if r["row"] == "tokens"] == [0.85]
    lines = tt.render(rows).splitlines()
    assert lines[2].startswith("| dense | - | 0 | 1 |") and lines[3].startswith("| tokens | - | 0 | 0.800 |")
    assert "9 (9,9)" in lines[3] and "85.00" in lines[3]
