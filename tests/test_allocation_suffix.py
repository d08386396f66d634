"""Forward passes that start at a block from the cached dense stream (edgeprune.allocation.suffix)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgeprune.allocation.suffix import BlockInputs
from edgeprune.anatomy import find_anatomy
from tests.conftest import needs_fmnist


def _blocks(model):
    return [a.block for a in find_anatomy(model).blocks]


@needs_fmnist
def test_starting_at_a_block_is_bitwise_the_full_forward_of_a_model_changed_there(fmnist_model, fmnist_calib):
    x = fmnist_calib[0][:24]
    dense = fmnist_model.eval()
    cache = BlockInputs(dense, _blocks(dense), x)
    assert cache.exact and len(cache.inputs) == len(_blocks(dense))
    with torch.no_grad():
        assert torch.equal(cache.out, dense(x))
    for b in range(len(cache.inputs)):
        assert torch.equal(cache.forward_from(dense, _blocks(dense), b), cache.out)
    # change block 2 only: starting at 2 (or earlier) is the full forward, bit for bit
    changed = copy.deepcopy(dense)
    with torch.no_grad():
        _blocks(changed)[2].mlp.fc2.weight.mul_(0.5)
        full = changed(x)
    for b in (0, 1, 2):
        assert torch.equal(cache.forward_from(changed, _blocks(changed), b), full)
    # starting after the change really reads the dense cache (so it is used, not a silent full pass)
    late = cache.forward_from(changed, _blocks(changed), 3)
    assert torch.equal(late, cache.out) and not torch.allclose(late, full)
    # nothing left patched on the blocks
    assert all("forward" not in vars(blk) for blk in _blocks(changed))


class _Toy(nn.Module):
    def __init__(self, order):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))
        self.order = order

    def forward(self, x):
        for j in self.order:
            x = self.blocks[j](x)
        return x


@pytest.mark.parametrize("order, cached", [((2, 1, 0), True), ((0, 1, 1, 2), False)])
def test_models_whose_blocks_are_not_one_chain_fall_back_to_the_full_forward(order, cached):
    """Blocks run in another order (the exactness check fails) or a block run twice (no cache):
    every call is the full forward, so the results stay right."""
    torch.manual_seed(0)
    model, x = _Toy(order), torch.randn(5, 4)
    cache = BlockInputs(model, list(model.blocks), x)
    assert not cache.exact and (cache.inputs is not None) == cached
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.blocks[1][0].weight.mul_(-1)
        for b in range(3):
            assert torch.equal(cache.forward_from(changed, list(changed.blocks), b), changed(x))


def test_bad_block_index_and_errors_inside_the_forward_restore_the_blocks():
    torch.manual_seed(0)
    model, x = _Toy((0, 1, 2)), torch.randn(5, 4)
    cache = BlockInputs(model, list(model.blocks), x)
    assert cache.exact
    with pytest.raises(ValueError, match="outside"):
        cache.forward_from(model, list(model.blocks), 3)
    with pytest.raises(RuntimeError):   # wrong input width for the last block
        broken = copy.deepcopy(model)
        broken.blocks[2] = nn.Linear(5, 4)
        cache.forward_from(broken, list(broken.blocks), 2)
    assert all("forward" not in vars(blk) for blk in broken.blocks)
