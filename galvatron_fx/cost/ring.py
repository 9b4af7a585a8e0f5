"""Ring attention's work on one rank, as :mod:`galvatron_fx.runtime.ring_attention` runs it: its kernel
calls (the runtime's own block plan), the element-wise bytes of the log-sum-exp merge and the fp32
accumulators, its launches and its transient buffers. :mod:`.context` prices them (seconds, memory)
beside Ulysses and the exchanges.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..solver.strategy import Strategy

if TYPE_CHECKING:
    from .context import LayerAttention

# Launches (ops that run a kernel or allocate; views not counted) of the runtime's ring attention,
# counted from :mod:`galvatron_fx.runtime.ring_attention` on its CPU / flash path (a TorchDispatchMode
# over it agrees: tests/test_context_parallel_ops_dist.py). Backward ones run inside its autograd
# Function: no autograd node of their own.
RING_BLOCK_OPS = {"fwd": 9, "bwd": 4}
"""Per block (kernel call) and pass: forward the kernel and the merge's 8 element-wise ops (the
LSE difference, its NaN guard, the sigmoid weight, the output's difference, scale and add, the new
LSE and its copy); backward the kernel and the q / k / v gradients' adds."""
RING_ROWS_OPS = 1
"""Per backward block whose query rows are not all the rank's: its LSE rows made contiguous."""
RING_MASK_OPS = {"fwd": 16, "bwd": 3}
"""Per block and pass with an explicit (bool) mask: forward the plan's scan of the block's mask
slice (row maximum, live / saturated rows, their ``any`` / ``all`` and the host sync; more on a
causal tile's square) and the slice converted to an additive bias (3); backward the conversion."""
RING_GQA_OPS = {"fwd": 2, "bwd": 4}
"""Per block and pass where a kernel needs the query heads (the memory-efficient kernel: a mask on
CUDA): the key / value repeats, backward also their gradients' folds."""
RING_CAST_OPS = {"fwd": 1, "bwd": 3}
"""Per call when the operands are not fp32: the output cast (forward), q / k / v gradients (backward)."""
RING_SHIFT_OPS = 2
"""Per shift: the two receive buffers (the sends themselves are priced as calls: :func:`ring_shift_time`)."""
RING_CALL_OPS = {"fwd": 2, "bwd": 5}
"""Per attention call and pass: the fp32 output and LSE (forward); the LSE's ``+inf`` fill (2), the
q gradient and the first k / v gradients (backward)."""
RING_MERGE_WRITES = (3, 5)
"""Element-wise writes of one forward block's merge, per query row: ``3 dv`` fp32 (the output's
difference, scale and add) and 5 fp32 (the LSE's difference, guard, weight, new value, copy)."""


