"""benchmarks/merge_profile.py (issue 56 item 4): the per-op profile of dense / widths / tokens / both."""

from __future__ import annotations

import json

import pytest

from tests.conftest import needs_fmnist

pytest.importorskip("onnxruntime")


@needs_fmnist
def test_a_tiny_profile_names_the_merges_own_ops_and_writes_its_report(tmp_path):
    from benchmarks import merge_profile

    out, doc = tmp_path / "p.json", tmp_path / "doc.md"
    doc.write_text("# tokens\n")
    assert merge_profile.main(["--runs", "2", "--warmup", "0", "--batch-sizes", "1,2", "--calib-size", "32",
                               "--out", str(out), "--doc", str(doc)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["batches"]) == {"1", "2"}
    for rows in rep["batches"].values():
        assert set(rows) == set(merge_profile.ROWS)
        assert all(r["wall_ms"] > 0 and r["ops_us"] and r["profiled_runs"] >= 2 for r in rows.values())
        dense, merged = set(rows["dense"]["ops_us"]), set(rows["tokens"]["ops_us"])
        assert merged - dense, "the merge adds op types the dense graph does not have"
        assert set(rows["widths"]["ops_us"]) <= dense | {"Concat", "Slice", "Gather"}  # widths: the dense ops
    text = doc.read_text()
    assert merge_profile.START in text and "(not in the dense graph)" in text and "| batch 2 |" in text


def test_bad_values_are_one_line_argparse_errors(capsys):
    from benchmarks import merge_profile

    with pytest.raises(SystemExit) as err:
        merge_profile.parse_args(["--runs", "0"])
    assert err.value.code == 2 and "--runs" in capsys.readouterr().err
