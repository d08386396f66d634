"""Multi-process calibration with torch.distributed (torchrun): statistics are sums, all-reduced.

METHODS.md §5 "Distributed statistics". Under ``torchrun`` every rank streams its share of the
calibration set; :func:`reduce_statistics` combines the ranks' statistics so that every rank
holds those of the whole set; one rank (rank 0) writes the run.

* Process group: :func:`process_group` initialises it from the torchrun environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): backend ``gloo`` for the
  CPU, ``nccl`` for a CUDA device (tensors are then moved to ``cuda:LOCAL_RANK`` for every
  collective). Collectives time out after ``EDGEPRUNE_DIST_TIMEOUT_S`` seconds (default 1800);
  torchrun itself stops the other ranks as soon as one fails.
* Sharding (:func:`shard_calibration`): the calibration set is the same list of batches on every
  rank (same source, same seed, same batch size); rank r takes a contiguous run of whole batches
  (batches ``[r*nb/W, (r+1)*nb/W)`` of ``nb``), so the batches -- and the per-image Q/K Grams
  gathered in rank order -- are exactly those of a single-process run, in the same order. When
  the number of images is unknown (a custom callable), rank r takes every W-th batch from batch r.
* Reduction (:func:`reduce_statistics`): counts, sums, sums of outer products and the Kronecker
  system are all-reduced with SUM in float64; MLP / V-O sums are first re-centred onto one common
  shift (that of the lowest rank holding data: rank 0's first batch, the single-process shift);
  the per-image Q/K Grams are all-gathered, in rank order, so that every rank holds the whole
  set and runs the same deterministic plan and solve (later passes -- the two-pass Q/K system --
  need the plan on every rank). Memory per rank for the Grams is therefore that of the whole
  calibration set, as in a single-process run.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
from typing import Any, Callable, Iterable, Iterator

import torch

from edgeprune.errors import RuntimeFault, UserError

#: seconds a collective waits for the other ranks before failing
DEFAULT_TIMEOUT_S = 1800.0


def _dist():
    return torch.distributed


def is_distributed() -> bool:
    """Whether a torch.distributed process group with more than one rank is initialised."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def env_world_size() -> int:
    """``WORLD_SIZE`` of the environment (set by torchrun), 1 when unset.

    Raises:
        UserError: WORLD_SIZE is not a positive integer.
    """
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"WORLD_SIZE={raw!r} in the environment is not a positive integer (launch with torchrun)")
    return value


def rank() -> int:
    """This process's rank (0 when not distributed)."""
    return torch.distributed.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes (1 when not distributed)."""
    return torch.distributed.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """True on rank 0 (and when not distributed): the rank that evaluates, writes and reports."""
    return rank() == 0


def backend_for(device: str) -> str:
    """The torch.distributed backend for a device: ``nccl`` for CUDA (``auto`` when CUDA is
    available), ``gloo`` otherwise."""
    d = str(device).strip().lower()
    if d == "auto":
        d = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if d.startswith("cuda") else "gloo"


def distributed_info() -> dict[str, Any]:
    """``{"world_size": W, "backend": ...}`` for the run record's ``calibration`` entry, ``{}``
    when not distributed."""
    if not is_distributed():
        return {}
    return {"world_size": world_size(), "backend": str(torch.distributed.get_backend())}


def _timeout_s() -> float:
    raw = os.environ.get("EDGEPRUNE_DIST_TIMEOUT_S")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise UserError(f"EDGEPRUNE_DIST_TIMEOUT_S={raw!r} is not a positive number of seconds")
    return value


@contextlib.contextmanager
def process_group(device: str = "cpu") -> Iterator[bool]:
    """Initialise the process group from the torchrun environment for the duration of a command.

    A no-op (yields False) when ``WORLD_SIZE`` is 1 or unset, or when a group is already
    initialised (e.g. by a Python API user). Otherwise initialises with :func:`backend_for`
    (``device``) and the timeout ``EDGEPRUNE_DIST_TIMEOUT_S`` (default 1800 s), yields True and
    destroys the group on exit.

    Raises:
        UserError: torch.distributed unavailable, torchrun variables missing, a CUDA device
            without enough GPUs for LOCAL_RANK, an explicit ``cuda:N`` (every rank would use it).
    """
    ws = env_world_size()
    dist = _dist()
    if ws <= 1 or (dist.is_available() and dist.is_initialized()):
        yield False
        return
    if not dist.is_available():
        raise UserError("this torch build has no torch.distributed (multi-process calibration needs it)")
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise UserError(f"WORLD_SIZE={ws} but {', '.join(missing)} unset: launch with "
                        f"'torchrun --nproc-per-node {ws} --no-python edgeprune ...'")
    backend = backend_for(device)
    if backend == "nccl":
        if ":" in str(device):
            raise UserError(f"--torch-device {device} under torchrun: give --torch-device cuda (each process uses "
                            f"cuda:LOCAL_RANK)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise UserError(f"device {device!r} with LOCAL_RANK={local} needs {local + 1} CUDA devices, "
                            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} available")
        torch.cuda.set_device(local)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=_timeout_s()))
    try:
        yield True
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- sharding

def shard_range(num_batches: int, rank_: int, world: int) -> tuple[int, int]:
    """[lo, hi) of the contiguous run of batches that rank ``rank_`` of ``world`` takes."""
    return rank_ * num_batches // world, (rank_ + 1) * num_batches // world


def shard_calibration(batches: Callable[[], Iterable[torch.Tensor]], num_images: int | None,
                      batch_size: int, source: Any = None) -> Callable[[], Iterable[torch.Tensor]]:
    """This rank's share of the calibration batches (``batches`` itself when not distributed).

    Args:
        batches: callable returning the whole set's batches (B, C, H, W), the same on every rank.
        num_images: size of the whole set, or None (unknown: every W-th batch from batch r).
        batch_size: images per batch (all batches full but the last).
        source: the data source behind ``batches``, if any: a folder source (``files``,
            ``label_list``, ``transform``) is sliced to the share, so that no rank decodes
            another rank's images.

    Returns:
        callable returning this rank's batches: a contiguous run of whole batches, the same
        batches (same boundaries) as in a single-process run. For a sized set the callable has
        an attribute ``first_image``: the index of its first image in the whole set (read by
        statistics that depend on the image index, e.g. ``CorpConfig.gram_tokens``).
    """
    if not is_distributed():
        return batches
    r, w = rank(), world_size()
    if num_images is None:
        return lambda: itertools.islice(batches(), r, None, w)
    lo, hi = shard_range(-(-num_images // batch_size), r, w)
    if source is not None and all(hasattr(source, a) for a in ("files", "label_list", "transform")):
        part = type(source)(source.files[lo * batch_size:hi * batch_size],
                            source.label_list[lo * batch_size:hi * batch_size], source.transform,
                            getattr(source, "description", "folder"))

        def share():
            return (x for x, _ in part.batches(batch_size))
    else:
        def share():
            return itertools.islice(batches(), lo, hi)
    share.first_image = lo * batch_size  # type: ignore[attr-defined]
    return share


# --------------------------------------------------------------------------------------------- collectives

def _comm_device() -> torch.device:
    if str(torch.distributed.get_backend()) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Elementwise SUM of ``t`` over the ranks: a new tensor of ``t``'s dtype, shape and device."""
    buf = t.detach().to(_comm_device(), copy=True)
    torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.SUM)
    return buf.to(t.device)


