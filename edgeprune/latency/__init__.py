"""Measured latency of ViT blocks on a device (issue 30): tables built by ``edgeprune latency-table``.

:class:`~edgeprune.latency.table.LatencyTable` is the file format and the interpolating predictor;
``grid``, ``measure`` and ``build`` make one (``edgeprune.latency.build.build_table``).
"""

from edgeprune.latency.table import LatencyTable

__all__ = ["LatencyTable"]
