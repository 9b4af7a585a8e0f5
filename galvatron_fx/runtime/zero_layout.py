"""Where a layer's parameters sit in its flat buffer and in each rank's ZeRO shard.

FSDP2's per-parameter dim-0 layout (:class:`ZeroLayout`): each parameter is padded along dim 0 to a
multiple of ``dp`` rows and rank ``r`` holds rows ``[r * R, (r + 1) * R)`` of every parameter in
turn. The runtime lays its buffers out with :func:`zero_layout` (:mod:`.data_parallel`) and the cost
model prices the same (:func:`galvatron_fx.cost.memory.states_bytes`). Units: elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ZeroLayout:
    """Where each parameter of a layer sits in the full buffer and in a rank's shard (elements).

    Parameter ``i`` has ``rows[i]`` rows of ``row[i]`` elements (dim 0 of an n-D shape; a 1-D or
    0-D parameter is ``numel`` rows of one element), padded to ``dp * per_rank[i]`` rows:

    * full buffer: the parameters back to back (row-major, at ``offsets[i]``, as the layer graph
      reads them), then padding up to ``padded = dp * shard`` elements;
    * rank ``r``'s shard: parameter ``i``'s rows ``[r * per_rank[i], (r + 1) * per_rank[i])`` at
      ``shard_offsets[i]``, ``seg(i) = per_rank[i] * row[i]`` elements (zero rows past the
      parameter's end); ``shard`` elements in all.

    A ``[dp, shard]`` staging buffer (row ``r``: rank ``r``'s shard, what one all-gather gives) and
    the full buffer convert into each other with at most two copies per parameter
    (:meth:`copy_out`, :meth:`copy_in`).
    """

    dp: int
    rows: tuple[int, ...]
    row: tuple[int, ...]
    per_rank: tuple[int, ...]
    offsets: tuple[int, ...]
    shard_offsets: tuple[int, ...]
    shard: int

    @property
    def padded(self) -> int:
        return self.dp * self.shard

    def seg(self, i: int) -> int:
        """Elements of parameter ``i`` in one rank's shard (padding rows included)."""
        return self.per_rank[i] * self.row[i]

    def held(self, rank: int) -> int:
        """Elements of the parameters (padding excluded) rank ``rank`` holds in its shard: the
        size of its per-parameter optimizer states under ZeRO."""
        return sum((b - a) * w for (a, b), w in ((self.held_rows(i, rank), self.row[i])
                                                  for i in range(len(self.rows))))

    def held_rows(self, i: int, rank: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of parameter ``i`` that rank ``rank`` holds (padding excluded; may be empty)."""
        lo = min(rank * self.per_rank[i], self.rows[i])
        return lo, min(lo + self.per_rank[i], self.rows[i])

    def _columns(self, staging: torch.Tensor):
        """Per parameter ``i`` with rows: (``i``, its ``[dp, seg]`` columns of ``staging``, the ranks
        ``k`` holding ``per_rank`` whole rows, the elements of rank ``k``'s partial part)."""
        st = staging.view(self.dp, self.shard)
        for i, so in enumerate(self.shard_offsets):
            seg = self.seg(i)
            if seg == 0:
                continue
            k = self.rows[i] // self.per_rank[i]
            yield i, st[:, so:so + seg], k, (self.rows[i] - k * self.per_rank[i]) * self.row[i]

    def param_slice(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s elements of a full buffer ``full`` (1-D)."""
        return full[self.offsets[i]:self.offsets[i] + self.rows[i] * self.row[i]]

    def copy_out(self, staging: torch.Tensor, full: torch.Tensor) -> None:
        """``full`` (the whole buffer) from a ``[dp, shard]`` staging buffer of every rank's shard."""
        for i, cols, k, rem in self._columns(staging):
            dst, seg = self.param_slice(full, i), cols.shape[1]
            if k:
                dst[:k * seg].view(k, seg).copy_(cols[:k])
            if rem:
                dst[k * seg:].copy_(cols[k, :rem])

    def copy_in(self, full: torch.Tensor, staging: torch.Tensor) -> None:
        """A ``[dp, shard]`` staging buffer from ``full`` (padding rows zeroed)."""
        self.copy_in_params([self.param_slice(full, i) for i in range(len(self.rows))], staging)

    def copy_in_params(self, params, staging: torch.Tensor) -> None:
        """A ``[dp, shard]`` staging buffer from each parameter's flat elements ``params[i]``
        (``None``: zeros; padding rows zeroed), without assembling a full buffer first."""
        for i, cols, k, rem in self._columns(staging):
            src, seg = params[i], cols.shape[1]
            if src is None:
                cols.zero_()
                continue
            if k:
                cols[:k].copy_(src[:k * seg].view(k, seg))
            if k < self.dp:
                cols[k, :rem].copy_(src[k * seg:])
                cols[k, rem:].zero_()
                cols[k + 1:].zero_()

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """A copy of rank ``rank``'s shard of the full buffer ``full`` (padding rows zero)."""
        out = full.new_zeros(self.shard)
        for i, (o, so) in enumerate(zip(self.offsets, self.shard_offsets)):
            a, b = self.held_rows(i, rank)
            w = self.row[i]
            out[so:so + (b - a) * w].copy_(full[o + a * w:o + b * w])
        return out


def zero_layout(shapes, dp: int) -> ZeroLayout:
    """The :class:`ZeroLayout` of parameters of ``shapes`` (TP-local) over ``dp`` ranks; the cost
    model prices the same (:func:`galvatron_fx.cost.memory.states_bytes`)."""
    rows, row = [], []
    for shape in shapes:
        shape = tuple(shape)
        rows.append(shape[0] if len(shape) > 1 else math.prod(shape))
        row.append(math.prod(shape[1:]) if len(shape) > 1 else 1)
    per_rank = [math.ceil(r / dp) for r in rows]
    offsets, shard_offsets, n, m = [], [], 0, 0
    for r, w, pr in zip(rows, row, per_rank):
        offsets.append(m)
        shard_offsets.append(n)
        m += r * w
        n += pr * w
    return ZeroLayout(dp, tuple(rows), tuple(row), tuple(per_rank), tuple(offsets), tuple(shard_offsets), n)


def buffer_parts(layout: ZeroLayout) -> tuple[list[int], list[int]]:
    """Chunk sizes (elements) cutting a full buffer at every parameter (padding gaps are chunks of
    their own), and the chunk index of each parameter: the layer reads parameter ``i`` as chunk
    ``index[i]`` of one ``split_with_sizes(sizes)`` of its buffer."""
    sizes, index, pos = [], [0] * len(layout.offsets), 0
    for i in sorted(range(len(layout.offsets)), key=layout.offsets.__getitem__):
        if layout.offsets[i] > pos:
            sizes.append(layout.offsets[i] - pos)
        index[i] = len(sizes)
        sizes.append(layout.rows[i] * layout.row[i])
        pos = layout.offsets[i] + sizes[-1]
    if layout.padded > pos:
        sizes.append(layout.padded - pos)
    return sizes, index
