"""Moving activations between layers whose layouts differ (the batch slice).

Invariant (see :mod:`.groups` for the layout): a rank holds, for every activation crossing a layer
boundary, its batch slice, whole along the sequence (the tensor-parallel pass converts SP's sequence
shards inside the layers) except the sequence activations of a context-parallel layer, which stay
in its CP shards (:func:`sequence_steps`), and after backward the gradient it holds for that
activation is the *true* gradient of the global loss with respect to those elements. So a change
of layout never needs a sum: in forward, ranks either all-gather (the new slice is larger) or
take a sub-slice (smaller); in backward, the adjoint: take the own sub-slice of the gradient, or
all-gather the gradient pieces.

Values without a batch dimension (tied parameters, position tables computed from parameters) are
replicated; their gradient on a rank is a *partial* sum over that rank's batch slice, reduced over
the producing layer's DP group. When the consuming layer has another layout, :func:`replicated`
all-reduces the consumer's partials over its own DP group and divides by the producer's ``dp``,
so the producer's DP reduction adds them up exactly once.

Each function here is a plain call in the top graph (``print(dist_model.code)`` shows them) and
takes rank tuples, which are resolved through the cached groups of :mod:`.groups`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import context_parallel as cp_ops
from .groups import Layout, Ranks, all_gather_single, group


def _all_gather(x: torch.Tensor, ranks: Ranks, dim: int) -> torch.Tensor:
    """Concatenate ``x`` from every rank of ``ranks`` (in rank order) along ``dim``."""
    n = len(ranks)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((n * moved.shape[0],) + tuple(moved.shape[1:]))
    all_gather_single(out, moved, group=group(ranks))
    return out.movedim(0, dim)


def _chunk(x: torch.Tensor, index: int, parts: int, dim: int) -> torch.Tensor:
    if parts == 1:
        return x
    size = x.shape[dim]
    if size % parts:
        raise ValueError(f"cannot split dim {dim} of size {size} into {parts} equal slices; "
                         "choose a batch (or sequence length) divisible by dp (tp under sp)")
    step = size // parts
    return x.narrow(dim, index * step, step)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ranks, index, dim):
        ctx.ranks, ctx.index, ctx.dim = ranks, index, dim
        return _all_gather(x, ranks, dim)

    @staticmethod
    def backward(ctx, grad):
        return _chunk(grad, ctx.index, len(ctx.ranks), ctx.dim).contiguous(), None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ranks, index, dim):
        ctx.ranks, ctx.dim = ranks, dim
        # NOTE: a copy, not a view: a view would keep the whole (larger) tensor alive for as long
        # as the next layer holds its slice for backward
        return _chunk(x, index, len(ranks), dim).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.ranks, ctx.dim), None, None, None


class _Replicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, consumer_dp_ranks, producer_dp):
        ctx.ranks, ctx.producer_dp = consumer_dp_ranks, producer_dp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if len(ctx.ranks) > 1:
            dist.all_reduce(grad, group=group(ctx.ranks))
        return grad / ctx.producer_dp, None, None


def gather(x: torch.Tensor, ranks: Ranks, index: int, dim: int) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` over ``ranks`` (this rank is number ``index``); backward keeps
    this rank's slice of the gradient."""
    if len(ranks) == 1:
        return x
    return _Gather.apply(x, ranks, index, dim)


def take(x: torch.Tensor, ranks: Ranks, index: int, dim: int) -> torch.Tensor:
    """Keep slice ``index`` of ``len(ranks)`` along ``dim``; backward all-gathers the gradient over
    ``ranks`` (the ranks holding the other slices)."""
    if len(ranks) == 1:
        return x
    return _Slice.apply(x, ranks, index, dim)


