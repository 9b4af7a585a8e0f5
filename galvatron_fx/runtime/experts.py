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

On a graph with a symbolic batch the block runs once, on just the tokens that need this rank's
experts (``compact``): its batch-derived sizes (the token count, tokens x k) are inputs, rescaled to
that count, so a rank's activations and element-wise work grow with the tokens it serves, not with
``ep``. Where the batch is baked into the block's code, it runs once per source on all its tokens
(the others sentinel rows), the sizes its own batch's. With ``tp > 1`` (no sequence parallelism)
the TP ranks hold the same tokens: TP rank ``t`` routes only its chunk of them (the others
sentinel), and the combined output is all-reduced over the TP group (Megatron's f / g around the
block), so expert weights stay whole over TP and each token is computed once. That is the
*token split* (a layer's ``extra["expert_tp"] = false``); by default (expert tensor parallelism,
:attr:`galvatron_fx.plan.LayerPlan.expert_tp`, Megatron's) the tensor-parallel pass shards each
grouped expert weight along its FFN width and leaves its collectives inside the block (``f`` before
the column-parallel grouped matmul, the all-reduce after the row-parallel one): the block is built
with ``tp = 1`` here, every TP rank dispatches and computes all its tokens on its width slice, and
the block's own all-reduce sums the partial outputs once per call.

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
    sentinels) are zero. ``x`` is cast to ``w``'s dtype (a mixed-precision working copy)."""
    op = _OPS[key]
    x = x.to(w.dtype)
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


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002
    """``torch.histc`` on any device (the normalise pass redirects every histc here): integer input
    counted as float32 (exact below 2^24). transformers counts expert ids with ``.int()`` off the CPU
    and ``.float()`` on it, a branch baked at capture: a meta-device capture then ran on the CPU,
    which has no integer histc kernel."""
    return torch.histc(x if x.is_floating_point() else x.float(), bins, min, max)


def routed_rows(cond: torch.Tensor, num_experts: int, as_tuple: bool = True):
    """``torch.nonzero(cond, as_tuple=as_tuple)``: the rows routed to one expert of a loop-form
    experts block (``torch.where(mask[e])``, the normalise pass redirects it here). Under fake
    tensors (shape propagation, the cost model's probe) its count is data-dependent: a uniform
    router's ``ceil(cond.numel() / num_experts)`` rows (the ``k`` of every token spread evenly over
    ``num_experts`` experts)."""
    if not _is_fake(cond):
        return torch.nonzero(cond, as_tuple=as_tuple)
    n = -(-cond.numel() // max(int(num_experts), 1))
    if as_tuple:
        return tuple(torch.zeros(n, dtype=torch.long, device=cond.device) for _ in range(cond.dim()))
    return torch.zeros((n, cond.dim()), dtype=torch.long, device=cond.device)


def _sizes(n: int, group, size: int, device) -> list[int]:
    """Every rank's row count (a tiny all-gather): DP ranks may hold unequal batches."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(size, dtype=torch.int64, device=device)
    all_gather_single(out, mine, group=group)
    return [int(v) for v in out.tolist()]


def _gather_padded(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """``[len(sizes) * max(sizes), ...]``: every rank's ``x`` (rows ``sizes[r]``), each padded to
    the longest, by one all-gather."""
    m = max(sizes)
    pad = x.new_zeros((m, *x.shape[1:]))
    pad[:x.shape[0]] = x
    out = x.new_empty((len(sizes) * m, *x.shape[1:]))
    all_gather_single(out, pad.contiguous(), group=group)
    return out


def _unpad(out: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [c[:s] for c, s in zip(out.chunk(len(sizes)), sizes)]


def _gather(x: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """Every rank's ``x`` (rows ``sizes[r]``)."""
    return _unpad(_gather_padded(x, sizes, group), sizes)


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
    """Forward: every EP rank's rows, padded (:func:`_gather_padded`; :func:`gather_tokens` cuts
    them, outside the Function: views made in its forward could not be modified in place);
    backward: each rank's gradients summed back to their owner."""

    @staticmethod
    def forward(ctx, x, sizes, index, group):
        ctx.sizes, ctx.index, ctx.group = sizes, index, group
        return _gather_padded(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        m = max(ctx.sizes)
        out = grad.new_empty((m, *grad.shape[1:]))
        reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out[:ctx.sizes[ctx.index]], None, None, None


def gather_tokens(x: torch.Tensor, sizes: list[int], index: int, group) -> list[torch.Tensor]:
    """Every EP rank's rows of ``x`` (autograd: gradients go back to their owner, summed)."""
    return _unpad(_GatherTokens.apply(x, sizes, index, group), sizes)


class _ScatterTokens(torch.autograd.Function):
    """Forward: the sum over EP ranks of the rows each computed for this rank; backward: gather."""

    @staticmethod
    def forward(ctx, index, group, *parts):
        ctx.sizes, ctx.index, ctx.group = [p.shape[0] for p in parts], index, group
        return _scatter([p.contiguous() for p in parts], index, group)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *_gather(grad.contiguous(), ctx.sizes, ctx.group))


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``[sum(out_splits), ...]``: ``out_splits[j]`` from EP rank ``j``, having sent it
    ``in_splits[j]`` rows of ``x`` (uneven splits; gloo and NCCL alike)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: :func:`_all_to_all`; backward: the same with the splits swapped (rows go home)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.splits, ctx.group), None, None, None


