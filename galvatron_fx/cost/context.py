"""Context parallelism's costs: a layer's attention, the ring / Ulysses exchanges, the sequence gathers.

Under a strategy with ``cp > 1`` (:class:`~galvatron_fx.solver.strategy.Strategy`) groups of ``cp``
consecutive DP ranks (global ranks ``tp`` apart: the *CP group*) hold the same ``B / (dp / cp)``
samples of a micro-batch of ``B`` and split their sequence ``S`` into ``cp`` shards, as
:mod:`galvatron_fx.runtime.context_parallel` runs it. Per rank that is ``n = B / dp`` samples'
worth of tokens, exactly as ``cp = 1`` at the same ``dp``, except that ``n`` may be a fraction of
one sample (``cp = 1`` needs whole samples). So:

* **FLOPs, saved activations, TP traffic, states**: the cost model's ``cp = 1`` figures at ``n``
  samples (affine fits in ``n``, fractions welcome; the activations' constant part, sequence-long
  values shared by the batch such as rotary tables, split over ``cp`` too: :class:`SplitIntercepts`).
  Parameters are replicated over the CP ranks as over DP and gradients are reduced over the whole
  ``dp`` group: states and their communication do not depend on ``cp``.
* **Attention compute** (:func:`cp_compute_time`, added to the layer's forward / backward seconds
  in place of ``cp = 1``'s attention cores, :func:`attention_flops` at the compute rate):

  - ``ring``: the runtime computes each (query span, key span) block of its plan
    (:func:`ring_blocks`: zig-zag under ``is_causal`` skips the chunk pairs above the diagonal) as
    eager fp32 ops on every device, no fused kernel, and recomputes the blocks in backward
    (:func:`ring_work`): its matmul FLOPs at the cluster's fp32 rate, the element-wise passes over
    each block's scores (scale, mask, row max, exp, sums, the merge; backward's softmax gradient)
    and the operand casts / repeats as memory traffic at the cluster's ``copy_s_per_byte`` (a
    pass reads and writes a block as a copy does), and its launches (:data:`RING_BLOCK_OPS` per
    block, per shift, per call: :func:`cp_attention_ops`, ``op_launch_s`` each, both passes).
    A block's two fp32 score-sized tensors join the transient memory.
  - ``ulysses``: SDPA on head shards does the cores' work; the reshuffles around its all-to-alls
    copy each tensor 2-3 times (:data:`ULYSSES_SEQ_HEADS`), at ``copy_s_per_byte``, plus their
    launches.
* **Attention exchanges** (:func:`cp_attention_time`, per micro-batch, per SDPA call of the layer,
  on the CP group's link, alpha-beta as the other collectives):

  - ``ring``: forward ``cp - 1`` ring shifts of this rank's key and value shards (each
    ``b * S/cp * kv_heads/tp * head_dim`` elements, ``b = B / (dp / cp)``); backward ``cp - 1``
    shifts of the key and value shards again, each followed by a shift of the key / value
    gradients accumulated so far (fp32, as the runtime accumulates them), and a last gradient
    shift home (:func:`cp_messages`). In a shift every rank sends to the next and receives from
    the previous at once (``batch_isend_irecv``, one send / receive pair per tensor): priced as
    the two-rank all-to-all of each hop (both directions at once, as the cluster measures it), the
    slowest hop pacing the ring (a ring spanning nodes crosses the inter-node link). Priced on the
    critical path by default: the runtime starts each shift before a block's work and waits for
    it after, but its blocks run as separate eager ops (no fused kernel hiding a transfer is
    assumed); ``overlap=True`` (``CostModel(cp_overlap=True)``) prices a runtime whose shifts hide
    behind the layer's attention compute (:meth:`Cluster.overlap_time`).
  - ``ulysses``: forward four all-to-alls over the CP group (query, key, value before the
    attention core, its output after), each this rank's ``b * S/cp * heads/tp * head_dim``
    elements (key / value with the key / value heads, or the query heads when ``kv_heads / tp``
    does not divide by ``cp``: the runtime repeats them first); backward four more. Needs ``cp``
    to divide ``heads / tp``.

  Activation checkpointing repeats the forward's exchanges and compute.
* **Layout boundaries** (:func:`layout_time`): an activation leaving a ``cp`` layer for a layer
  with another ``(tp, dp, cp)`` is all-gathered along the sequence over the CP group (each rank
  gets its ``b`` samples whole: ``B * cp / dp`` samples' bytes); into a ``cp`` layer it is sliced,
  after gathering the samples the ``cp`` layer's group holds where the previous layout spread them
  over ranks (the tensor-parallel rule, :meth:`CostModel._gather_time`, with the CP group counted
  as ranks holding the same samples). Between two layers of the same ``(tp, dp, cp)`` only sequence
  parallelism can differ (priced as without CP). Backward moves the gradient the other way.

Attention is found in the captured graph (:func:`find_attention`): the layer's
``scaled_dot_product_attention`` calls, their query heads, the key / value heads SDPA receives (the
model's key / value heads when it passes them un-repeated, ``enable_gqa``; the query heads when it
repeats them before SDPA, since the runtime then ships the repeated ones), head dims, sequence and
the bytes per sample of a batched mask tensor (the ring keeps the whole mask of its samples:
``cp - 1`` more samples' worth than ``n``). Whether a layer takes ``cp > 1`` at all, and which of
its values it must gather whole, is the context-parallel pass's own analysis
(:func:`galvatron_fx.sharding.sequence.analyze_layer`, :func:`layer_sequence_terms`), so the search
never emits a layer the pass refuses; each gathered shard costs an all-gather over the CP group in
forward (whole sequence of the rank's samples) and a reduce-scatter in backward, a shard leaving
the layer whole an all-gather in forward. A layer without attention and without gathers pays only
its boundaries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx

from ..ir import META_KEY
from ..sharding.state import node_arg, op_name, tensor_val
from ..solver.strategy import Strategy
from .measure import Affine

# Launches (ops that run a kernel or allocate; views not counted) of the runtime's context-parallel
# attention, counted from :mod:`galvatron_fx.runtime.context_parallel` (a TorchDispatchMode over its
# functions agrees). All run as plain eager ops inside autograd Functions, backward ones included.
RING_BLOCK_OPS = {"fwd": 17, "bwd": 15}
"""Per ring block and pass, no mask, no GQA, fp32 operands: ``_block_forward`` (2 matmuls, scale,
row max, the merge's maximum / -inf fix / subtract / exp / decay / sum / rescales and adds, the
max copy) and ``_block_backward`` (5 matmuls, scale, subtract max, exp, divide by the sum, subtract
delta, product, scale, the three gradient adds)."""
RING_CAUSAL_OPS = 2
"""Per block and pass under ``is_causal``: the position comparison and its ``masked_fill``."""
RING_MASK_OPS = 3
"""Per block and pass with an explicit mask: its rows / columns selected, cast or inverted, applied."""
RING_GQA_OPS = {"fwd": 2, "bwd": 4}
"""Per block and pass when key / value heads are repeated for the query heads: the two repeats;
backward also the two folds of the key / value gradients."""
RING_CAST_OPS = 3
"""Per block and pass when the operands are not fp32: ``q``, ``k``, ``v`` rows cast to fp32."""
RING_SHIFT_OPS = 2
"""Per shift: the two receive buffers (the sends themselves are priced as calls: :func:`ring_shift_time`)."""
RING_CALL_OPS = {"fwd": 8, "bwd": 7}
"""Per attention call and pass: the running output / maximum / sum (forward) or the gradient
accumulators and ``delta`` (backward), and the final normalisation / casts."""
RING_SCORE_PASSES = {"fwd": 4.0, "bwd": 7.5}
"""Element-wise passes over a block's fp32 scores, in copies (read + write once; a reduction, read
only, is half; a product of two score tensors 1.5): forward scale, row max, subtract, exp, row sum;
backward scale, subtract the max, exp, divide by the sum, subtract delta, the product with the
probabilities, scale. ``is_causal`` and an explicit mask add :data:`RING_MASK_PASSES` each."""
RING_MASK_PASSES = 2.0
"""Passes per block and pass of ``is_causal`` (or of an explicit mask): its out-of-place
``masked_fill`` (or ``+ mask``) copies the scores, then fills them."""
ULYSSES_SEQ_HEADS = {"to_heads": (3, 2), "to_seq": (2, 3)}
"""One ``_seq_heads`` reshuffle: ``(launches beyond 2 per CP rank for to_seq, copies of the tensor)``:
``to_heads`` makes the send stack contiguous, allocates the output and concatenates the received
shards by position (3 launches, 2 copies); ``to_seq`` cuts each rank's positions (an allocation and
a concatenation per CP rank) and stacks them, then concatenates the received head groups (2 + 2 cp
launches, 3 copies)."""
@dataclass(frozen=True)
class LayerAttention:
    """A layer's attention as context parallelism prices it: ``calls`` SDPA calls of ``heads`` query
    heads and ``kv_heads`` key / value heads as SDPA receives them, of ``head_dim`` (``v_head_dim``
    for values) over ``seq`` query positions (``kv_seq`` key positions) at capture; ``mask_bytes``:
    bytes per sample of a batched attention-mask tensor (0 without one, or a mask shared by the
    batch); ``causal``: SDPA's ``is_causal`` (the ring then skips the chunk pairs above the
    diagonal); ``masked``: an explicit mask (whose skipped chunk pairs are unknown at planning:
    none assumed)."""

    calls: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    seq: int
    kv_seq: int
    mask_bytes: float = 0.0
    causal: bool = False
    masked: bool = False

    def refuses(self, cp: int, kind: str, tp: int) -> str:
        """Why the attention cannot run at context-parallel degree ``cp`` with ``kind`` under TP
        degree ``tp`` ("" when it can): the sequence must split into ``cp`` shards (``2 * cp``
        balances a causal mask; the runtime falls back to contiguous shards otherwise) and Ulysses
        must split the ``heads / tp`` heads of a TP rank over ``cp``."""
        if cp == 1 or not self.calls:
            return ""
        if self.seq % cp:
            return f"its sequence of {self.seq} positions does not split into cp={cp} shards"
        if kind == "ulysses" and (self.heads % tp or (self.heads // tp) % cp):
            return f"Ulysses needs cp={cp} to divide its {self.heads} heads / tp={tp}"
        return ""

    def shard_elems(self, n: float, tp: int, heads: int, head_dim: int) -> float:
        """Elements of one rank's ``[b, S/cp, heads/tp, head_dim]`` shard with ``n`` samples' tokens
        per rank (it holds ``b = n * cp`` samples of ``S / cp`` positions): ``n * S * heads / tp *
        head_dim`` (the ``cp`` cancels)."""
        return n * self.seq * heads / tp * head_dim


NO_ATTENTION = LayerAttention(0, 0, 0, 0, 0, 0, 0)


def layer_attention(gm: torch.fx.GraphModule, batch: int) -> dict[int, LayerAttention]:
    """Layer index -> its attention (:func:`find_attention`) for every layer of a captured graph
    captured with ``batch`` samples."""
    by_layer: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(gm.meta[META_KEY].layers))}
    for n in gm.graph.nodes:
        layer = getattr(n.meta.get(META_KEY), "layer", None)
        if layer is not None:
            by_layer.setdefault(layer, []).append(n)
    return {i: find_attention(nodes, batch) for i, nodes in by_layer.items()}


def find_attention(nodes: list[torch.fx.Node], batch: int) -> LayerAttention:
    """The attention of a layer made of ``nodes`` (module docstring), :data:`NO_ATTENTION` when it
    has none."""
    calls = [n for n in nodes if _is_sdpa(n)]
    heads = kv_heads = head_dim = v_dim = seq = kv_seq = 0
    mask = 0.0
    causal = masked = False
    for n in calls:
        q, k, v = (tensor_val(a) for a in n.args[:3])
        if q is None or k is None or v is None or q.dim() < 3:
            continue
        heads = max(heads, int(q.shape[-3]) if q.dim() >= 4 else 1)
        kv_heads = max(kv_heads, int(k.shape[-3]) if k.dim() >= 4 else 1)
        head_dim, seq = max(head_dim, int(q.shape[-1])), max(seq, int(q.shape[-2]))
        kv_seq, v_dim = max(kv_seq, int(k.shape[-2])), max(v_dim, int(v.shape[-1]))
        sdpa = op_name(n) == "sdpa"
        m = tensor_val(node_arg(n, 3, "attn_mask")) if sdpa else None
        masked |= m is not None
        causal |= (node_arg(n, 5, "is_causal", False) if sdpa else n.kwargs.get("is_causal", False)) is True
        if m is not None and m.dim() >= 3 and batch > 1 and int(m.shape[0]) == batch:
            mask = max(mask, m.numel() * m.element_size() / batch)
    if not heads:
        return NO_ATTENTION
    return LayerAttention(len(calls), heads, kv_heads, head_dim, v_dim, seq, kv_seq, mask, causal, masked)


def _is_sdpa(n: torch.fx.Node) -> bool:
    name = op_name(n)
    return name == "sdpa" or (name.startswith("scaled_dot_product") and "backward" not in name)


@dataclass(frozen=True)
class LayerSequenceTerms:
    """What the context-parallel pass's analysis of one layer at one ``cp`` costs (no fx nodes):
    ``refused`` (the analysis' reason, "" when it takes ``cp``), and per sample of the whole
    sequence the floating elements / other bytes of the shards it all-gathers inside the layer
    (forward all-gather, backward reduce-scatter) and of those leaving it whole (forward all-gather)."""

    refused: str = ""
    gather_elems: float = 0.0
    gather_other_bytes: float = 0.0
    out_elems: float = 0.0
    out_other_bytes: float = 0.0


def layer_sequence_terms(layer_gm: torch.fx.GraphModule, seq: int, cp: int, batch: int,
                         name: str = "layer") -> LayerSequenceTerms:
    """:class:`LayerSequenceTerms` of an extracted layer graph (:mod:`.extract`) captured with
    ``batch`` samples of ``seq`` positions, from :func:`galvatron_fx.sharding.sequence.analyze_layer`."""
    from ..sharding.sequence import Unsupported, analyze_layer

    try:
        res = analyze_layer(layer_gm, seq, cp, name)
    except Unsupported as why:
        return LayerSequenceTerms(refused=str(why) or "the sequence analysis refuses it")
    except Exception as e:  # noqa: BLE001 - an analysis crash refuses cp for the layer, with the reason
        return LayerSequenceTerms(refused=f"the sequence analysis failed ({type(e).__name__}: {e})")

    def per_sample(nodes) -> tuple[float, float]:
        fl = other = 0.0
        for n in dict.fromkeys(nodes):
            v = tensor_val(n)
            if v is None:
                continue
            k = batch if v.dim() and batch > 1 and int(v.shape[0]) % batch == 0 else 1
            if v.dtype.is_floating_point:
                fl += v.numel() / k
            else:
                other += v.numel() * v.element_size() / k
        return fl, other

    g = per_sample(a for (_user, a) in res.gathers)
    o = per_sample(n for n, _dim in res.out_gathers)
    return LayerSequenceTerms("", g[0], g[1], o[0], o[1])


# ---------------------------------------------------------------------------------------- groups
def dp_ranks(s: Strategy, k: int) -> list[int]:
    """Ranks of the first ``k`` consecutive DP ranks of a stage (``tp`` apart): a CP or EP group."""
    return [c * s.tp for c in range(k)]


def cp_group(s: Strategy) -> list[int]:
    """Ranks of the first CP group of a stage (:func:`dp_ranks`)."""
    return dp_ranks(s, s.cp)


def cp_block(s: Strategy) -> list[int]:
    """Ranks of the first block of ``tp * cp`` consecutive ranks: one CP group's TP groups, all
    holding the same samples."""
    return list(range(s.tp * s.cp))


def samples_layout(s: Strategy) -> Strategy:
    """``s`` as a plain layout of whole samples: the CP group's TP groups act as one group of
    ``tp * cp`` ranks holding the same samples (the activation replicated over it)."""
    return Strategy(s.tp * s.cp, s.dp // s.cp) if s.cp > 1 else s


# ---------------------------------------------------------------------------------------- times
def ring_shift_time(cluster, nbytes: float, group: list[int], calls: float = 1.0) -> float:
    """Seconds of one ring shift of ``nbytes`` per rank around ``group``: every rank sends ``nbytes``
    to the next and receives as many from the previous at once (the runtime's ``batch_isend_irecv``),
    priced as the two-rank all-to-all of each hop (each rank of a pair sending ``nbytes`` to the other
    while receiving as many: both directions of the link at once, as the cluster's all-to-all fit of
    two ranks measured it; on an unmeasured link ``nbytes / B + alpha``, a one-way send's time); the
    slowest hop paces the ring. ``calls``: the messages of the shift (one per tensor sent)."""
    if len(group) <= 1 or nbytes <= 0:
        return 0.0
    return max(cluster.collective_time("all_to_all", 2 * nbytes, [a, b], calls=calls)
               for a, b in zip(group, group[1:] + group[:1]))


GRAD_ITEMSIZE = 4
"""Bytes per element of the key / value gradients the ring sends home: the runtime accumulates them
in fp32 (:class:`galvatron_fx.runtime.context_parallel._RingAttention`)."""
RING_TENSORS = 2
"""Tensors per ring shift (key and value, or their gradients): one send / receive pair each."""


def cp_messages(att: LayerAttention, n: float, s: Strategy, itemsize: int) -> dict[str, list[float]]:
    """The messages one rank sends per micro-batch for the layer's attention under ``s`` with ``n``
    samples' tokens per rank, in bytes, forward and backward (once each; checkpointing repeats the
    forward): ``{"fwd": [...], "bwd": [...]}``, one entry per ring shift or all-to-all, every SDPA
    call of the layer included.

    * ring: forward ``cp - 1`` shifts of the key and value shards; backward ``cp - 1`` shifts of
      them again, then (after each step's blocks, once the key / value shift is in) ``cp`` shifts of
      the key / value gradients accumulated so far (fp32, :data:`GRAD_ITEMSIZE`; after ``cp`` shifts
      each source's gradients are home), one after the other;
    * ulysses: forward the query, key, value and output all-to-alls, backward their reverses
      (key / value at the query heads when their ``kv_heads / tp`` does not split over ``cp``).
    """
    if s.cp == 1 or not att.calls:
        return {"fwd": [], "bwd": []}
    k = att.shard_elems(n, s.tp, att.kv_heads, att.head_dim)
    v = att.shard_elems(n, s.tp, att.kv_heads, att.v_head_dim)
    if s.cp_kind == "ring":
        steps = s.cp - 1
        fwd = [(k + v) * itemsize] * steps
        bwd = [(k + v) * itemsize] * steps + [(k + v) * GRAD_ITEMSIZE] * s.cp
        return {"fwd": fwd * att.calls, "bwd": bwd * att.calls}
    q = att.shard_elems(n, s.tp, att.heads, att.head_dim)
    out = att.shard_elems(n, s.tp, att.heads, att.v_head_dim)
    if _ulysses_repeats(att, s):
        k, v = q, out   # NOTE: too few key / value heads to split over the CP group: repeated first
    one = [x * itemsize for x in (q, k, v, out)]
    return {"fwd": one * att.calls, "bwd": one * att.calls}


def _ulysses_repeats(att: LayerAttention, s: Strategy) -> bool:
    """Whether Ulysses repeats the key / value heads to the query heads (too few to split over cp)."""
    return att.kv_heads != att.heads and bool(att.kv_heads % s.tp or (att.kv_heads // s.tp) % s.cp)


def cp_attention_time(cluster, att: LayerAttention, n: float, s: Strategy, itemsize: int,
                      attention_s: float = 0.0, overlap: bool = False) -> float:
    """Seconds per micro-batch of the layer's attention exchanges under ``s`` (:func:`cp_messages`),
    checkpointing's repeat of the forward included: ring shifts (:func:`ring_shift_time`, one call
    per tensor) or all-to-alls over the CP group. ``attention_s``: the compute seconds (forward +
    backward) the ring's shifts hide behind when ``overlap`` (module docstring)."""
    msgs = cp_messages(att, n, s, itemsize)
    if not msgs["fwd"]:
        return 0.0
    rep = 2 if s.ckpt else 1
    group = cp_group(s)
    if s.cp_kind == "ring":
        def one(b):
            return ring_shift_time(cluster, b, group, calls=RING_TENSORS)
    else:
        def one(b):
            return cluster.collective_time("all_to_all", b, group)
    t = rep * sum(map(one, msgs["fwd"])) + sum(map(one, msgs["bwd"]))
    if overlap and s.cp_kind == "ring":
        t = max(0.0, cluster.overlap_time(attention_s, t) - attention_s)
    return t


# ------------------------------------------------------------------------------ ring block work
@functools.lru_cache(maxsize=1024)
def ring_blocks(seq: int, cp: int, causal: bool) -> tuple[int, int, int, int, int]:
    """The blocks of ring attention on the busiest CP rank over all ``cp`` sources, from the
    runtime's own plan (:func:`galvatron_fx.runtime.context_parallel._ring_blocks`, no explicit
    mask): ``(blocks, sum of rows x key columns, sum of rows, sum of key columns, largest rows x
    columns)`` per (sample, head). Zig-zag under ``is_causal``: ``cp + 1`` blocks of ``(2 cp + 1) c^2``
    entries in all (``c = S / 2cp``); without: ``cp`` blocks of ``(S / cp)^2``."""
    from ..runtime.context_parallel import _ring_blocks

    best = (0, 0, 0, 0, 0)
    for index in range(cp):
        dims = [(b.q[1], b.k[1]) for src in range(cp)
                for b in _ring_blocks(seq, cp, index, src, causal, None, torch.device("cpu"))]
        here = (len(dims), sum(r * c for r, c in dims), sum(r for r, _ in dims), sum(c for _, c in dims),
                max((r * c for r, c in dims), default=0))
        best = max(best, here, key=lambda t: (t[1], t[0]))
    return best


@dataclass(frozen=True)
class RingWork:
    """One rank's ring attention work per micro-batch and pass (every SDPA call of the layer):
    matmul FLOPs (fp32), bytes written by element-wise passes and operand copies (in copies: read +
    write once), launches, and the largest block's fp32 score bytes."""

    flops: dict
    copy_bytes: dict
    ops: dict
    block_bytes: float


def ring_work(att: LayerAttention, n: float, s: Strategy, itemsize: int) -> RingWork:
    """What the runtime's ring attention computes on one rank with ``n`` samples' tokens per rank
    (it holds ``b = n cp`` samples of ``S / cp`` positions), :func:`ring_blocks` blocks each:

    * FLOPs: forward ``q k^T`` and ``p v`` (``2 (d + dv)`` per score entry), backward the scores
      again, ``p^T g``, ``g v^T``, ``ds k``, ``ds^T q`` (``2 (3 d + 2 dv)``), all in fp32;
    * memory traffic: :data:`RING_SCORE_PASSES` over each block's fp32 scores (and
      :data:`RING_MASK_PASSES` under ``is_causal`` / with a mask), the running output's rescale
      and add (forward) and the three gradient adds (backward) over their rows, the operand rows'
      fp32 casts (non-fp32 operands) and repeats (GQA), the key / value gradients' folds (GQA);
    * launches: :data:`RING_BLOCK_OPS` per block (and the causal / mask / GQA / cast extras),
      :data:`RING_SHIFT_OPS` per shift, :data:`RING_CALL_OPS` per call.
    """
    if att.seq % s.cp:   # NOTE: a degree the runtime refuses (cp_refuses); priced as whole shards
        side = att.seq / s.cp
        blocks, area, rows, cols, largest = s.cp, s.cp * side * side, s.cp * side, s.cp * side, side * side
    else:
        blocks, area, rows, cols, largest = ring_blocks(att.seq, s.cp, att.causal)
    bh = n * s.cp * att.heads / s.tp   # (sample, query head) pairs of the rank
    d, dv = att.head_dim, att.v_head_dim
    gqa = att.kv_heads != att.heads
    cast = itemsize != 4
    e = bh * area                      # score entries of all blocks
    extra = RING_MASK_PASSES * (att.causal + att.masked)
    flops = {"fwd": e * 2 * (d + dv), "bwd": e * 2 * (3 * d + 2 * dv)}
    operands = bh * (rows * d * cast + cols * (d + dv) * (gqa or cast))
    copies = {"fwd": e * (RING_SCORE_PASSES["fwd"] + extra) + bh * rows * dv * 2.5 + operands,
              "bwd": e * (RING_SCORE_PASSES["bwd"] + extra) + bh * 1.5 * (rows * d + cols * (d + dv))
              + operands + bh * cols * (d + dv) * 0.5 * gqa}
    per_block = {p: RING_BLOCK_OPS[p] + RING_CAUSAL_OPS * att.causal + RING_MASK_OPS * att.masked
                 + RING_GQA_OPS[p] * gqa + RING_CAST_OPS * cast for p in ("fwd", "bwd")}
    shifts = {"fwd": s.cp - 1, "bwd": 2 * s.cp - 1}
    ops = {p: att.calls * (blocks * per_block[p] + RING_SHIFT_OPS * shifts[p] + RING_CALL_OPS[p])
           for p in ("fwd", "bwd")}
    return RingWork({p: att.calls * f for p, f in flops.items()},
                    {p: att.calls * 4 * c for p, c in copies.items()}, ops, bh * largest * 4)


def cp_compute_time(cluster, att: LayerAttention, n: float, s: Strategy, itemsize: int,
                    dtype: str) -> tuple[float, float]:
    """``(forward, backward)`` seconds per micro-batch the layer's context-parallel attention computes
    beyond what ``cp = 1``'s attention costs in the layer's time (the attention cores' FLOPs,
    :func:`attention_flops`, at the ``dtype`` rate; backward twice), checkpointing's repeat not
    included (the cost model adds it as for the rest of the forward).

    * ring: :func:`ring_work`'s FLOPs at the fp32 matmul rate plus its memory traffic at the
      cluster's ``copy_s_per_byte`` (the runtime's blocks are eager fp32 ops on every device, no
      fused kernel), less the cores. May be negative where the fused cores were priced above the
      ring's causal blocks (their FLOP count ignores the causal half).
    * ulysses: SDPA on head shards is the cores' work; the reshuffles around each all-to-all copy
      (:data:`ULYSSES_SEQ_HEADS`: forward 2 copies of each of q, k, v and 3 of the output, backward
      the reverse), plus the key / value repeats when their heads do not split over ``cp``.
    """
    if s.cp == 1 or not att.calls:
        return 0.0, 0.0
    per_byte = getattr(cluster, "copy_s_per_byte", 0.0)
    if s.cp_kind == "ring":
        w = ring_work(att, n, s, itemsize)
        core = cluster.compute_time(attention_flops(att, n, s.tp), dtype)
        return tuple(cluster.compute_time(w.flops[p], "fp32") + w.copy_bytes[p] * per_byte - k * core
                     for p, k in (("fwd", 1), ("bwd", 2)))
    q, k, v, out = (x / itemsize for x in cp_messages(att, n, s, itemsize)["fwd"][:4])
    qkv = q + k + v
    to_h, to_s = ULYSSES_SEQ_HEADS["to_heads"][1], ULYSSES_SEQ_HEADS["to_seq"][1]
    fwd = (to_h * qkv + to_s * out) * itemsize
    bwd = (to_s * qkv + to_h * out) * itemsize
    if _ulysses_repeats(att, s):   # the repeats (forward) and their gradients' sums (backward, reads)
        fwd, bwd = fwd + (k + v) * itemsize, bwd + (k + v) * itemsize / 2
    return att.calls * fwd * per_byte, att.calls * bwd * per_byte


def cp_attention_ops(att: LayerAttention, s: Strategy, itemsize: int = 4) -> tuple[int, int]:
    """``(forward ops, backward ops)`` context parallelism adds to the layer per micro-batch: the ring's
    block, shift and call launches (:func:`ring_work`), or Ulysses' reshuffles
    (:data:`ULYSSES_SEQ_HEADS`: three ``to_heads`` and one ``to_seq`` forward, the reverse backward)
    with its four autograd Functions and its key / value repeats. Every one is a plain eager op
    (the backward ones run inside the Functions' backward: no autograd node of their own)."""
    if s.cp == 1 or not att.calls:
        return 0, 0
    if s.cp_kind == "ring":
        ops = ring_work(att, 1.0, s, itemsize).ops
        return int(ops["fwd"]), int(ops["bwd"])
    to_h = ULYSSES_SEQ_HEADS["to_heads"][0]
    to_s = ULYSSES_SEQ_HEADS["to_seq"][0] + 2 * s.cp
    rep = 2 if _ulysses_repeats(att, s) else 0
    return att.calls * (3 * to_h + to_s + 4 + rep), att.calls * (3 * to_s + to_h + 4 + rep)


def cp_transient_bytes(att: LayerAttention, n: float, s: Strategy, itemsize: int) -> float:
    """The exchange's own buffers at their peak (bytes): the ring's backward step holds the received
    key / value shards and the key / value gradients in flight, send and receive side (the fp32
    accumulators are the gradients themselves), and a block's two fp32 score-sized tensors (scores /
    probabilities and their gradient: the runtime materialises each block); Ulysses the four
    head-sharded tensors of one pass."""
    msgs = cp_messages(att, n, s, itemsize)
    if not msgs["fwd"]:
        return 0.0
    if s.cp_kind == "ring":
        kv = msgs["fwd"][0] if msgs["fwd"] else 0.0
        return 2 * (kv + max(msgs["bwd"])) + 2 * ring_work(att, n, s, itemsize).block_bytes
    return sum(msgs["fwd"]) / att.calls


class SplitIntercepts:
    """A layer's measure (:class:`~.measure.LayerMeasure`) under context parallelism: each fit's
    constant part (what does not grow with the samples: rotary tables ``[1, S, d]`` and other
    sequence-long values shared by the batch) divided by ``cp``, since the context-parallel pass
    hands every sequence activation over in ``S / cp`` shards too."""

    def __init__(self, measure, cp: int):
        self.measure, self.cp = measure, cp

    def __getattr__(self, name: str):
        f = getattr(self.measure, name)
        return Affine(f.a, f.c / self.cp) if isinstance(f, Affine) else f


def attention_flops(att: LayerAttention, n: float, tp: int) -> float:
    """Forward FLOPs of the layer's attention cores on one rank (``4 n heads/tp S^2 d``, the
    :data:`~galvatron_fx.cost.measure.SDPA_FORMULAS` count; backward is twice this)."""
    return att.calls * 2 * n * att.heads / tp * att.seq * att.kv_seq * (att.head_dim + att.v_head_dim)


def layout_time(cm, nbytes: float, have: Strategy, want: Strategy) -> float:
    """Seconds to give each rank of layout ``want`` its part of an activation of ``nbytes`` per
    micro-batch (all samples) held in layout ``have`` (module docstring, "Layout boundaries")."""
    if have.cp == 1 and want.cp == 1:
        return cm._gather_time(nbytes, have, want)
    if (have.tp, have.dp, have.cp) == (want.tp, want.dp, want.cp):
        # same groups: a rank holds nbytes / dp either way; only SP's split over TP can differ
        plain = (Strategy(have.tp, have.dp, sp=have.sp), Strategy(want.tp, want.dp, sp=want.sp))
        return cm._gather_time(nbytes, *plain)
    t = 0.0
    if have.cp > 1:
        # NOTE: with SP the TP ranks hold sequence slices too: one all-gather over the whole block
        group = cp_block(have) if have.sp else cp_group(have)
        t = cm.cluster.collective_time("all_gather", nbytes * have.cp / have.dp, group)
    return t + cm._gather_time(nbytes, samples_layout(have) if have.cp > 1 else have, samples_layout(want))
