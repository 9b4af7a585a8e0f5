"""Context parallelism (CP): a layer's activations split along the sequence over ``cp`` ranks.

Layout (:func:`seq_positions`, the only one every function here uses): a sequence of ``S``
positions is cut into ``2 * cp`` equal chunks and CP rank ``i`` holds chunk ``i`` followed by chunk
``2 * cp - 1 - i`` (the zig-zag of Megatron / torch's context parallelism: under a causal mask every
rank then has the same attention work, :func:`ring_block_pairs`). When ``S`` is a multiple of ``cp``
but not of ``2 * cp``, rank ``i`` holds the contiguous chunk ``i`` (correct, not balanced). A rank
holds its positions in that order, ``s = S / cp`` rows. A dim may carry the sequence *inside* a
flattened dim (labels ``[B * S]``): it is viewed as ``[pre, S, post]`` and each of the ``pre * post``
lines is split alike.

``ranks`` is the CP group's global ranks in ascending order (the group's rank order) and ``index``
this rank's position there; groups come from :func:`.groups.group`.

=====================  =========================================  ================================
function               forward                                    backward
=====================  =========================================  ================================
``local_seq(_of)``     this rank's positions of a whole value     the gradient scattered into zeros
                       (no communication)                         (plain autograd)
``gather_seq(_of)``    all-gather the shards, natural order       reduce-scatter: each rank's
                       (inside a layer)                           gradient is partial (its queries)
``boundary_take``      this rank's positions (layer boundary)     all-gather the gradient pieces
``boundary_gather``    all-gather, natural order (boundary)       keep this rank's positions
``cp_attention``       SDPA on the global sequence, this rank's   gradients of q, k, v, the k / v
                       queries (``"ring"`` or ``"ulysses"``)      ones back to the ranks owning them
=====================  =========================================  ================================

The boundary pair follows :mod:`.reshard`'s invariant (after backward a rank holds the *true*
gradient of what it holds), so neither sums; ``gather_seq`` is used where every CP rank consumes the
whole value for its own queries only, so the true gradient is the sum over the CP ranks.

``cp_attention(kind="ring")`` (:mod:`.ring_attention`): the k / v shards travel around the ring
(``cp - 1`` shifts, each overlapped with the current source's work). Each (query span, key span)
block runs one fused SDPA kernel that returns its log-sum-exp (torch's CPU flash kernel; on CUDA
flash or memory-efficient attention; an eager kernel over row tiles where torch would run its
math backend), and blocks merge exactly by their log-sum-exps in fp32. Under ``is_causal`` a
zig-zag chunk pair is wholly visible, skipped, or on the diagonal (the kernel's ``is_causal``).
An explicit mask's slice goes to the kernel with each block, and a mask *and* ``is_causal`` are
both applied. Backward runs each block's kernel backward with the global output and log-sum-exp,
circulates k / v once more, and sends the k / v gradient of each source home with it (``cp``
shifts). No ``[s, S]`` score matrix exists; memory is linear in ``s``.

``cp_attention(kind="ulysses")``: all-to-all turns the sequence shard ``[..., H, s, D]`` into a head
shard ``[..., H / cp, S, D]`` (natural order), SDPA runs there with the whole mask (its head dim cut
to those heads) and ``is_causal`` as given, and all-to-all turns the output back; each all-to-all's
backward is the reverse all-to-all. Key / value heads not divisible by ``cp`` are repeated to ``H``.

Exact up to float rounding: SDPA's formula on the whole sequence, dropout excepted (its RNG cannot
be reproduced over shards: ``dropout_p`` must be 0). Both kinds run the fused kernel single-device
SDPA would pick, so they share its rounding, and on CPU they share its flaw where a row's only
keys carry HF's ``finfo.min`` (see :mod:`.ring_attention`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .groups import Ranks, all_gather_single, group, reduce_scatter_single
from .seq_layout import _chunks, _expand, ring_block_pairs, seq_positions  # noqa: F401  (ring_block_pairs: public here)
from .tp_ops import _is_fake
from .vocab_parallel import SHARD_ATTR, shard_of

__all__ = ["KINDS", "seq_positions", "ring_block_pairs", "local_seq", "gather_seq", "local_seq_of", "gather_seq_of",
           "boundary_take", "boundary_gather", "cp_attention"]

KINDS = ("ring", "ulysses")

_NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------ layout
@functools.lru_cache(maxsize=64)
def _pieces(seq: int, cp: int) -> tuple[tuple[int, int, int], ...]:
    """``(rank, offset, length)`` of every chunk of every rank in natural (global) order."""
    return tuple((r, off, n) for _, r, off, n in
                 sorted((a, r, off, n) for r in range(cp) for a, n, off in _chunks(seq, cp, r)))


def _cp(ranks: Ranks, index: int) -> int:
    """``len(ranks)``, after checking ``index`` and that ``ranks`` are in the group's order."""
    if list(ranks) != sorted(ranks) or not 0 <= index < len(ranks):
        raise ValueError(f"CP ranks must be ascending global ranks with 0 <= index < cp, got {ranks}, {index}")
    return len(ranks)


