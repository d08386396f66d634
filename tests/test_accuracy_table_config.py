"""benchmarks/accuracy_table.py passes every command-line setting into the CorpConfig of each row.

(Sessions 7-8 measured ``--check-images 128`` and ``--anchors 2`` with this tool while both flags
were parsed and then dropped, so the "no change" they reported compared identical settings.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import accuracy_table  # noqa: E402


def _args(*argv: str):
    captured = {}

    def fake_run(args, log):
        captured["args"] = args
        raise SystemExit(0)

    old = accuracy_table.run
    accuracy_table.run = fake_run
    try:
        with pytest.raises(SystemExit):
            accuracy_table.main(["--no-doc", *argv])
    finally:
        accuracy_table.run = old
    return captured["args"]


def test_budgeted_rows_get_check_images_anchors_tokens_and_bias_correction():
    args = _args("--check-images", "128", "--anchors", "2", "--gram-tokens", "64", "--bias-correction", "32",
                 "--round-to", "16", "--target", "both", "--head-refit", "off", "--last-block", "full")
    cfg = accuracy_table.config_for(args, "budgeted", 0.5, 0.6)
    assert cfg.head_refit is False and cfg.last_block == "full"
    assert cfg.allocation_check_images == 128 and cfg.allocation_anchors == 2
    assert cfg.gram_tokens == 64 and cfg.bias_correction_images == 32 and cfg.round_to == 16
    assert cfg.budget == {"kind": "flops", "value": 0.5} and cfg.target == "both" and not cfg.sequential
    seq = accuracy_table.config_for(_args("--anchors", "2"), "sequential", 0.4, 0.7)
    assert seq.sequential and seq.allocation_anchors == 2 and seq.budget.value == 0.4


def test_defaults_and_uniform_rows():
    args = _args()
    cfg = accuracy_table.config_for(args, "budgeted", 0.5, 0.6)
    from edgeprune.corp import CorpConfig

    assert cfg.allocation_check_images == CorpConfig().allocation_check_images
    assert cfg.allocation_anchors == 1 and cfg.bias_correction_images is None and cfg.gram_tokens == 0
    assert cfg.head_refit is None and cfg.last_block == "auto"
    assert accuracy_table.config_for(_args("--head-refit", "on"), "budgeted", 0.5, 0.6).head_refit is True
    uni = accuracy_table.config_for(_args("--gram-tokens", "-1", "--bias-correction", "8"), "uniform", 0.5, 0.6)
    assert uni.mlp_sparsity == 0.6 and uni.attn_sparsity == 0.6 and uni.compensation
    assert uni.gram_tokens is None and uni.bias_correction_images == 8 and uni.budget is None
    nocomp = accuracy_table.config_for(args, "nocomp", 0.5, 0.6)
    assert not nocomp.compensation