class ExpertParallel(nn.Module):
    """One experts block under expert parallelism (see the module docstring).

    ``block``: the block's GraphModule; ``num_experts``: ``E``; ``ep_ranks`` / ``ep_index``: this
    rank's EP group and its place there; ``tp_key`` / ``tp`` / ``tp_index``: the layer's TP group
    (a :mod:`.tp_ops` key) when ``tp > 1``; ``group``: the EP process group (None: one rank).
    ``sizes``: how many of the block's last inputs are batch-derived sizes, each a multiple of its
    token count ``T``; ``compact``: run the block once on just the tokens needing this rank's
    experts, those sizes rescaled to their count (a graph with a symbolic batch), else once per
    source on all its tokens (a batch baked into the block's code).
    """

    def __init__(self, block: torch.fx.GraphModule, num_experts: int, ep_ranks: tuple[int, ...], ep_index: int,
                 group, dispatch: str = "allgather", tp: int = 1, tp_index: int = 0, tp_key: str | None = None,
                 sizes: int = 0, compact: bool = False):
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        self.block = block
        self.num_experts, self.ep, self.ep_index = int(num_experts), len(ep_ranks), int(ep_index)
        self.ep_ranks, self.group, self.dispatch = tuple(ep_ranks), group, dispatch
        self.tp, self.tp_index, self.tp_key = int(tp), int(tp_index), tp_key
        self.local_experts = self.num_experts // self.ep
        self.first_expert = self.ep_index * self.local_experts
        self.sizes, self.compact = int(sizes), bool(compact)

    def extra_repr(self) -> str:
        return (f"experts [{self.first_expert}, {self.first_expert + self.local_experts}) of {self.num_experts}, "
                f"ep={self.ep} (ranks {list(self.ep_ranks)}), dispatch={self.dispatch}, tp={self.tp}")

    def _mine(self, ids: torch.Tensor, tp_split: bool) -> torch.Tensor:
        """``ids`` of this rank's experts renumbered from 0, every other id the sentinel ``E``; with
        ``tp_split`` only the rows of this TP rank's chunk keep theirs."""
        lo = self.first_expert
        keep = (ids >= lo) & (ids < lo + self.local_experts)
        if tp_split:
            keep &= self._tp_rows(ids).unsqueeze(-1)
        return torch.where(keep, ids - lo, torch.full_like(ids, self.num_experts))

    def _tp_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` bools: the rows of this TP rank's chunk of the ``T`` tokens (:func:`chunk_bounds`)."""
        start, length = chunk_bounds(ids.shape[0], self.tp, self.tp_index)
        rows = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        rows[start:start + length] = True
        return rows

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

    def _compacted(self, x, ids, weights, rest, tokens: int):
        """The block on ``x`` rows (any count ``n``) whose ``ids`` are already this rank's: its
        batch-derived sizes (multiples of ``tokens``, this rank's own token count) scaled to ``n``."""
        n, cut = x.shape[0], len(rest) - self.sizes
        sizes = [s * n // tokens if s % tokens == 0 else None for s in rest[cut:]]
        if None in sizes:
            raise RuntimeError(f"internal: an experts block size {list(rest[cut:])} is not a multiple of its "
                               f"{tokens} tokens")
        return self.block(x, ids, weights, *rest[:cut], *sizes)

    def _allgather(self, x, index, weights, rest, tp_split):
        sizes = _sizes(x.shape[0], self.group, self.ep, x.device)
        xs = gather_tokens(x, sizes, self.ep_index, self.group)
        ws = gather_tokens(weights, sizes, self.ep_index, self.group)
        with torch.no_grad():
            ids = [self._mine(ij, tp_split) for ij in _gather(index, sizes, self.group)]
        if not self.compact:
            outs = [self.block(xj, ij, wj, *rest) for xj, ij, wj in zip(xs, ids, ws)]
            return _ScatterTokens.apply(self.ep_index, self.group, *outs)
        rows = [(ij < self.num_experts).any(1).nonzero().squeeze(1) for ij in ids]   # tokens needing me
        y = self._compacted(torch.cat([xj[r] for xj, r in zip(xs, rows)]), torch.cat([ij[r] for ij, r in zip(ids, rows)]),
                            torch.cat([wj[r] for wj, r in zip(ws, rows)]), rest, x.shape[0])
        outs = [y.new_zeros((s, *y.shape[1:])).index_copy(0, r, yj)
                for s, r, yj in zip(sizes, rows, y.split([len(r) for r in rows]))]
        return _ScatterTokens.apply(self.ep_index, self.group, *outs)

    def _alltoall(self, x, index, weights, rest, tp_split):
        """Send each EP rank only the rows (of ``x`` [T, H], ``weights`` / ``index`` [T, k]) with an
        id of its experts (with ``tp_split``: of this TP rank's chunk), run the block on the received
        rows (``compact``; else per source on its ``T_j`` rows rebuilt around them, others sentinel),
        send the received rows' outputs back and sum them into ``y`` [T, H]."""
        T, k = index.shape
        owner = index // self.local_experts                                        # sentinel E -> ep
        hit = (owner.unsqueeze(-1) == torch.arange(self.ep, device=index.device)).any(1)   # [T, ep]
        if tp_split:
            hit &= self._tp_rows(index).unsqueeze(-1)
        dest, pos = hit.t().nonzero(as_tuple=True)                 # rows by destination, then position
        per_dest = torch.bincount(dest, minlength=self.ep)
        with torch.no_grad():   # per source: (rows it sends here, its T)
            counts = _all_to_all(torch.stack([per_dest, torch.full_like(per_dest, T)], 1), [1] * self.ep,
                                 [1] * self.ep, self.group).tolist()
        send, recv = per_dest.tolist(), [c[0] for c in counts]
        xr = _AllToAll.apply(x[pos], recv, send, self.group)
        wr = _AllToAll.apply(weights[pos], recv, send, self.group)
        with torch.no_grad():
            meta = _all_to_all(torch.cat([index[pos], pos.unsqueeze(-1)], 1), recv, send, self.group)
        if self.compact:
            y = self._compacted(xr, self._mine(meta[:, :k], False), wr, rest, T)
            back = _AllToAll.apply(y, send, recv, self.group)
            return back.new_zeros((T, *back.shape[1:])).index_add(0, pos, back)
        outs = []
        for xj, wj, mj, (_, tj) in zip(xr.split(recv), wr.split(recv), meta.split(recv), counts):
            ij, pj = mj[:, :k], mj[:, k]
            ids = torch.full((tj, k), self.num_experts, dtype=ij.dtype, device=ij.device).index_copy(0, pj, ij)
            yj = self.block(xj.new_zeros((tj, *xj.shape[1:])).index_copy(0, pj, xj), self._mine(ids, False),
                            wj.new_zeros((tj, k)).index_copy(0, pj, wj), *rest)
            outs.append(yj[pj])
        back = _AllToAll.apply(torch.cat(outs), send, recv, self.group)
        return back.new_zeros((T, *back.shape[1:])).index_add(0, pos, back)

