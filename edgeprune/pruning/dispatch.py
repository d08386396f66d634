"""The one entry of the one-shot prune: a fixed config runs the stages once (:func:`~edgeprune.pruning.run.run_prune`);
a setting that is ``"auto"`` runs the candidate search (:func:`~edgeprune.pruning.search.search`) on its axis, found in
:data:`SEARCHED`: ``embed_sparsity="auto"`` once per candidate D' (:data:`~edgeprune.pruning.embed_auto.EMBED_AXIS`),
``tokens_merge="auto"`` once per candidate merge schedule (:data:`~edgeprune.pruning.tokens_auto.TOKENS_AXIS`).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from edgeprune.corp.config import CorpConfig
from edgeprune.pruning import search
from edgeprune.pruning.config import check_config
from edgeprune.pruning.embed_auto import EMBED_AXIS
from edgeprune.pruning.run import calibration_batches, run_prune
from edgeprune.pruning.tokens_auto import TOKENS_AXIS

#: the searched axes, keyed by the ``CorpConfig`` setting that is ``"auto"`` (issue 33: embed; issue 44 item 3:
#: tokens); ``check_config`` refuses more than one at once
SEARCHED: dict[str, search.Axis] = {axis.setting: axis for axis in (EMBED_AXIS, TOKENS_AXIS)}


def prune_model(model: nn.Module, calibration: Any, config: CorpConfig, *, inplace: bool = False,
                batch_size: int = 32, **kwargs: Any) -> tuple[nn.Module, dict[str, Any]]:
    """(pruned model, run record) of ``model`` under ``config`` (arguments as :func:`edgeprune.prune`).

    Raises:
        UserError: as :func:`~edgeprune.pruning.run.run_prune` and :func:`~edgeprune.pruning.search.search`.
    """
    config = check_config(config)
    asked = [axis for axis in SEARCHED.values() if axis.is_asked(config)]
    if asked:
        return search.search(asked[0], model, calibration, config, calibration_batches(calibration, batch_size)[0],
                             inplace=inplace, batch_size=batch_size, **kwargs)
    return run_prune(model, calibration, config, inplace=inplace, batch_size=batch_size, **kwargs)
