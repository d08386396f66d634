"""Multi-process calibration with torch.distributed (torchrun): statistics are sums, all-reduced.

METHODS.md §5 "Distributed statistics". Under ``torchrun`` every rank streams its share of the
calibration set; :func:`reduce_statistics` combines the ranks' statistics so that every rank
holds those of the whole set; one rank solves and writes the run.
"""

from __future__ import annotations

import torch


def is_distributed() -> bool:
    """Whether a torch.distributed process group with more than one rank is initialised."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def reduce_statistics(stats):
    """The statistics of the whole calibration set from every rank's share (identity when not
    distributed)."""
    if not is_distributed():
        return stats
    raise NotImplementedError("distributed statistics are not implemented yet")
