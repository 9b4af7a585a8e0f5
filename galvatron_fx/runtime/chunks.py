"""Geometry of sharded checkpoints: which rectangles of which *global* parameters a rank holds.

A layer's flat buffer (:mod:`.data_parallel`) holds TP-local parameter slices; a rank keeps, of each
of them, a contiguous range of elements: the whole slice, or under ZeRO its dim-0 rows
``[r * R, (r + 1) * R)`` (:class:`~.zero_layout.ZeroLayout`), which is one box. A contiguous range
of a row-major n-D tensor is in general a union of at most ``2n - 1`` hyper-rectangles ("boxes"),
each itself a contiguous range (:func:`range_boxes`: a partial first row, whole rows, a partial last
row, recursively; a range of whole rows is one box), and a box of a TP-local slice is a box of the
global tensor once it is cut at the slice's block boundaries (fused q/k/v are sharded per block:
rank ``r`` holds chunk ``r`` of every block along ``ShardInfo.dim``; :func:`local_to_global`). So
every element a rank holds is named by ``(fqn, global offsets, sizes)``: exactly the chunk
metadata of ``torch.distributed.checkpoint``.

Ownership (what a save writes, :meth:`~.params.ParamSpec.pieces`): every element of every
parameter is written by exactly one rank:

* each TP-local slice is split into the ``dp`` dim-0 slices a ZeRO shard would hold, whatever
  ``sdp`` is: rank ``dp_index`` owns slice ``dp_index`` (so DP replicas also save in parallel);
* a parameter a TP layer keeps whole (a norm's weight) is owned by TP rank 0 only;
* pipeline stages hold disjoint layers.

Loading asks for what the rank *holds* instead (its whole buffer under ``sdp="none"``, its shard
under ZeRO, replicated parameters on every TP rank).

Pure: integers and tuples only (``torch`` just for the views of :func:`piece_view`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]   # (offsets, sizes), elements per dim


@dataclass(frozen=True)
class Piece:
    """One box of parameter ``fqn`` held by a rank: ``sizes`` elements at ``global_offsets`` of the
    whole parameter, read at ``local_offsets`` of this rank's TP-local slice (``local_shape``),
    whose element 0 sits (or would sit: a ZeRO shard starts inside the slice) at element
    ``buffer_offset`` of the buffer holding it."""

    fqn: str
    global_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    buffer_offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The flat element range ``[lo, hi)`` of a row-major tensor of ``shape`` as at most
    ``2 * len(shape) - 1`` boxes, in memory order; each box is a contiguous range itself."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    if row == 0:
        return []
    a, b = lo // row, hi // row
    rest = shape[1:]

    def within(i: int, x: int, y: int) -> list[Box]:
        return [((i, *o), (1, *s)) for o, s in range_boxes(rest, x, y)]

    if a == b:
        return within(a, lo - a * row, hi - a * row)
    out: list[Box] = []
    if lo % row:
        out += within(a, lo % row, row)
        a += 1
    if b > a:
        out.append(((a, *(0,) * len(rest)), (b - a, *rest)))
    if hi % row:
        out += within(b, 0, hi % row)
    return out


def local_to_global(box: Box, shard) -> list[tuple[Box, tuple[int, ...]]]:
    """A box of TP rank ``shard.rank``'s slice -> ``[(local sub-box, its global offsets)]``: the box
    cut at the slice's block boundaries along ``shard.dim`` (``shard`` a ``ShardInfo``; ``None``
    for a parameter kept whole: the box itself, at the same offsets; a nested one: cut by its inner
    split first, then by the outer one)."""
    offsets, sizes = box
    if shard is None:
        return [(box, offsets)]
    if getattr(shard, "inner", None) is not None:   # local -> the outer chunk -> global
        out = []
        for (l_off, l_size), mid in local_to_global(box, shard.inner):
            for (m_off, m_size), g in local_to_global((mid, l_size), _outer(shard)):
                out.append(((tuple(lo + m - c for lo, m, c in zip(l_off, m_off, mid)), m_size), g))
        return out
    d = shard.dim
    out = []
    local_start, global_start = 0, 0
    lo, hi = offsets[d], offsets[d] + sizes[d]
    for block in shard.blocks:
        n = block // shard.tp
        x, y = max(lo, local_start), min(hi, local_start + n)
        if x < y:
            sub_off = offsets[:d] + (x,) + offsets[d + 1:]
            sub_size = sizes[:d] + (y - x,) + sizes[d + 1:]
            g = global_start + shard.rank * n + (x - local_start)
            out.append(((sub_off, sub_size), offsets[:d] + (g,) + offsets[d + 1:]))
        local_start += n
        global_start += block
    return out


def _outer(shard):
    """A nested ``ShardInfo`` without its inner split."""
    return replace(shard, inner=None)


def layer_pieces(fqns, shapes, spans, shards: dict, *, replicated: bool = True,
                 max_numel: int | None = None) -> dict[str, list[Piece]]:
    """``fqn -> [Piece]`` for the elements a rank holds of each parameter of a layer.

    Args:
        fqns, shapes: the layer's parameters and their TP-local shapes (``FlatParams.fqns / shapes``).
        spans: per parameter ``(lo, hi, origin)``: its elements ``[lo, hi)`` (row-major, of the
            TP-local slice) that the rank holds, and the buffer index of the slice's element 0
            (``lo`` then sits at ``origin + lo``; see :class:`Piece`).
        shards: ``fqn -> ShardInfo`` of the TP-sharded ones (the others are kept whole).
        replicated: include the parameters kept whole (``False`` on TP ranks other than 0 when
            saving: TP rank 0 owns them).
        max_numel: cut each range into pieces of at most this many elements (whole rows when a
            row fits), bounding the memory of one read or write to a bucket.
    Every fqn of the layer is a key (an empty list when the rank holds none of it).
    """
    out: dict[str, list[Piece]] = {fqn: [] for fqn in fqns}
    for fqn, shape, (lo, hi, origin) in zip(fqns, shapes, spans):
        shard = shards.get(fqn)
        if (shard is None and not replicated) or lo >= hi:
            continue
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        step = hi - lo
        if max_numel and max_numel > 0 and max_numel < step:
            step = max_numel // row * row if row <= max_numel else max_numel
        for x in range(lo, hi, step):
            for box in range_boxes(shape, x, min(hi, x + step)):
                for (l_off, size), g_off in local_to_global(box, shard):
                    out[fqn].append(Piece(fqn, tuple(g_off), tuple(size), tuple(l_off), tuple(shape), origin))
    return out


def piece_view(buffer: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The elements of ``piece`` as a view of ``buffer``, the buffer holding them (a whole flat
    buffer, a ZeRO shard, an optimizer state laid out alike)."""
    strides, acc = [], 1
    for s in reversed(piece.local_shape):
        strides.append(acc)
        acc *= s
    strides = tuple(reversed(strides))
    start = piece.buffer_offset + sum(o * s for o, s in zip(piece.local_offsets, strides))
    if start < 0 or start + _extent(piece.sizes, strides) > buffer.numel():
        raise ValueError(f"piece {piece} lies outside the buffer of {buffer.numel()} elements")
    return buffer.as_strided(piece.sizes, strides, buffer.storage_offset() + start)


def _extent(sizes, strides) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(sizes, strides)) if all(sizes) else 0
