"""Issue 29 item 2: one device-independent tie-break rule for every ranking (edgeprune.solve.topk)."""

from __future__ import annotations

import pytest
import torch

from edgeprune.ranking import top_k_indices
from edgeprune.solve.topk import selection_margin, stable_top_k


def test_exact_ties_go_to_the_lower_index_whatever_the_dtype_and_length():
    g = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 4, (3, 2000), generator=g).double()  # thousands of exact ties
    for dtype in (torch.float64, torch.float32, torch.float16, torch.int64):
        got = stable_top_k(levels.to(dtype), 700)
        for row, idx in zip(levels, got):
            # reference: the top levels whole, then the lowest indices of the boundary level
            order = sorted(range(row.numel()), key=lambda j: (-float(row[j]), j))[:700]
            assert idx.tolist() == sorted(order)
        assert got.dtype == torch.int64 and got.device.type == "cpu"


def test_widening_keeps_the_order_of_distinct_float32_scores():
    one = torch.tensor(1.0, dtype=torch.float32)
    s = torch.stack([one, torch.nextafter(one, torch.tensor(2.0)), one])  # equal in float16, not float32
    assert stable_top_k(s, 1).tolist() == [1]
    assert stable_top_k(s, 2).tolist() == [0, 1]


def test_top_k_indices_is_the_one_rule():
    s = torch.tensor([[3.0, 1.0, 3.0, 2.0], [0.0, 0.0, 0.0, 5.0]])
    assert torch.equal(top_k_indices(s, 2), stable_top_k(s, 2))
    assert top_k_indices(s, 2).tolist() == [[0, 2], [0, 3]]
    assert top_k_indices(s, 0).shape == (2, 0) and top_k_indices(s, 4).tolist() == [[0, 1, 2, 3]] * 2


def test_k_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="cannot keep 5 of 4"):
        stable_top_k(torch.zeros(4), 5)
    with pytest.raises(ValueError, match="cannot keep -1 of 4"):
        stable_top_k(torch.zeros(4), -1)


def test_selection_margin_is_the_relative_gap_at_the_boundary():
    s = torch.tensor([[4.0, 1.0, 2.0, 3.0], [1.0, 1.0, 0.5, 0.0]])
    torch.testing.assert_close(selection_margin(s, 2), torch.tensor([1 / 3, 0.5], dtype=torch.float64))
    assert float(selection_margin(s, 1)[1]) == 0.0  # an exact tie at the boundary
    assert torch.isinf(selection_margin(s, 4)).all() and torch.isinf(selection_margin(s, 0)).all()
    # a perturbation below half the margin never changes the selection
    g = torch.Generator().manual_seed(1)
    x = torch.rand(50, 64, generator=g, dtype=torch.float64) + 0.1
    m = selection_margin(x, 20)
    noisy = x * (1 + (m[:, None] * 0.49) * (2 * torch.rand(50, 64, generator=g, dtype=torch.float64) - 1))
    assert torch.equal(stable_top_k(noisy, 20), stable_top_k(x, 20))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_scores_select_what_the_cpu_selects():
    levels = torch.randint(0, 3, (4, 3000), generator=torch.Generator().manual_seed(2)).float()
    got = stable_top_k(levels.cuda(), 1000)
    assert got.device.type == "cpu" and torch.equal(got, stable_top_k(levels, 1000))
