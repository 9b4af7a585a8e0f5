"""Autograd-aware tensor-parallel collectives (Megatron's f / g and their sequence-parallel kin).

The tensor-parallel pass inserts these as ``call_function`` nodes, so ``print(gm.code)`` reads e.g.
``tp_copy_to_region(layer_norm, 'tp[0,1]')``. A process group cannot be written into generated
code, so nodes carry a *group key* (a short string) that :func:`register_group` maps to the group
and its size; the pass registers every group it uses.

=============================  ===========================  ============================
op                             forward                      backward
=============================  ===========================  ============================
``tp_copy_to_region``          identity                     all-reduce
``tp_reduce_from_region``      all-reduce                   identity
``tp_scatter_to_region``       keep this rank's chunk       all-gather
``tp_gather_from_region``      all-gather                   keep this rank's chunk
``tp_all_gather_sequence``     all-gather                   reduce-scatter
``tp_reduce_scatter_sequence`` reduce-scatter               all-gather
``tp_scatter_outer``           keep this rank's chunk of    all-gather
                               each of ``outer`` parts
=============================  ===========================  ============================

Chunks are contiguous and in group-rank order along ``dim``: ``c = ceil(n / size)`` elements each,
the last ones shorter when ``size`` does not divide ``n`` (:func:`chunk_bounds`; a sequence of 17
tokens over 2 ranks is 9 + 8). Uneven chunks travel padded to ``c`` and are trimmed after, so a
gather needs ``full``, the whole length (the pass writes it into the graph). On fake or meta
tensors the ops only compute the output shape (no communication), so FakeTensorProp and
meta-device planning run through rewritten graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed import all_gather_single, reduce_scatter_single

__all__ = [
    "register_group", "group_of", "tp_copy_to_region", "tp_reduce_from_region", "tp_scatter_to_region",
    "tp_gather_from_region", "tp_all_gather_sequence", "tp_reduce_scatter_sequence",
    "vocab_parallel_embedding", "tp_scatter_outer", "tp_max",
]

_GROUPS: dict[str, tuple[object, int]] = {}


def register_group(group, size: int) -> str:
    """Remember ``group`` (a ProcessGroup, or None for the default group) of ``size`` ranks; return its key."""
    if group is not None and dist.is_available() and dist.is_initialized():
        key = "tp[" + ",".join(str(r) for r in dist.get_process_group_ranks(group)) + "]"
    elif group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() == size:
        key = "tp[world]"
    else:
        key = f"tp{size}[{id(group):x}]" if group is not None else f"tp{size}"
    _GROUPS[key] = (group, size)
    return key


def group_of(key: str):
    """``(group, size)`` registered under ``key``."""
    try:
        return _GROUPS[key]
    except KeyError:
        raise RuntimeError(f"tensor-parallel group {key!r} is not registered in this process; "
                           "apply_tensor_parallel registers the groups it uses") from None


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return x.device.type == "meta" or is_fake(x)


def _all_reduce(x: torch.Tensor, key: str, op=None) -> torch.Tensor:
    """The sum (or ``op``, a ``dist.ReduceOp``) of ``x`` over the ranks of group ``key``, on a copy."""
    group, size = group_of(key)
    if size == 1 or _is_fake(x):
        return x.clone()
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out


def tp_max(x: torch.Tensor, key: str) -> torch.Tensor:
    """The element-wise maximum of ``x`` over the ranks of group ``key`` (no gradient: a Float8
    cast's amax, so that every rank of a tensor-parallel linear scales by the whole tensor's)."""
    return _all_reduce(x.detach(), key, dist.ReduceOp.MAX)


def chunk_bounds(n: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s chunk of ``n`` elements over ``size`` ranks: chunks of
    ``ceil(n / size)``, the last ones shorter (possibly empty)."""
    c = -(-n // size)
    start = min(rank * c, n)
    return start, min(c, n - start)


def _rank(group, size: int) -> int:
    """This process's index in the group (0 without torch.distributed, e.g. planning on fake tensors)."""
    if size == 1 or not (dist.is_available() and dist.is_initialized()):
        return 0
    return max(dist.get_rank(group), 0)


def _pad_to(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dim`` to length ``n``."""
    if x.shape[dim] == n:
        return x
    shape = list(x.shape)
    shape[dim] = n - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)


def _all_gather(x: torch.Tensor, dim: int, key: str, full: int | None = None) -> torch.Tensor:
    """The whole tensor of length ``full`` along ``dim`` (default: ``size`` x this chunk) from every
    rank's chunk (:func:`chunk_bounds`)."""
    group, size = group_of(key)
    dim = dim % x.dim()
    full = size * x.shape[dim] if full is None else int(full)
    c = -(-full // size)
    if _is_fake(x):
        shape = list(x.shape)
        shape[dim] = full
        return x.new_empty(shape)
    if size == 1:
        return x.clone()
    front = _pad_to(x.movedim(dim, 0), 0, c).contiguous()
    out = front.new_empty((size * c,) + tuple(front.shape[1:]))
    all_gather_single(out, front, group=group)
    return out[:full].movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, key: str, full: int | None = None) -> torch.Tensor:
    """This rank's chunk (:func:`chunk_bounds`) of the sum over the group of ``x`` along ``dim``."""
    group, size = group_of(key)
    dim = dim % x.dim()
    n = x.shape[dim]
    start, length = chunk_bounds(n, size, _rank(group, size))
    if _is_fake(x):
        shape = list(x.shape)
        shape[dim] = length
        return x.new_empty(shape)
    if size == 1:
        return x.clone()
    c = -(-n // size)
    front = _pad_to(x.movedim(dim, 0), 0, size * c).contiguous()
    out = front.new_empty((c,) + tuple(front.shape[1:]))
    reduce_scatter_single(out, front, group=group)
    return out[:length].movedim(0, dim).contiguous()


def _chunk(x: torch.Tensor, dim: int, key: str, full: int | None = None) -> torch.Tensor:
    """This rank's chunk (:func:`chunk_bounds`) of ``x`` along ``dim``."""
    group, size = group_of(key)
    dim = dim % x.dim()
    start, length = chunk_bounds(x.shape[dim], size, _rank(group, size))
    return x.narrow(dim, start, length).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.key), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        return _all_reduce(x, key)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _conjugate(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function running ``forward(x, dim, key, full)`` and, in backward, its adjoint
    ``backward(grad, dim, key, full)`` (the pairs below differ only in which collectives they are).
    ``full`` is the whole length along ``dim``: given for a gather, ``x``'s own for a split."""

    def fwd(ctx, x, dim, key, full=None):
        ctx.dim, ctx.key = dim, key
        ctx.full = full if full is not None else x.shape[dim % x.dim()]
        return forward(x, dim, key, full)

    def bwd(ctx, grad):
        return backward(grad, ctx.dim, ctx.key, ctx.full), None, None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_ScatterToRegion = _conjugate("_ScatterToRegion", _chunk, _all_gather)
_GatherFromRegion = _conjugate("_GatherFromRegion", _all_gather, _chunk)
_AllGatherSequence = _conjugate("_AllGatherSequence", _all_gather, _reduce_scatter)
_ReduceScatterSequence = _conjugate("_ReduceScatterSequence", _reduce_scatter, _all_gather)


class _ScatterOuter(torch.autograd.Function):
    """``dim`` read as ``[outer, inner]``: keep this rank's chunk of ``inner`` (backward: all-gather it)."""

    @staticmethod
    def forward(ctx, x, dim, outer, key):
        dim = dim % x.dim()
        ctx.dim, ctx.outer, ctx.key = dim, outer, key
        return _chunk(x.unflatten(dim, (outer, -1)), dim + 1, key).flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx, grad):
        d = ctx.dim
        return _all_gather(grad.unflatten(d, (ctx.outer, -1)), d + 1, ctx.key).flatten(d, d + 1), None, None, None


def tp_scatter_outer(x: torch.Tensor, dim: int, outer: int, key: str) -> torch.Tensor:
    """Keep this rank's part of a replicated value whose ``dim`` is ``[outer, inner]`` with ``inner``
    chunked (Bloom's ALiBi over ``batch x heads``); backward all-gathers."""
    return _ScatterOuter.apply(x, dim, outer, key)


def tp_copy_to_region(x: torch.Tensor, key: str) -> torch.Tensor:
    """Megatron's f: a replicated value entering a sharded region (identity; backward all-reduce)."""
    return _CopyToRegion.apply(x, key)


def tp_reduce_from_region(x: torch.Tensor, key: str) -> torch.Tensor:
    """Megatron's g: sum the partial results of a row-parallel op (all-reduce; backward identity)."""
    return _ReduceFromRegion.apply(x, key)


def tp_scatter_to_region(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    """Keep this rank's chunk of a replicated value along ``dim`` (backward all-gather)."""
    return _ScatterToRegion.apply(x, dim, key)


def tp_gather_from_region(x: torch.Tensor, dim: int, key: str, full: int | None = None) -> torch.Tensor:
    """All-gather chunks along ``dim`` into a replicated value of length ``full`` (default: equal
    chunks); backward: keep this rank's chunk."""
    return _GatherFromRegion.apply(x, dim, key, full)


def tp_all_gather_sequence(x: torch.Tensor, dim: int, key: str, full: int | None = None) -> torch.Tensor:
    """Sequence parallel, entering a column-parallel region: all-gather along the sequence
    ``dim`` (whole length ``full``, default equal chunks); backward reduce-scatters (the gradients
    of the ranks' column shards are partial sums)."""
    return _AllGatherSequence.apply(x, dim, key, full)


def tp_reduce_scatter_sequence(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    """Sequence parallel, leaving a row-parallel region: sum the partial results and keep this rank's
    chunk along the sequence ``dim`` (backward all-gather)."""
    return _ReduceScatterSequence.apply(x, dim, key)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                             padding_idx: int | None = None) -> torch.Tensor:
    """This rank's part of an embedding lookup whose table rows ``[vocab_start, vocab_start + n)``
    it holds: ids outside the range give zero rows. Summing over the group (``tp_reduce_from_region``
    or ``tp_reduce_scatter_sequence``) gives the full lookup. ``padding_idx`` (global row) gets no
    gradient, as in ``F.embedding``."""
    n = weight.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + n)
    local = (ids - vocab_start).masked_fill(outside, 0)
    pad = padding_idx - vocab_start if padding_idx is not None and vocab_start <= padding_idx < vocab_start + n else None
    return F.embedding(local, weight, padding_idx=pad).masked_fill(outside.unsqueeze(-1), 0.0)
