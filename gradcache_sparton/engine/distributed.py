"""Data-parallel GradCache: every rank's loss sees the global batch, gradients are single-process ones.

Under DistributedDataParallel (DDP) each of W ranks (processes) encodes its own B_r rows. A contrastive
loss with in-batch negatives and the batch-coupled FLOPS regularizer must see the global batch of
B = Σ_r B_r rows to equal single-process training on that batch. Three pieces make it so:

- **Gather** (:func:`gather_global_batch`, in Step (2)): every rank's reps, and the batch-first tensors
  among the loss's keyword arguments, are concatenated in rank order. This rank's slice is its own
  tensor, graph included; the other slices are constants. Every rank computes the same global loss L,
  and backprop gives each rank dL/dr for exactly its own rows: the single-process rep gradient,
  restricted to the local rows. Sparse reps (:class:`SparseReps`, the engine's ``sparse_reps``) are
  gathered as their non-zeros, padded to the largest rank's count: memory O(W · max_r nnz_r), never
  [B, V]; the local slice is this rank's ``weights`` itself, so backprop gives dL/d weights_local.
- **Scale** (in Step (3)): DDP averages parameter gradients over ranks, i.e. divides their sum by W.
  Each rank replays W · dL/dr_local, so the average is Σ_r (dL/dr_r)(dr_r/dθ) = dL/dθ, the
  single-process gradient. The loss value itself is L, the same on every rank.
- **Synchronise once** (:func:`ddp_no_sync_context`, in Step (3)): every replayed mini-batch but the
  last runs under ``no_sync``, so gradients are all-reduced once per step, not once per mini-batch.
  DDP decides in each forward whether the following backward synchronises, and a backward under
  ``no_sync`` issues no collective, so ranks may replay different numbers of mini-batches (batches
  of unequal size); each rank must run exactly one synchronising backward, which the engine ensures
  (a rank with nothing to replay runs one zero-gradient replay).

Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``; accelerate's and the
Trainer's ``fsdp_version: 2``) averages gradients over ranks too (a reduce-scatter), so the same scaling
gives single-process gradients. Two differences:

- every forward all-gathers the sharded parameters, and every backward may too: a collective in each
  Step (1) encode and each Step (3) replay. Ranks must run as many of each, whatever their rows: the
  engine pads the shorter ranks with encodes and zero-gradient replays of one of their own mini-batches
  (:func:`count_on_every_rank`; one small all-reduce each in Step (1) and Step (3)).
- :func:`fsdp_sync_context` turns gradient reduction off for every replayed mini-batch but the last
  (``set_requires_gradient_sync``): one reduce-scatter per step. The price: until the last replay each
  rank holds its FSDP units' gradients unsharded (the full model's gradients, in the parameters' dtype),
  as FSDP2's own gradient accumulation does; reducing every mini-batch instead (``mini_batch_context=
  lambda is_last: nullcontext()``) keeps them sharded and communicates once per mini-batch.

Legend: B batch (rows), W world size (ranks), V rep width, nnz non-zeros of a column's sparse reps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "count_on_every_rank",
    "data_parallel_world_size",
    "ddp_no_sync_context",
    "find_ddp",
    "find_fsdp",
    "fsdp_sync_context",
    "gather_global_batch",
    "holds_on_every_rank",
]


def data_parallel_world_size(gather_across_ranks: bool | None) -> int:
    """How many ranks' batches the loss sees: W when gathering, else 1.

    Args:
        gather_across_ranks: True: gather (``torch.distributed`` must be initialized); False: never;
            None: gather when ``torch.distributed`` is initialized with more than one rank.

    Raises:
        TypeError: ``gather_across_ranks`` is not a bool or None.
        ValueError: True while no process group is initialized.
    """
    if gather_across_ranks is not None and not isinstance(gather_across_ranks, bool):
        raise TypeError(
            f"gather_across_ranks must be a bool or None, got {type(gather_across_ranks).__name__}"
        )
    initialized = dist.is_available() and dist.is_initialized()
    if gather_across_ranks and not initialized:
        raise ValueError(
            "gather_across_ranks=True needs an initialized torch.distributed process group (launch with "
            "`accelerate launch` or `torchrun`, or call torch.distributed.init_process_group first)"
        )
    if gather_across_ranks is False or not initialized:
        return 1
    return dist.get_world_size()


def find_ddp(encoder: object) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` module behind ``encoder`` (also under ``torch.compile``), or None."""
    # torch.compile wraps the module it is given (accelerate compiles after wrapping in DDP) and keeps
    # the original as ``_orig_mod``.
    module = getattr(encoder, "_orig_mod", encoder)
    return module if isinstance(module, DistributedDataParallel) else None


