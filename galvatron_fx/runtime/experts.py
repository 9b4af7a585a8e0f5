"""Expert parallelism: one experts block run on this rank's experts over its EP group's tokens.

A layer with ``ep > 1`` splits the ``E`` experts of each experts block
(:mod:`galvatron_fx.sharding.experts`) over the ``ep`` ranks of its EP group (consecutive ranks of
its DP group, :meth:`~.groups.Layout.ep_ranks`): EP rank ``e`` holds experts
``[e * E / ep, (e + 1) * E / ep)`` of every expert weight (dim 0). :class:`ExpertParallel` replaces
the block's code in the layer graph; its ``block`` is that very code (a GraphModule: tokens, top-k
ids, top-k weights, expert weights, sizes -> combined tokens), unchanged except that each grouped
matmul computes only the rows routed to this rank's experts (:func:`local_grouped_mm`).

Token dispatch (``dispatch``):

* ``"allgather"`` (Megatron's allgather dispatcher): all-gather every EP rank's tokens, ids and
  weights; for each source rank run the block on its tokens with the ids of other ranks' experts
  replaced by ``E`` (a *sentinel*: ``histc`` over ``[0, E - 1]`` drops it, so the grouped matmuls
  skip those rows and their output rows are zero); reduce-scatter the per-source outputs back
  (each token's sum over its ``k`` experts, summed over the ranks holding them).
* ``"alltoall"`` (Megatron's alltoall dispatcher): exchange the counts first, then send each rank
  only the tokens routed to one of its experts (a token goes to each rank holding one of its ``k``
  experts, once), run the block per source on those tokens, and send the outputs back.

Each source's tokens keep their count (the others are sentinel rows), so the block's batch-derived
sizes are the ones the layer computes for its own batch. With ``tp > 1`` (no sequence parallelism)
the TP ranks hold the same tokens: TP rank ``t`` routes only its chunk of them (the others
sentinel), and the combined output is all-reduced over the TP group (Megatron's f / g around the
block), so expert weights stay whole over TP and each token is computed once.

Exact: every (token, expert) pair is computed once, by the rank holding the expert, from the same
inputs; only the order of the final sum over a token's experts changes. Gradients flow back through
the same collectives (all-gather <-> reduce-scatter, all-to-all <-> all-to-all), so the expert
weights' gradients cover every token of the EP group; the data-parallel pass reduces them over the
ranks holding the same experts (:meth:`~.groups.Layout.expert_dp_ranks`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import all_gather_single, reduce_scatter_single
from .tp_ops import _is_fake, chunk_bounds, tp_copy_to_region, tp_reduce_from_region

DISPATCHES = ("allgather", "alltoall")


_OPS: dict[str, object] = {}


def op_key(op) -> str:
    """A name for a grouped-matmul op that generated code can carry (:func:`local_grouped_mm`)."""
    key = f"{getattr(op, '__name__', 'op')}@{id(op):x}"
    _OPS[key] = op
    return key


def local_grouped_mm(key: str, x: torch.Tensor, w: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``op(x, w, offs)`` (a grouped matmul, :func:`op_key`: rows ``[offs[g-1], offs[g])`` of
    ``x`` times ``w[g]``) with ``w`` holding this rank's ``n`` experts and ``offs`` the offsets of
    all ``E``: the rows of the first ``n`` groups are computed, the rest (other ranks' experts,
    sentinels) are zero."""
    op = _OPS[key]
    if "offs" in kwargs:
        offs = kwargs.pop("offs")
    else:
        offs, args = args[0], args[1:]
    n = w.shape[0]
    local = offs[:n]
    if _is_fake(x):
        rows = x.shape[0]
    else:
        rows = int(local[-1]) if n else 0      # NOTE: a device sync; the kernel needs the count anyway
    y = op(x[:rows], w, *args, offs=local, **kwargs)
    if rows == x.shape[0]:
        return y
    return torch.cat([y, y.new_zeros((x.shape[0] - rows, *y.shape[1:]))])


def _sizes(n: int, group, size: int, device) -> list[int]:
    """Every rank's row count (a tiny all-gather): DP ranks may hold unequal batches."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(size, dtype=torch.int64, device=device)
    all_gather_single(out, mine, group=group)
    return [int(v) for v in out.tolist()]


def _gather(x: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """Every rank's ``x`` (rows ``sizes[r]``), padded to the longest for one all-gather."""
    m = max(sizes)
    pad = x.new_zeros((m, *x.shape[1:]))
    pad[:x.shape[0]] = x
    out = x.new_empty((len(sizes) * m, *x.shape[1:]))
    all_gather_single(out, pad.contiguous(), group=group)
    return [c[:s] for c, s in zip(out.chunk(len(sizes)), sizes)]


