"""Budgeted allocation (``--flops`` / ``--params`` / ``--latency``): kept dims per block and module under a budget.

``greedy.allocate(anatomy, stats, cfg) -> (dims, report)`` is what the CORP stage (``edgeprune.pruning.corp``)
calls when ``CorpConfig.budget`` is set (METHODS.md §5 "Budgeted allocation"; docs/allocation.md), through
``select.select_allocation`` (candidates checked on images). Submodules: ``rules`` (the candidate grid: ``round_to``
or a latency table's rules), ``curves`` (E(k) error curves from the calibration statistics), ``greedy`` (the
allocator), ``select`` (candidates measured on the check images), ``settings`` (this section's checks), ``report``
(the record's allocation lines). The budget itself and its cost models are ``edgeprune.budget``.
"""