def ddp_no_sync_context(ddp: DistributedDataParallel) -> Callable[[bool], AbstractContextManager[object]]:
    """A mini-batch context for Step (3): ``ddp.no_sync()`` for every mini-batch but the last.

    Under an outer ``no_sync`` (a non-final gradient-accumulation micro-step) the last mini-batch does not
    synchronise either: the plain context leaves DDP's flag as the caller set it.
    """
    return lambda is_last: nullcontext() if is_last else ddp.no_sync()


def find_fsdp(encoder: object) -> FSDPModule | None:
    """The FSDP2 root module behind ``encoder`` (``fully_shard``, also under ``torch.compile``), or None."""
    module = getattr(encoder, "_orig_mod", encoder)
    return module if isinstance(module, FSDPModule) else None


def fsdp_sync_context(module: FSDPModule) -> Callable[[bool], AbstractContextManager[None]]:
    """A mini-batch context for Step (3): gradient reduction off for every mini-batch but the last.

    The last mini-batch reduces only if the caller's setting did (a non-final gradient-accumulation
    micro-step, where accelerate turned it off, stays off); the caller's setting is restored after each.
    """

    @contextmanager
    def context(is_last: bool) -> Iterator[None]:
        caller = _requires_gradient_sync(module)
        module.set_requires_gradient_sync(caller and is_last)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(caller)

    return context


def _requires_gradient_sync(module: FSDPModule) -> bool:
    """Whether ``module``'s next backward reduces gradients (FSDP2 keeps it on each unit's parameter group,
    with no public getter; a unit without parameters of its own has none and counts as reducing)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return True if group is None else bool(group.reduce_grads)


def count_on_every_rank(count: int, device: torch.device) -> int:
    """The largest ``count`` of any rank (one 1-element all-reduce on ``device``, which the process group's
    backend must serve); ``count`` itself when no group is initialized. Every rank must call it."""
    if not (dist.is_available() and dist.is_initialized()):
        return count
    largest = torch.tensor([count], device=device, dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item())


def holds_on_every_rank(flag: bool | Tensor, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank (one 1-element all-reduce on ``device``, which the process
    group's backend must serve: CPU for gloo, CUDA for nccl); ``flag`` itself when no group is initialized.

    Every rank must call it, so that they all take the same branch afterwards (a rank deciding alone
    leaves the others waiting in a collective, or gathering a different layout).
    """
    here = torch.as_tensor(flag, device=device).to(torch.int32).reshape(1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(here, op=dist.ReduceOp.MIN)
    return bool(here.item())


def gather_global_batch(
    reps: Mapping[str, Tensor | SparseReps], loss_kwargs: Mapping[str, object]
) -> tuple[dict[str, Tensor | SparseReps], dict[str, object]]:
    """Every rank's reps and batch-first loss tensors, concatenated in rank order; the local slice keeps its graph.

    Every tensor in ``loss_kwargs`` with a dimension is batch-first and is gathered like the reps (e.g.
    teacher scores [B, 1+k]); 0-dim tensors and other values pass unchanged and must agree across ranks.
    A :class:`SparseReps` column is gathered as its non-zeros (:func:`_gather_sparse`); its local slice
    is this rank's ``weights`` tensor itself. Ranks may hold different numbers of rows (and non-zeros).
    Every rank must call this with the same column names, the same layout per column (dense or sparse),
    the same keyword names and the same trailing shapes and dtypes: that is checked first, with one
    small collective, and a mismatch raises the same ``ValueError`` on every rank (never a hang).

    Returns:
        ``(reps, loss_kwargs)`` over the global batch: each column [Σ_r B_r, V] (dense or sparse).
    """
    kwargs_to_gather = {
        name: value for name, value in loss_kwargs.items() if isinstance(value, Tensor) and value.ndim >= 1
    }
    local: dict[str, Tensor | SparseReps] = {f"rep {name!r}": rep for name, rep in reps.items()}
    local.update({f"loss keyword {name!r}": value for name, value in kwargs_to_gather.items()})
    layout = [(key, _layout_of(value)) for key, value in local.items()]
    sizes = [_sizes_of(value) for value in local.values()]
    # One object collective: every rank learns every rank's layout and sizes, so all raise together.
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (layout, sizes))
    layouts = [entry[0] for entry in everyone]  # type: ignore[index]
    if any(other != layout for other in layouts):
        described = "; ".join(
            f"rank {rank}: " + ", ".join(f"{key} {kind}" for key, kind in other)
            for rank, other in enumerate(layouts)
        )
        raise ValueError(
            "gather_across_ranks: ranks passed different columns, loss keywords, trailing shapes, dtypes or "
            "rep layouts (dense or sparse) (each rank must call the loss with the same layout; rows may "
            f"differ): {described}"
        )
    rank = dist.get_rank()
    rank_sizes = [entry[1] for entry in everyone]  # type: ignore[index]
    gathered: dict[str, Tensor | SparseReps] = {}
    for i, (key, value) in enumerate(local.items()):
        per_rank = [size[i] for size in rank_sizes]  # (rows,) or (rows, nnz) of each rank
        if isinstance(value, SparseReps):
            gathered[key] = _gather_sparse(value, per_rank, rank)
        else:
            gathered[key] = _gather_rows(value, [rows for rows, *_ in per_rank], rank)
    global_reps = {name: gathered[f"rep {name!r}"] for name in reps}
    global_kwargs = {
        name: gathered[f"loss keyword {name!r}"] if name in kwargs_to_gather else value
        for name, value in loss_kwargs.items()
    }
    return global_reps, global_kwargs