def _seq_view(x: torch.Tensor, d: int, pre: int, post: int) -> torch.Tensor:
    """``x`` with dim ``d`` viewed as ``[pre, S, post]`` (the sequence is then dim ``d + 1``)."""
    n = x.shape[d]
    if n % (pre * post):
        raise ValueError(f"dim {d} of size {n} is not pre * S * post with pre={pre}, post={post}")
    return x.unflatten(d, (pre, n // (pre * post), post))


def _cat(pieces: list[torch.Tensor], d: int) -> torch.Tensor:
    """``pieces`` (``[..., pre, n_i, post, ...]`` at dim ``d``) concatenated along the sequence, dims
    ``d .. d + 2`` flattened: a contiguous copy, and not a view where no gradient is recorded (an
    autograd Function's output that is a view could not be modified in place downstream)."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in pieces):
        return torch.cat(pieces, d + 1).flatten(d, d + 2)
    shape = list(pieces[0].shape)
    shape[d + 1] = sum(p.shape[d + 1] for p in pieces)
    out = pieces[0].new_empty((*shape[:d], math.prod(shape[d:d + 3]), *shape[d + 3:]))
    torch.cat(pieces, d + 1, out=out.view(shape))
    return out


def _shard(x: torch.Tensor, d: int, cp: int, index: int, pre: int = 1, post: int = 1) -> torch.Tensor:
    """Rank ``index``'s positions of the whole value ``x`` along dim ``d`` (a contiguous copy)."""
    v = _seq_view(x, d, pre, post)
    return _cat([v.narrow(d + 1, a, n) for a, n, _ in _chunks(v.shape[d + 1], cp, index)], d)


def _split(x: torch.Tensor, d: int, cp: int, pre: int = 1, post: int = 1) -> torch.Tensor:
    """``[cp, *shard]``: every rank's :func:`_shard` of the whole value ``x``."""
    return torch.stack([_shard(x, d, cp, r, pre, post) for r in range(cp)])


def _join(parts: torch.Tensor, d: int, pre: int = 1, post: int = 1) -> torch.Tensor:
    """The whole value in natural order from ``parts`` ``[cp, *shard]`` (rank ``r``'s shard at
    ``parts[r]``; ``d`` is the shard's dim): the inverse of :func:`_split`."""
    cp = parts.shape[0]
    v = _seq_view(parts, d + 1, pre, post)
    return _cat([v[r].narrow(d + 1, off, n) for r, off, n in _pieces(v.shape[d + 2] * cp, cp)], d)


# ------------------------------------------------------------------------------ collectives
# Each on ``[cp, ...]`` stacks in CP-index order; on fake / meta tensors only the shape is computed.
def _all_gather_stack(x: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """``[cp, *x.shape]``: ``x`` of every rank of ``ranks``."""
    out = x.new_empty((len(ranks), *x.shape))
    if not _is_fake(x):
        all_gather_single(out.view(-1), x.contiguous().view(-1), group=group(ranks))
    return out


def _reduce_scatter_stack(stack: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """``stack[index]`` summed over the ranks of ``ranks`` (``stack``: ``[cp, ...]``)."""
    out = stack.new_empty(stack.shape[1:])
    if not _is_fake(stack):
        reduce_scatter_single(out.view(-1), stack.contiguous().view(-1), group=group(ranks))
    return out


def _all_to_all_stack(stack: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """``out[r]`` = rank ``r``'s ``stack[index]`` (``stack``: ``[cp, ...]``, ``stack[r]`` goes to
    rank ``r``)."""
    stack = stack.contiguous()
    out = torch.empty_like(stack)
    if not _is_fake(stack):
        dist.all_to_all_single(out, stack, group=group(ranks))
    return out


# ----------------------------------------------------------------------- sequence reshards
class _GatherSeq(torch.autograd.Function):
    """All-gather the shards in natural order; backward: reduce-scatter (``reduce``) or keep this
    rank's positions of the gradient."""

    @staticmethod
    def forward(ctx, x, ranks, index, d, pre, post, reduce):
        ctx.args = ranks, index, d, pre, post, reduce
        return _join(_all_gather_stack(x, ranks), d, pre, post)

    @staticmethod
    def backward(ctx, grad):
        ranks, index, d, pre, post, reduce = ctx.args
        if reduce:
            out = _reduce_scatter_stack(_split(grad, d, len(ranks), pre, post), ranks)
        else:
            out = _shard(grad, d, len(ranks), index, pre, post)
        return out, None, None, None, None, None, None


class _TakeSeq(torch.autograd.Function):
    """This rank's positions (a copy); backward: all-gather the gradient pieces, natural order."""

    @staticmethod
    def forward(ctx, x, ranks, index, d):
        ctx.ranks, ctx.d = ranks, d
        return _shard(x, d, len(ranks), index)

    @staticmethod
    def backward(ctx, grad):
        return _join(_all_gather_stack(grad, ctx.ranks), ctx.d), None, None, None


def local_seq(x: torch.Tensor, dim: int, cp: int, index: int, pre: int = 1, post: int = 1) -> torch.Tensor:
    """CP rank ``index``'s part of a whole value ``x`` (every CP rank holds it all) along ``dim``,
    of size ``pre * S * post``: ``[..., pre * (S / cp) * post, ...]``, contiguous. No communication;
    backward scatters the gradient into zeros at the rank's positions."""
    if cp == 1:
        return x
    return _shard(x, dim % x.ndim, cp, index, pre, post)


def gather_seq(x: torch.Tensor, dim: int, ranks: Ranks, index: int, pre: int = 1, post: int = 1) -> torch.Tensor:
    """The whole value (natural order) from every CP rank's shard ``x`` along ``dim`` (size
    ``pre * s * post``). Backward: sum of the CP ranks' gradients of the whole value, this rank's
    positions kept (each rank's is partial: it used the value for its own queries only)."""
    if _cp(ranks, index) == 1:
        return x
    return _GatherSeq.apply(x, ranks, index, dim % x.ndim, pre, post, True)


def _pre(n: int, seq: int, post: int) -> int:
    """``pre`` of a dim of size ``n = pre * seq * post``."""
    if n % (seq * post):
        raise ValueError(f"a dim of size {n} does not hold a sequence of {seq} positions times post={post}")
    return n // (seq * post)


def local_seq_of(x: torch.Tensor, dim: int, seq: int, post: int, cp: int, index: int) -> torch.Tensor:
    """:func:`local_seq` with ``pre`` read from the size (the graph pass's form: the batch merged
    before the sequence is known at run time only): dim ``dim`` of ``x`` is ``pre * seq * post``."""
    return local_seq(x, dim, cp, index, _pre(x.shape[dim], seq, post), post)


def gather_seq_of(x: torch.Tensor, dim: int, seq: int, post: int, ranks: Ranks, index: int) -> torch.Tensor:
    """:func:`gather_seq` with ``pre`` read from the size: dim ``dim`` of the shard ``x`` is
    ``pre * (seq / cp) * post`` (``seq``: the whole sequence)."""
    return gather_seq(x, dim, ranks, index, _pre(x.shape[dim] * len(ranks), seq, post), post)


def boundary_take(x: torch.Tensor, ranks: Ranks, index: int, dim: int) -> torch.Tensor:
    """Layer boundary: this rank's positions (a copy) of ``x``, whole along the sequence ``dim`` on
    every rank of ``ranks``; backward all-gathers the gradient pieces (no sum)."""
    if _cp(ranks, index) == 1:
        return x
    return _TakeSeq.apply(x, ranks, index, dim % x.ndim)


def boundary_gather(x: torch.Tensor, ranks: Ranks, index: int, dim: int) -> torch.Tensor:
    """Layer boundary: the whole value (natural order) from every rank's shard ``x`` along the
    sequence ``dim``; backward keeps this rank's positions of the gradient (no sum). A graph
    output marked vocabulary-sharded (:func:`.vocab_parallel.vocab_shard_output`) keeps its mark."""
    if _cp(ranks, index) == 1:
        return x
    out = _GatherSeq.apply(x, ranks, index, dim % x.ndim, 1, 1, False)
    mark = shard_of(x)
    if mark is not None:
        setattr(out, SHARD_ATTR, mark)
    return out


# ----------------------------------------------------------------------------- attention
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, *, ranks: Ranks, index: int, kind: str = "ring") -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over the global sequence, for this rank's queries.

    ``q``: ``[..., Hq, s, D]``, ``k`` / ``v``: ``[..., Hkv, s, D(v)]``, ``s = S / cp`` rows in the
    order of :func:`seq_positions`; ``attn_mask``: None or the whole mask (bool or additive float,
    broadcastable to ``[..., Hq, S, S]``; no gradient); ``is_causal`` on global positions. Returns
    ``[..., Hq, s, Dv]`` in ``q``'s dtype. ``kind``: ``"ring"`` or ``"ulysses"`` (module docstring).
    """
    if dropout_p:
        raise ValueError(f"context-parallel attention cannot reproduce SDPA's dropout (dropout_p={dropout_p}): "
                         "set the attention dropout to 0 or use cp=1")
    if kind not in KINDS:
        raise ValueError(f"unknown context-parallel attention kind {kind!r}; one of {KINDS}")
    cp = _cp(ranks, index)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    if _is_fake(q):   # shapes only
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
    if k.shape[-2] != q.shape[-2] or v.shape[-2] != q.shape[-2]:
        raise ValueError(f"q, k, v must hold the same {q.shape[-2]} sequence rows, got {k.shape[-2]}, {v.shape[-2]}")
    seq = q.shape[-2] * cp
    seq_positions(seq, cp, index)   # the length check
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv and (hq % hkv or not (enable_gqa or hkv == 1)):
        raise ValueError(f"{hq} query heads cannot attend {hkv} key / value heads"
                         + ("" if enable_gqa else " (without enable_gqa)"))
    groups = hq // hkv   # one key / value head broadcast to every query head: a single group
    mask = None if attn_mask is None else attn_mask.detach()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if kind == "ring":
        from .ring_attention import ring_attention  # NOTE: imports this module's helpers

        return ring_attention(q, k, v, mask, is_causal, scale, groups, ranks, index)
    return _ulysses(q, k, v, mask, is_causal, scale, groups, ranks, index)


# ---------------------------------------------------------------------------------- ulysses
class _SeqHeads(torch.autograd.Function):
    """``to_heads``: ``[..., H, s, D]`` (sequence shard) -> ``[..., H / cp, S, D]`` (head shard,
    natural order), else the reverse; backward: the other direction."""

    @staticmethod
    def forward(ctx, x, ranks, to_heads):
        ctx.ranks, ctx.to_heads = ranks, to_heads
        return _seq_heads(x, ranks, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _seq_heads(grad, ctx.ranks, not ctx.to_heads), None, None


def _seq_heads(x: torch.Tensor, ranks: Ranks, to_heads: bool) -> torch.Tensor:
    cp, d = len(ranks), x.ndim - 2
    if to_heads:   # head group r goes to rank r, which places the shards it receives by position
        return _join(_all_to_all_stack(x.unflatten(-3, (cp, -1)).movedim(-4, 0), ranks), d)
    out = _all_to_all_stack(_split(x, d, cp), ranks)    # rank r's positions go to rank r
    return torch.cat(out.unbind(0), -3)                  # head group r came from rank r


def _ulysses(q, k, v, mask, causal, scale, groups, ranks, index):
    cp, hq, hkv = len(ranks), q.shape[-3], k.shape[-3]
    if hq % cp:
        raise ValueError(f"ulysses context parallelism splits the {hq} attention heads (after tensor "
                         f"parallelism) over cp={cp} ranks: use kind='ring', or a cp dividing the heads")
    if hkv != hq and hkv % cp:    # repeat the key / value heads so they split like the queries
        if hq % hkv:
            raise ValueError(f"ulysses cannot pair {hkv} key / value heads with {hq} query heads")
        k, v, groups = _expand(k, hq // hkv), _expand(v, hq // hkv), 1
    q, k, v = (_SeqHeads.apply(t, ranks, True) for t in (q, k, v))
    if mask is not None and mask.ndim >= 3 and mask.shape[-3] > 1:
        h = hq // cp
        mask = mask.narrow(-3, index * h, h)
    out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, causal, scale=scale, enable_gqa=groups > 1)
    return _SeqHeads.apply(out, ranks, False)


# ------------------------------------------------------------------------------------- ring
