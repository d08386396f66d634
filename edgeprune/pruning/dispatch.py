"""The one entry of the one-shot prune: a fixed config runs the stages once (:func:`~edgeprune.pruning.run.run_prune`),
``embed_sparsity="auto"`` once per candidate D' (:func:`~edgeprune.pruning.embed_auto.choose_embed`),
``tokens_merge="auto"`` once per candidate merge schedule (:func:`~edgeprune.pruning.tokens_auto.choose_tokens`).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from edgeprune.corp.config import CorpConfig
from edgeprune.embed.settings import is_auto
from edgeprune.pruning.config import check_config
from edgeprune.pruning.embed_auto import choose_embed
from edgeprune.pruning.run import calibration_batches, run_prune
from edgeprune.pruning.tokens_auto import choose_tokens, is_tokens_auto


def prune_model(model: nn.Module, calibration: Any, config: CorpConfig, *, inplace: bool = False,
                batch_size: int = 32, **kwargs: Any) -> tuple[nn.Module, dict[str, Any]]:
    """(pruned model, run record) of ``model`` under ``config`` (arguments as :func:`edgeprune.prune`).

    Raises:
        UserError: as :func:`~edgeprune.pruning.run.run_prune` and :func:`~edgeprune.pruning.embed_auto.choose_embed`.
    """
    check_config(config)
    if is_auto(config):  # issue 33: one whole prune per candidate D'
        return choose_embed(model, calibration, config, calibration_batches(calibration, batch_size)[0],
                            inplace=inplace, batch_size=batch_size, **kwargs)
    if is_tokens_auto(config):  # issue 44 item 3: one prune per candidate merge schedule
        return choose_tokens(model, calibration, config, calibration_batches(calibration, batch_size)[0],
                             inplace=inplace, batch_size=batch_size, **kwargs)
    return run_prune(model, calibration, config, inplace=inplace, batch_size=batch_size, **kwargs)