def all_reduce_total(total: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """A sum and how many items it holds, summed over the ranks (unchanged when not distributed)."""
    if not is_distributed():
        return total, count
    return all_reduce_sum(total), int(all_reduce_sum(torch.tensor([count], dtype=torch.float64)).item())


def _all_reduce_max(value: float) -> float:
    buf = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device())
    torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX)
    return float(buf.item())


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's ``t`` (rows may differ per rank; other dims must
    agree), in rank order, on ``t``'s device."""
    dev = _comm_device()
    w = world_size()
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(w)]
    torch.distributed.all_gather(sizes, n)
    counts = [int(s.item()) for s in sizes]
    most = max(counts)
    if most == 0:
        return t.detach()
    padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=dev)
    padded[:t.shape[0]] = t.detach().to(dev)
    parts = [torch.empty_like(padded) for _ in range(w)]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([p[:c].to(t.device) for p, c in zip(parts, counts)])


# --------------------------------------------------------------------------------------------- statistics

def common_shift_fn(has_data: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The shift every rank's :class:`~edgeprune.calibration.mlp_stats.MLPStatistics` centres on.

    Collective (call on every rank, before the calibration pass). When every rank holds at least
    one batch, returns a function that broadcasts rank 0's first-batch mean (float64, (D,)) to
    all ranks -- the shift a single-process run uses, so each rank forms bit for bit the per-batch
    float32 products of one process, and the reduction (:func:`reduce_moments`) only adds sums
    (METHODS.md §5 "Distributed statistics"). The function is called from the forward hooks at
    each rank's first batch, in the same (block) order on every rank. When some rank has no
    batch, returns None: each rank keeps its own shift and :func:`reduce_moments` re-centres.
    """
    if _all_reduce_max(0.0 if has_data else 1.0) > 0:
        return None

    def from_rank0(first_mean: torch.Tensor) -> torch.Tensor:
        buf = first_mean.detach().to(_comm_device(), torch.float64, copy=True)
        torch.distributed.broadcast(buf, 0)
        return buf.to(first_mean.device)

    return from_rank0


def recentre(total: torch.Tensor, outer: torch.Tensor | None, sq: torch.Tensor | None, count: int,
             delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sums of ``x - s_r`` re-expressed as sums of ``x - s`` with ``delta = s_r - s``.

    For ``count`` = n rows, ``total`` S1 = sum(x - s_r) (D,), ``outer`` G = sum (x - s_r)(x - s_r)^T
    (D, D) and ``sq`` = diag-only sum of squares (D,) (either may be None), float64:
    ``S1' = S1 + n delta``, ``G' = G + S1 delta^T + delta S1^T + n delta delta^T``,
    ``sq' = sq + 2 S1 * delta + n delta^2`` (METHODS.md §5 "Distributed statistics").
    """
    new_total = total + count * delta
    new_outer = None if outer is None else (outer + torch.outer(total, delta) + torch.outer(delta, total)
                                            + count * torch.outer(delta, delta))
    new_sq = None if sq is None else sq + 2 * total * delta + count * delta * delta
    return new_total, new_outer, new_sq


def reduce_moments(st) -> None:
    """All-reduce one :class:`~edgeprune.calibration.mlp_stats.MLPStatistics` in place (every rank).

    Each rank's sums are re-centred (:func:`recentre`) from its own shift (its first batch's mean)
    onto the shift of the lowest rank with data, then ``_sum``, ``_gram`` (or ``_sq``),
    ``_positive`` and ``count`` are summed in float64. A rank with no activations contributes
    zeros.
    """
    dist = torch.distributed
    dev = _comm_device()
    w = world_size()
    n = torch.tensor([st.count], dtype=torch.int64, device=dev)
    counts_t = [torch.zeros_like(n) for _ in range(w)]
    dist.all_gather(counts_t, n)
    counts = [int(c.item()) for c in counts_t]
    total = sum(counts)
    if total == 0:
        return
    src = next(i for i, c in enumerate(counts) if c > 0)
    home = st._sum.device  # where the statistics live (the activations' device)
    shift = (st._shift if st.count > 0 else torch.zeros(st.dim)).to(dev, torch.float64, copy=True)
    dist.broadcast(shift, src)
    shift = shift.to(home)
    if st.count > 0:
        delta = st._shift.double() - shift
        st._sum, gram, sq = recentre(st._sum, st._gram if st.second_order else None,
                                     None if st.second_order else st._sq, st.count, delta)
        if st.second_order:
            st._gram = gram
        else:
            st._sq = sq
    st._sum = all_reduce_sum(st._sum)
    if st.second_order:
        st._gram = all_reduce_sum(st._gram)
    else:
        st._sq = all_reduce_sum(st._sq)
    st._positive = all_reduce_sum(st._positive)
    st._shift = shift
    st.count = total


def _reduce_qk(st) -> None:
    """All-reduce a QKStatistics (score sum, count; Grams gathered) or QKSystemStatistics in place."""
    if hasattr(st, "k_sys"):
        st.k_sys = all_reduce_sum(st.k_sys)
        st.rhs = all_reduce_sum(st.rhs)
    else:
        st._score = all_reduce_sum(st._score)
        st._pair_score = all_reduce_sum(st._pair_score)  # the RoPE pair energy (METHODS.md §6)
        if st.keep_grams:
            h, d = st.num_heads, st.qk_dim
            local = (torch.stack([torch.cat(st._gq), torch.cat(st._gk)], 1) if st._gq
                     else torch.zeros(0, 2, h, d, d, dtype=torch.float32, device=st._score.device))
            both = all_gather_rows(local)
            st._gq = [both[:, 0].contiguous()] if len(both) else []
            st._gk = [both[:, 1].contiguous()] if len(both) else []
    st.num_images = int(all_reduce_sum(torch.tensor([st.num_images], dtype=torch.int64)).item())


def reduce_statistics(stats):
    """The statistics of the whole calibration set from every rank's share (identity when not
    distributed).

    Args:
        stats: this rank's :class:`~edgeprune.calibration.collect.CalibrationStatistics`; every
            rank must call this with statistics of the same structure (same blocks, same kinds).

    Returns:
        ``stats``, updated in place: every rank holds the whole set's sums (MLP / V-O moments
        re-centred and summed, Q/K scores and Kronecker systems summed, per-image Q/K Grams
        gathered in rank order = single-process image order), ``num_images`` the total and
        ``seconds`` the slowest rank's pass. METHODS.md §5 "Distributed statistics".

    Raises:
        UserError: the whole calibration set is empty (on every rank).
        RuntimeFault: a collective failed: another rank stopped or timed out (one line; that
            rank's own error says why).
    """
    if not is_distributed():
        return stats
    try:
        return _reduce_all(stats)
    except RuntimeError as err:  # gloo / NCCL: a peer closed the connection or the timeout passed
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise RuntimeFault(f"rank {rank()}: combining the calibration statistics failed: another process of "
                           f"the torchrun job stopped or timed out ({first})") from err


def _reduce_all(stats):
    total = int(all_reduce_sum(torch.tensor([stats.num_images], dtype=torch.int64)).item())
    if total == 0:
        raise UserError("the calibration set is empty")
    for group in (stats.mlp, stats.vo or []):
        for st in group:
            if st is not None:
                reduce_moments(st)
    for st in stats.qk:
        if st is not None:
            _reduce_qk(st)
    if stats.output_sum is not None:  # the dense side of the output bias correction
        stats.output_sum, stats.output_count = all_reduce_total(stats.output_sum, stats.output_count)
    stats.num_images = total
    stats.seconds = _all_reduce_max(stats.seconds)
    return stats