def _layout_of(value: Tensor | SparseReps) -> str:
    """What every rank's column must agree on: dense trailing shape and dtype, or sparse V and dtypes."""
    if isinstance(value, SparseReps):
        return f"sparse over {value.vocab_size} ({value.token_ids.dtype} ids, {value.weights.dtype} weights)"
    return f"{list(value.shape[1:])} {value.dtype}"


def _sizes_of(value: Tensor | SparseReps) -> tuple[int, ...]:
    """What may differ across ranks: the rows, and for sparse reps the non-zeros (no device sync)."""
    if isinstance(value, SparseReps):
        return (value.num_rows, value.weights.numel())
    return (value.shape[0],)


def _gather_sparse(local: SparseReps, sizes: list[tuple[int, ...]], rank: int) -> SparseReps:
    """All ranks' sparse reps in rank order (rows of rank 0 first); this rank's weights are ``local.weights``
    itself (with its graph), so the gradient w.r.t. the gathered weights reaches them at their entries.

    ``sizes``: each rank's (rows, nnz). Three all-gathers, each padded to the largest rank's size and
    trimmed after: the non-zeros per row [B_r] (the global offsets are their running sum), the ids and
    the weights [nnz_r]. Rows stay row-major with ascending ids, as in every rank's own reps.
    """
    rows = [size[0] for size in sizes]
    nnz = [size[1] for size in sizes]
    counts = _gather_rows(local.nonzeros_per_row(), rows, rank)  # W x [B_r] -> [Σ_r B_r]
    offsets = counts.new_zeros(counts.numel() + 1)  # [Σ_r B_r + 1]
    offsets[1:] = torch.cumsum(counts, 0)
    token_ids = _gather_rows(local.token_ids, nnz, rank)  # W x [nnz_r] -> [Σ_r nnz_r]
    weights = _gather_rows(local.weights, nnz, rank)  # W x [nnz_r] -> [Σ_r nnz_r], local slice with its graph
    return SparseReps(offsets, token_ids, weights, local.vocab_size)


def _gather_rows(local: Tensor, rows: list[int], rank: int) -> Tensor:
    """All ranks' rows of one tensor in rank order, this rank's slice being ``local`` itself (with its graph)."""
    most = max(rows)
    if most == 0:
        return local  # nothing on any rank (sparse reps without non-zeros): no collective on any rank
    # all_gather needs one shape on every rank: pad to the largest row count, trim after.
    send = local.detach()
    if send.shape[0] < most:
        send = torch.cat([send, send.new_zeros((most - send.shape[0], *send.shape[1:]))])
    send = send.contiguous()
    received = [torch.empty_like(send) for _ in rows]
    dist.all_gather(received, send)
    # W x [B_r, V] -> [Σ_r B_r, V]; only ``local`` carries a graph, so only this rank's rows get a gradient.
    return torch.cat([local if r == rank else received[r][:count] for r, count in enumerate(rows)])
