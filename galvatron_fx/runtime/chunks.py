"""Geometry of sharded checkpoints: which rectangles of which *global* parameters a rank holds.

A layer's flat buffer (:mod:`.data_parallel`) is a concatenation of TP-local parameter slices; a
rank keeps a contiguous range of it (ZeRO: its 1/dp shard). A contiguous range of a row-major
n-D tensor is a union of at most ``2n - 1`` hyper-rectangles ("boxes"), each itself a contiguous
range (:func:`range_boxes`: a partial first row, whole rows, a partial last row, recursively), and a
box of a TP-local slice is a box of the global tensor once it is cut at the slice's block
boundaries (fused q/k/v are sharded per block: rank ``r`` holds chunk ``r`` of every block along
``ShardInfo.dim``; :func:`local_to_global`). So every element a rank holds is named by
``(fqn, global offsets, sizes)``: exactly the chunk metadata of ``torch.distributed.checkpoint``.

Ownership (:func:`layer_pieces` with ``owned=True``): every element of every parameter is written by
exactly one rank:

* the layer's flat buffer is split into the ``dp`` ranges a ZeRO shard would have, whatever ``sdp``
  is: rank ``dp_index`` owns range ``dp_index`` (so DP replicas also save in parallel);
* a parameter a TP layer keeps whole (a norm's weight) is owned by TP rank 0 only;
* pipeline stages hold disjoint layers.

Loading asks for what the rank *holds* instead (``owned=False``: its whole buffer under
``sdp="none"``, its shard under ZeRO, replicated parameters on every TP rank).

Pure: integers and tuples only (``torch`` just for the views of :func:`piece_view`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]   # (offsets, sizes), elements per dim


@dataclass(frozen=True)
class Piece:
    """One box of parameter ``fqn`` held by a rank: ``sizes`` elements at ``global_offsets`` of the
    whole parameter, read at ``local_offsets`` of this rank's TP-local slice (``local_shape``) that
    starts at element ``buffer_offset`` of the layer's flat buffer."""

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
    for a parameter kept whole: the box itself, at the same offsets)."""
    offsets, sizes = box
    if shard is None:
        return [(box, offsets)]
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


def layer_pieces(fqns, offsets, shapes, shards: dict, lo: int, hi: int, *, replicated: bool = True,
                 max_numel: int | None = None) -> dict[str, list[Piece]]:
    """``fqn -> [Piece]`` for the elements ``[lo, hi)`` of a layer's flat buffer.

    Args:
        fqns, offsets, shapes: the layer's parameters, their element offsets in the buffer and
            TP-local shapes (``FlatParams.fqns / offsets / shapes``).
        shards: ``fqn -> ShardInfo`` of the TP-sharded ones (the others are kept whole).
        replicated: include the parameters kept whole (``False`` on TP ranks other than 0 when
            saving: TP rank 0 owns them).
        max_numel: cut ``[lo, hi)`` into ranges of at most this many elements first, so no piece
            exceeds it (bounds the memory of one read or write to a bucket).
    Every fqn of the layer is a key (an empty list when the rank holds none of it).
    """
    out: dict[str, list[Piece]] = {fqn: [] for fqn in fqns}
    step = max_numel if max_numel and max_numel > 0 else max(hi - lo, 1)
    for fqn, off, shape in zip(fqns, offsets, shapes):
        shard = shards.get(fqn)
        if shard is None and not replicated:
            continue
        n = math.prod(shape)
        a, b = max(lo, off), min(hi, off + n)
        for x in range(a, b, step):
            for box in range_boxes(shape, x - off, min(b, x + step) - off):
                for (l_off, size), g_off in local_to_global(box, shard):
                    out[fqn].append(Piece(fqn, tuple(g_off), tuple(size), tuple(l_off), tuple(shape), off))
    return out


def piece_view(buffer: torch.Tensor, buffer_lo: int, piece: Piece) -> torch.Tensor:
    """The elements of ``piece`` as a view of ``buffer``, a tensor holding the flat-buffer elements
    from ``buffer_lo`` on (the whole buffer with 0, a ZeRO shard with its first element's index)."""
    strides, acc = [], 1
    for s in reversed(piece.local_shape):
        strides.append(acc)
        acc *= s
    strides = tuple(reversed(strides))
    start = piece.buffer_offset - buffer_lo + sum(o * s for o, s in zip(piece.local_offsets, strides))
    if start < 0 or start + _extent(piece.sizes, strides) > buffer.numel():
        raise ValueError(f"piece {piece} lies outside the buffer range starting at {buffer_lo}")
    return buffer.as_strided(piece.sizes, strides, buffer.storage_offset() + start)


def _extent(sizes, strides) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(sizes, strides)) if all(sizes) else 0