@functools.lru_cache(maxsize=1024)
def ring_blocks(seq: int, cp: int, causal: bool, masked: bool = False) -> tuple[tuple[int, int, bool], ...]:
    """``(query rows, keys, is_causal)`` of every kernel call ring attention makes on the busiest CP
    rank over all ``cp`` sources, from the runtime's own plan (:func:`~galvatron_fx.runtime.
    ring_attention.ring_plan`; with an explicit mask :func:`~galvatron_fx.runtime.ring_attention.
    ring_tiles` at its ``TILE_ROWS``, none of the mask's own skips assumed). Zig-zag under
    ``is_causal``: the own ``s x s`` shard causal, then ``cp - 1`` blocks of ``s x c`` or ``c x s``
    (``c = S / 2cp``); without: ``cp`` blocks of ``s x s``."""
    from ..runtime.ring_attention import TILE_ROWS, ring_plan, ring_tiles

    def plan(index):
        return tuple((b.q[1], b.k[1], b.causal) for src in range(cp)
                     for b in (ring_tiles(seq, cp, index, src, causal, TILE_ROWS) if masked
                               else ring_plan(seq, cp, index, src, causal)))

    def work(blocks):
        return sum(_entries(*b) for b in blocks), len(blocks), sum(r < seq // cp for r, _, _ in blocks)
    return max((plan(i) for i in range(cp)), key=work)


def _entries(rows: int, keys: int, causal: bool) -> float:
    """Score entries a kernel call computes per (sample, head): on and below the diagonal when causal."""
    return rows * (rows + 1) / 2 if causal else rows * keys


@dataclass(frozen=True)
class RingWork:
    """One rank's ring attention per micro-batch (every SDPA call of the layer): each kernel call's
    ``(forward FLOPs, keys)`` (one call's; the layer makes ``calls`` of them), the element-wise bytes
    written and launches per pass, and the largest transient buffers of a pass (bytes)."""

    blocks: tuple
    copy_bytes: dict
    ops: dict
    buffers: dict


def ring_work(att: LayerAttention, n: float, s: Strategy, itemsize: int) -> RingWork:
    """What the runtime's ring attention runs on one rank with ``n`` samples' tokens per rank (it
    holds ``b = n cp`` samples of ``s = S / cp`` positions) over :func:`ring_blocks`:

    * kernels: per block ``2 e (d + dv)`` forward FLOPs over its ``b heads / tp`` rows (``e``:
      :func:`_entries`), in the compute dtype (the runtime's kernels run in q's);
    * element-wise bytes written (fp32 merge and accumulators): per forward block
      :data:`RING_MERGE_WRITES`; per backward block the q / k / v gradients' adds (and the LSE rows
      made contiguous); per call the fp32 output / LSE and the backward's accumulators, the casts
      of non-fp32 operands; with a mask each block's bias conversion (bool -> fp32 -> dtype), with
      a mask and grouped heads the key / value repeats (the memory-efficient kernel);
    * launches: :data:`RING_BLOCK_OPS` per block (+ :data:`RING_ROWS_OPS`, :data:`RING_MASK_OPS`,
      :data:`RING_GQA_OPS`), :data:`RING_SHIFT_OPS` per shift, :data:`RING_CALL_OPS` (+
      :data:`RING_CAST_OPS`) per call;
    * buffers: forward the fp32 output and LSE, a block's output and merge temporary; backward
      the fp32 q gradient and LSE, a block's q / k / v gradients (and with a mask the step's k / v
      gradients and a bias tile). No score matrix.
    """
    rows_all = att.seq // s.cp if att.seq % s.cp == 0 else att.seq / s.cp
    if att.seq % s.cp:   # NOTE: a degree the runtime refuses (cp_refuses); priced as whole shards
        blocks = ((rows_all, rows_all, False),) * s.cp
    else:
        blocks = ring_blocks(att.seq, s.cp, att.causal, att.masked)
    b = n * s.cp
    bh, bkv = b * att.heads / s.tp, b * att.kv_heads / s.tp
    d, dv, c = att.head_dim, att.v_head_dim, att.calls
    gqa = att.masked and att.kv_heads != att.heads
    cast = itemsize != 4
    mask_rows = b if att.mask_bytes else 1   # a batched mask converts each sample's slice
    w_rows, w_row = RING_MERGE_WRITES
    fwd = bwd = 0.0
    for r, k, _causal in blocks:
        fwd += bh * r * (w_rows * dv + w_row) * 4
        bwd += bh * r * d * 4 + bkv * k * (d + dv) * 4 + bh * r * 4 * (r < rows_all)
        if att.masked:
            bias = mask_rows * r * k * (4 + itemsize * cast)
            fwd, bwd = fwd + bias, bwd + bias
        if gqa:
            fwd, bwd = fwd + bh * k * (d + dv) * itemsize, bwd + (bh + bkv) * k * (d + dv) * itemsize
    fwd += bh * rows_all * (dv + 1) * 4 + bh * rows_all * dv * itemsize * cast
    bwd += (bh * rows_all * (d * 4 + 5) + bkv * rows_all * (d + dv) * 4
            + (bh * rows_all * d + bkv * rows_all * (d + dv)) * itemsize * cast)
    shifts = {"fwd": s.cp - 1, "bwd": 2 * s.cp - 1}
    ops = {}
    for p in ("fwd", "bwd"):
        per = RING_BLOCK_OPS[p] + RING_MASK_OPS[p] * att.masked + RING_GQA_OPS[p] * gqa
        partial = sum(r < rows_all for r, _, _ in blocks) * RING_ROWS_OPS * (p == "bwd")
        ops[p] = c * (len(blocks) * per + partial + RING_SHIFT_OPS * shifts[p] + RING_CALL_OPS[p]
                      + RING_CAST_OPS[p] * cast)
    r_max = max(r for r, _, _ in blocks)
    k_max = max(k for _, k, _ in blocks)
    bias = mask_rows * r_max * k_max * itemsize if att.masked else 0.0
    kv_grads = (bh if gqa else bkv) * k_max * (d + dv) * itemsize     # a block's, at the kernel's heads
    buffers = {"fwd": bh * rows_all * (dv + 1) * 4 + bh * r_max * dv * (itemsize + 4) + bias,
               "bwd": bh * rows_all * (d + 1) * 4 + bh * r_max * d * itemsize + bias + kv_grads * (1 + gqa)
               + bkv * rows_all * (d + dv) * 4 * att.masked}
    return RingWork(tuple((bh * _entries(r, k, cz) * 2 * (d + dv), k) for r, k, cz in blocks),
                    {"fwd": c * fwd, "bwd": c * bwd}, ops, buffers)
