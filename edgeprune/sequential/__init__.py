"""Sequential calibration: block-by-block statistics on the pruned model's own inputs.

METHODS.md §5 "Sequential calibration" (issue 14). One-shot CORP takes every statistic on the
dense model; block i of the pruned model, however, sees the output of the already pruned blocks
0..i-1. Here two token streams advance through the model one block at a time over the whole
calibration set:

* the dense stream ``x_i`` (the dense model's input of block i) and
* the pruned stream ``x~_i`` (the finished pruned model's input of block i).

For block i: (1) both streams go through the still dense block i; hooks at ``qkv``'s output,
``proj``'s input and ``fc2``'s input give the pruned stream's statistics (ranking, Grams,
covariances) and the cross statistics with the dense stream; the dense output becomes
``x_{i+1}``. (2) Kept dims are ranked on the pruned stream's statistics (the usual criteria:
``edgeprune.ranking``, ``vo.plan_attention``). (3) The compensation fits the dense block's
signals from the pruned stream's kept channels: ``fc2`` and ``proj`` with the two-stream ridge map
of ``edgeprune.solve.cross_fit``, Q/K with the two-stream logit system of
``edgeprune.solve.qk_logit_cross``; the fold and surgery are CORP's (``surgery.shrink_mlp``,
``vo.prune_attention``). (4) The pruned block runs on ``x~_i`` to give ``x~_{i+1}``.

Until the first pruned block the streams are equal and share storage (one pass per block), and
there every fit is exactly CORP's; blocks after the last pruned one are not run at all. Within a
block the MLP statistics of the pruned stream are taken behind the block's *dense* attention (one
statistics pass per block; the next block's statistics see the pruned attention).

Cost, in block evaluations over the calibration set: per pruned block 2 (dense block on both
streams, batched together) + 1 (pruned block on the pruned stream, cheaper by its sparsity); per
block before the first pruned one 1; i.e. about 2 + (1 - s) dense passes in total, reported in the
info dict (``sequential.dense_pass_equivalents``). Memory: the two streams (``N * n * D * 4``
bytes each) in memory up to ``CorpConfig.sequential_memory_gb``, beyond that in temporary numpy
memmaps (deleted at the end); plus one block's statistics at a time. Not distributed (torchrun):
each rank would need the other ranks' streams.
"""

from edgeprune.sequential.block import block_modules
from edgeprune.sequential.cross import CrossStatistics
from edgeprune.sequential.embed import embed_stream
from edgeprune.sequential.prune import sequential_prune

__all__ = ["sequential_prune", "CrossStatistics", "embed_stream", "block_modules"]
