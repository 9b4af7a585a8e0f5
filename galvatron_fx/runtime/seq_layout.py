"""Context parallelism's sequence layout and the pieces its two attention kinds share: which
positions each CP rank holds (the load-balanced zig-zag of :mod:`.context_parallel`), which (query
chunk, key chunk) pairs causal attention visits, one ring step between CP ranks, and grouped key /
value heads repeated and folded back. :mod:`.context_parallel` (the reshards, Ulysses) and
:mod:`.ring_attention` both read it; neither imports the other at module level.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .groups import Ranks, group


# ------------------------------------------------------------------------------------ layout
@functools.lru_cache(maxsize=256)
def _chunks(seq: int, cp: int, index: int) -> tuple[tuple[int, int, int], ...]:
    """The layout: ``(start, length, offset)`` of each chunk CP rank ``index`` of ``cp`` holds, its
    global start, its length, and where it begins among the rank's rows."""
    if cp < 1 or not 0 <= index < cp:
        raise ValueError(f"CP index {index} out of range for cp={cp}")
    if seq % (2 * cp) == 0:
        c, chunks = seq // (2 * cp), (index, 2 * cp - 1 - index)
    elif seq % cp == 0:
        c, chunks = seq // cp, (index,)
    else:
        raise ValueError(f"a sequence of {seq} positions cannot be split over cp={cp} ranks: its length "
                         f"must be a multiple of cp ({cp}), best of 2 * cp ({2 * cp}, the load-balanced "
                         "layout); pad the sequence or choose a cp dividing it")
    return tuple((ch * c, c, i * c) for i, ch in enumerate(chunks))


@functools.lru_cache(maxsize=256)
def seq_positions(seq: int, cp: int, index: int) -> tuple[int, ...]:
    """The global sequence positions CP rank ``index`` of ``cp`` holds, in its order (a cached
    tuple of ``seq / cp`` ints; the layout of :mod:`.context_parallel`'s docstring)."""
    return tuple(p for a, n, _ in _chunks(seq, cp, index) for p in range(a, a + n))


# ------------------------------------------------------------------------------- ring step
class _Shift:
    """One ring step, started at construction: send ``tensors`` to the next rank of ``ranks``,
    receive the previous rank's into buffers alike; :meth:`wait` returns them."""

    def __init__(self, tensors: list[torch.Tensor], ranks: Ranks, index: int):
        cp, g = len(ranks), group(ranks)
        self.sent = [t.contiguous() for t in tensors]      # alive until the sends complete
        self.bufs = [torch.empty_like(t) for t in self.sent]
        nxt, prv = ranks[(index + 1) % cp], ranks[(index - 1) % cp]
        ops = [dist.P2POp(dist.isend, t, nxt, g) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, b, prv, g) for b in self.bufs]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.bufs


# --------------------------------------------------------------------- grouped heads
def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key / value heads repeated for the query heads they serve (SDPA's ``enable_gqa``)."""
    return t.repeat_interleave(groups, dim=-3) if groups > 1 else t


def _fold(g: torch.Tensor, groups: int, shape: torch.Size) -> torch.Tensor:
    """The adjoint of :func:`_expand` and of broadcasting: ``g`` summed down to ``shape``."""
    if groups > 1:
        g = g.unflatten(-3, (-1, groups)).sum(-3)
    return g.sum_to_size(shape)


# ------------------------------------------------------------------------------------- ring
def _causal_skip(qc, kc) -> bool:
    """Under a causal mask: every key of chunk ``kc`` comes after every query of chunk ``qc``."""
    return kc[0] > qc[0] + qc[1] - 1


def _spans(chunks) -> list[tuple[int, int]]:
    """``(offset, length)`` of the row spans made by ``chunks`` (adjacent ones merged)."""
    spans: list[list[int]] = []
    for _, n, off in sorted(chunks, key=lambda c: c[2]):
        if spans and spans[-1][0] + spans[-1][1] == off:
            spans[-1][1] += n
        else:
            spans.append([off, n])
    return [tuple(s) for s in spans]


def ring_block_pairs(seq: int, cp: int, index: int, causal: bool) -> int:
    """How many (local query chunk, key chunk) pairs rank ``index`` computes in ring attention over
    all ``cp`` sources, no explicit mask: ``4 cp`` (``cp`` when contiguous); causal: ``2 cp + 1`` on
    every rank in the zig-zag layout (``index + 1`` when contiguous)."""
    return sum(not (causal and _causal_skip(a, b))
               for src in range(cp) for a in _chunks(seq, cp, index) for b in _chunks(seq, cp, src))