def _scatter(parts: list[torch.Tensor], index: int, group) -> torch.Tensor:
    """Sum over ranks of ``parts[index]`` of every rank (``parts[r]``: rows for rank ``r``)."""
    m = max(p.shape[0] for p in parts)
    stack = parts[0].new_zeros((len(parts) * m, *parts[0].shape[1:]))
    for r, p in enumerate(parts):
        stack[r * m:r * m + p.shape[0]] = p
    out = stack.new_empty((m, *stack.shape[1:]))
    reduce_scatter_single(out, stack, group=group)
    return out[:parts[index].shape[0]]


class _GatherTokens(torch.autograd.Function):
    """Forward: every EP rank's rows; backward: each rank's gradients summed back to their owner."""

    @staticmethod
    def forward(ctx, x, sizes, index, group):
        ctx.sizes, ctx.index, ctx.group, ctx.like = sizes, index, group, x.new_empty((0, *x.shape[1:]))
        return tuple(_gather(x, sizes, group))

    @staticmethod
    def backward(ctx, *grads):
        grads = [ctx.like.new_zeros((s, *ctx.like.shape[1:])) if g is None else g for g, s in zip(grads, ctx.sizes)]
        return _scatter([g.contiguous() for g in grads], ctx.index, ctx.group), None, None, None


class _ScatterTokens(torch.autograd.Function):
    """Forward: the sum over EP ranks of the rows each computed for this rank; backward: gather."""

    @staticmethod
    def forward(ctx, index, group, *parts):
        ctx.sizes, ctx.index, ctx.group = [p.shape[0] for p in parts], index, group
        return _scatter([p.contiguous() for p in parts], index, group)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *_gather(grad.contiguous(), ctx.sizes, ctx.group))


class ExpertParallel(nn.Module):
    """One experts block under expert parallelism (see the module docstring).

    ``block``: the block's GraphModule; ``num_experts``: ``E``; ``ep_ranks`` / ``ep_index``: this
    rank's EP group and its place there; ``tp_key`` / ``tp`` / ``tp_index``: the layer's TP group
    (a :mod:`.tp_ops` key) when ``tp > 1``; ``group``: the EP process group (None: one rank).
    """

    def __init__(self, block: torch.fx.GraphModule, num_experts: int, ep_ranks: tuple[int, ...], ep_index: int,
                 group, dispatch: str = "allgather", tp: int = 1, tp_index: int = 0, tp_key: str | None = None):
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        self.block = block
        self.num_experts, self.ep, self.ep_index = int(num_experts), len(ep_ranks), int(ep_index)
        self.ep_ranks, self.group, self.dispatch = tuple(ep_ranks), group, dispatch
        self.tp, self.tp_index, self.tp_key = int(tp), int(tp_index), tp_key
        self.local_experts = self.num_experts // self.ep
        self.first_expert = self.ep_index * self.local_experts

    def extra_repr(self) -> str:
        return (f"experts [{self.first_expert}, {self.first_expert + self.local_experts}) of {self.num_experts}, "
                f"ep={self.ep} (ranks {list(self.ep_ranks)}), dispatch={self.dispatch}, tp={self.tp}")

    def _mine(self, ids: torch.Tensor, tp_split: bool) -> torch.Tensor:
        """``ids`` of this rank's experts renumbered from 0, every other id the sentinel ``E``; with
        ``tp_split`` only the rows of this TP rank's chunk keep theirs."""
        lo = self.first_expert
        keep = (ids >= lo) & (ids < lo + self.local_experts)
        if tp_split:
            start, length = chunk_bounds(ids.shape[0], self.tp, self.tp_index)
            rows = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
            rows[start:start + length] = True
            keep &= rows.unsqueeze(-1)
        return torch.where(keep, ids - lo, torch.full_like(ids, self.num_experts))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, *rest):
        tp_split = self.tp > 1
        if tp_split:
            x, weights = tp_copy_to_region(x, self.tp_key), tp_copy_to_region(weights, self.tp_key)
        if _is_fake(x) or self.ep == 1:
            y = self.block(x, self._mine(index, tp_split), weights, *rest)
        elif self.dispatch == "allgather":
            y = self._allgather(x, index, weights, rest, tp_split)
        else:
            y = self._alltoall(x, index, weights, rest, tp_split)
        return tp_reduce_from_region(y, self.tp_key) if tp_split else y

    def _allgather(self, x, index, weights, rest, tp_split):
        sizes = _sizes(x.shape[0], self.group, self.ep, x.device)
        xs = _GatherTokens.apply(x, sizes, self.ep_index, self.group)
        ws = _GatherTokens.apply(weights, sizes, self.ep_index, self.group)
        with torch.no_grad():
            ids = _gather(index, sizes, self.group)
        outs = [self.block(xj, self._mine(ij, tp_split), wj, *rest) for xj, ij, wj in zip(xs, ids, ws)]
        return _ScatterTokens.apply(self.ep_index, self.group, *outs)

    def _alltoall(self, x, index, weights, rest, tp_split):
        raise NotImplementedError("alltoall dispatch")


def ep_rank_info(ranks: tuple[int, ...], rank: int) -> tuple[int, object]:
    """``(index of rank in ranks, process group)`` of an EP group."""
    from .groups import group

    return ranks.index(rank), group(ranks) if dist.is_initialized() else None