def slice_input(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """This rank's batch slice (dim 0) of a graph input every rank holds whole (no gradient flows
    back into graph inputs, so no collective is needed)."""
    return _chunk(x, index, parts, 0)


def replicated(x: torch.Tensor, consumer_dp_ranks: Ranks, producer_dp: int) -> torch.Tensor:
    """Identity in forward; in backward the gradient is summed over the consumer's DP group and
    divided by the producer's ``dp`` (see the module docstring)."""
    if not x.requires_grad:
        return x
    return _Replicated.apply(x, consumer_dp_ranks, producer_dp)


# ----------------------------------------------------------------------------------- planning
def plan_batched(src: Layout, dst: Layout, rank: int, seq: bool = False) -> list[tuple[object, tuple]]:
    """The calls turning a batched activation in layout ``src`` into layout ``dst`` on ``rank``.

    Returns ``[(fn, extra_args), ...]``, each applied as ``x = fn(x, *extra_args)``; the same list
    on every rank of a group, so collectives match. The batch slice changes between the layouts'
    :meth:`~.groups.Layout.batch_slices`; a sequence activation (``seq``: see
    :func:`galvatron_fx.sharding.sequence.is_sequence_activation`) leaving a context-parallel
    layout is first gathered along its sequence (dim 1) and entering one is then sliced, unless
    both layouts are the same (it stays in its shards).

    NOTE: sequence-parallel (SP) layouts are converted by the tensor-parallel pass itself, inside
    the layers (a gather at the end of the producer, a scatter at the start of the consumer), so
    only CP shards cross a layer boundary.
    """
    gather, take = sequence_steps(src, dst, rank) if seq else ([], [])
    bs, bd = src.batch_slices(), dst.batch_slices()
    return gather + ([_batch_step(bs, bd, rank)] if bs.dp != bd.dp else []) + take


def sequence_steps(src: Layout, dst: Layout, rank: int) -> tuple[list, list]:
    """``(gather, take)`` steps of a sequence activation (batched or not: rotary tables) moving
    from ``src`` to ``dst``: gathered over ``src``'s CP group, then sliced for ``dst``'s; none when
    both layouts split it alike."""
    if (src.tp, src.dp, src.cp) == (dst.tp, dst.dp, dst.cp):
        return [], []
    gather = [(cp_ops.boundary_gather, (src.cp_ranks(rank), src.cp_index(rank), 1))] if src.cp > 1 else []
    take = [(cp_ops.boundary_take, (dst.cp_ranks(rank), dst.cp_index(rank), 1))] if dst.cp > 1 else []
    return gather, take


def _batch_step(src: Layout, dst: Layout, rank: int) -> tuple[object, tuple]:
    r = src.local(rank)
    small, large = (src, dst) if src.dp > dst.dp else (dst, src)  # small = more, smaller slices
    if large.tp % small.tp:
        raise ValueError(f"cannot reshard between tp={src.tp} and tp={dst.tp}: one must divide the other")
    k = large.tp // small.tp
    # the ranks whose `small` slices make up this rank's `large` slice (same position mod small.tp)
    ranks = tuple(src.base + r // large.tp * large.tp + r % small.tp + m * small.tp for m in range(k))
    index = (r % large.tp) // small.tp
    return (gather, (ranks, index, 0)) if src.dp > dst.dp else (take, (ranks, index, 0))


def rank_sets(layouts: list[Layout], world: int) -> set[Ranks]:
    """Every rank set :func:`plan_batched` / the layers may use, for all ranks (to create groups)."""
    sets: set[Ranks] = set()
    for a in layouts:
        for r in range(a.base, a.base + a.size):
            sets.add(a.tp_ranks(r))
            sets.add(a.dp_ranks(r))
            sets.add(a.zero_ranks(r))
            sets.add(a.replica_ranks(r))
            if a.ep > 1:
                sets.add(a.ep_ranks(r))
                sets.add(a.expert_dp_ranks(r))
                sets.add(a.expert_ranks(r))
            if a.cp > 1:
                sets.add(a.cp_ranks(r))
                sets.add(a.batch_slices().dp_ranks(r))
            for b in layouts:
                for _fn, args in plan_batched(a, b, r, seq=True):
                    sets.add(tuple(args[0]))
    return sets
