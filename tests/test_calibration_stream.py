"""The dense stream kept by a calibration pass (edgeprune.calibration.stream; issue 40 item 4): every block's input
and output per batch, exactly the tensors of the forward, within a memory bound."""

from __future__ import annotations

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.calibration.stream import StreamRecorder, stream_bytes
from tests.test_latency_budget import small_vit


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, 16, 16, generator=g), torch.randn(3, 3, 16, 16, generator=g)]


@torch.no_grad()
def test_the_recorder_keeps_each_blocks_input_and_output_of_every_batch():
    model = small_vit().eval()
    blocks = [b.block for b in find_anatomy(model).blocks]
    rec = StreamRecorder(blocks)
    handles = rec.attach()
    for x in _batches():
        model(x)
    for h in handles:
        h.remove()
    got = rec.result()
    assert got is not None and len(got) == 2 and all(len(ios) == len(blocks) for ios in got)
    for x, ios in zip(_batches(), got):  # the same values as a forward block by block
        h = model.patch_embed(x)
        h = model._pos_embed(h)
        h = model.norm_pre(model.patch_drop(h))
        for i, b in enumerate(blocks):
            y = b(h)
            assert torch.equal(ios[i][0], h) and torch.equal(ios[i][1], y)
            h = y
        for i in range(len(blocks) - 1):  # a block's output is the next one's input: held once
            assert ios[i][1] is ios[i + 1][0]
    n, d = got[0][0][0].shape[1:]
    held = sum(t.numel() * t.element_size() for ios in got for t in {id(t): t for io in ios for t in io}.values())
    assert held == stream_bytes(8, n, d, len(blocks))  # the estimate the prune decides with


@torch.no_grad()
def test_the_recorder_keeps_nothing_over_its_bound_or_for_a_forward_cut_short():
    model = small_vit().eval()
    blocks = [b.block for b in find_anatomy(model).blocks]
    x = _batches()[0]
    one_batch = stream_bytes(5, 17, model.embed_dim, len(blocks))
    for limit, kept in ((one_batch, True), (one_batch - 1, False)):
        rec = StreamRecorder(blocks, limit)
        handles = rec.attach()
        model(x)
        for h in handles:
            h.remove()
        assert (rec.result() is not None) == kept and rec.too_big == (not kept)

    class Cut(Exception):
        pass

    rec = StreamRecorder(blocks)
    handles = rec.attach()
    handles.append(blocks[0].register_forward_hook(lambda *a: (_ for _ in ()).throw(Cut())))
    with pytest.raises(Cut):
        model(x)
    for h in handles:
        h.remove()
    assert rec.result() is None  # one block of two: not a stream


def test_the_statistics_pass_keeps_the_stream_only_when_asked():
    model = small_vit()
    an = find_anatomy(model)
    plain = collect_statistics(an, _batches(), progress=False)
    kept = collect_statistics(an, _batches(), progress=False, stream_bytes=2 ** 30)
    assert plain.stream is None and kept.stream is not None and len(kept.stream) == 2
    assert torch.equal(kept.mlp[0].cov, plain.mlp[0].cov)  # the statistics themselves unchanged
    assert collect_statistics(an, _batches(), progress=False, stream_bytes=1).stream is None
