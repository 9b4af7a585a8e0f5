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
  in place of ``cp = 1``'s attention cores, :func:`core_attention_flops` at
  :meth:`Cluster.attention_time`):

  - ``ring``: the runtime runs one fused SDPA kernel per (query span, key span) block of its plan
    (:func:`.ring.ring_blocks`, the runtime's own: zig-zag under ``is_causal`` gives ``cp`` calls, the
    own shard's with the kernel's ``is_causal``; an explicit mask cuts blocks into the runtime's
    tiles of query rows). Each call is priced at :meth:`Cluster.attention_time` in the compute
    dtype for its FLOPs (a causal call half its square) and its own key count, forward and
    backward (:func:`attention_backward_flops`, FlashAttention-2's 2.5x). The cores ``cp = 1``
    prices (:func:`core_attention_flops`, the same kernel on the whole sequence) are subtracted.
    The log-sum-exp merge and the fp32 accumulators add element-wise bytes at ``copy_s_per_byte``
    (:func:`.ring.ring_work`, :data:`.ring.RING_MERGE_WRITES`), and their launches are counted too
    (:data:`.ring.RING_BLOCK_OPS` per block, per shift, per call: :func:`cp_attention_ops`,
    ``op_launch_s`` each, both passes). Transient memory holds the fp32 output / gradient
    accumulators, one block's kernel outputs and the shifts' buffers; no score block exists.
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
    critical path by default (conservative: the runtime starts each shift before a source's kernel
    calls and waits for it after them, so a device whose transfers run beside its kernels hides
    them); ``overlap=True`` (``CostModel(cp_overlap=True)``) prices the shifts hidden behind the
    layer's attention compute (:meth:`Cluster.overlap_time`).
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

from dataclasses import dataclass

import torch
import torch.fx

from ..ir import META_KEY
from ..layout import Layout
from ..sharding.state import node_arg, op_name, tensor_val
from ..solver.strategy import Strategy
from .measure import Affine
from .ring import ring_work

ATTENTION_BACKWARD = (3, 2)
"""A fused attention kernel's backward FLOPs per forward FLOP (:func:`attention_backward_flops`):
``2 e (3 d + 2 d_v)`` for the forward's ``2 e (d + d_v)``, FlashAttention-2's count (2.5x at
``d = d_v``: the scores recomputed, then four products)."""
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
    return list(Layout(s.tp, s.dp).dp_ranks(0)[:k])


def cp_group(s: Strategy) -> list[int]:
    """Ranks of the first CP group of a stage (:class:`~galvatron_fx.layout.Layout`)."""
    return list(Layout(s.tp, s.dp, cp=s.cp).cp_ranks(0))


def cp_block(s: Strategy) -> list[int]:
    """Ranks of the first block of ``tp * cp`` consecutive ranks: one CP group's TP groups, all
    holding the same samples (:meth:`~galvatron_fx.layout.Layout.batch_slices`)."""
    return list(Layout(s.tp, s.dp, cp=s.cp).batch_slices().tp_ranks(0))


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
in fp32 (:mod:`galvatron_fx.runtime.ring_attention`)."""
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
def attention_backward_flops(att: LayerAttention, fwd: float) -> float:
    """Backward FLOPs of a fused attention kernel whose forward executes ``fwd`` (:data:`ATTENTION_BACKWARD`)."""
    d, dv = att.head_dim, att.v_head_dim
    a, b = ATTENTION_BACKWARD
    return fwd * (a * d + b * dv) / (d + dv) if d + dv else fwd * (a + b) / 2


def core_attention_flops(att: LayerAttention, n: float, tp: int) -> float:
    """Forward FLOPs the fused kernel executes for the layer's attention cores at ``cp = 1`` on one
    rank with ``n`` samples: :func:`attention_flops`, halved under ``is_causal`` (the kernel skips
    the blocks above the diagonal). What ``cp = 1`` prices at :meth:`Cluster.attention_time`, and what
    context parallelism's own attention replaces (:func:`cp_compute_time`)."""
    return attention_flops(att, n, tp) * (0.5 if att.causal else 1.0)


def cp_compute_time(cluster, att: LayerAttention, n: float, s: Strategy, itemsize: int,
                    dtype: str) -> tuple[float, float]:
    """``(forward, backward)`` seconds per micro-batch the layer's context-parallel attention computes
    beyond what ``cp = 1``'s attention costs in the layer's time (its fused kernel on the whole
    sequence, :func:`core_attention_flops` at :meth:`Cluster.attention_time`, backward
    :func:`attention_backward_flops`), checkpointing's repeat not included (the cost model adds it
    as for the rest of the forward).

    * ring: each of :func:`ring_work`'s kernel calls at :meth:`Cluster.attention_time` in ``dtype``
      (with its own key count: short blocks run slower where the cluster has that curve), plus the
      merge's and accumulators' element-wise bytes at the cluster's ``copy_s_per_byte``, less the
      cores. Near zero where the kernel's rate does not depend on the key count: the blocks' FLOPs
      sum to the causal kernel's.
    * ulysses: SDPA on head shards is the cores' work; the reshuffles around each all-to-all copy
      (:data:`ULYSSES_SEQ_HEADS`: forward 2 copies of each of q, k, v and 3 of the output, backward
      the reverse), plus the key / value repeats when their heads do not split over ``cp``.
    """
    if s.cp == 1 or not att.calls:
        return 0.0, 0.0
    per_byte = getattr(cluster, "copy_s_per_byte", 0.0)
    if s.cp_kind == "ring":
        w, d = ring_work(att, n, s, itemsize), att.head_dim or None

        def kernel(flops, keys, backward):
            f = attention_backward_flops(att, flops) if backward else flops
            return cluster.attention_time(f, dtype, backward=backward, seq=keys, head_dim=d)

        core = core_attention_flops(att, n, s.tp)
        return tuple(att.calls * sum(kernel(f, k, bw) for f, k in w.blocks) + w.copy_bytes[p] * per_byte
                     - kernel(core, att.kv_seq or None, bw) for p, bw in (("fwd", False), ("bwd", True)))
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
    """The attention's own buffers at their peak (bytes). Ring: the k / v shards and the fp32 k / v
    gradients in flight (send and receive side) and the larger pass's :attr:`RingWork.buffers` (the
    fp32 output / gradient accumulators and a block's kernel outputs; no score blocks). Ulysses: the
    four head-sharded tensors of one pass."""
    msgs = cp_messages(att, n, s, itemsize)
    if not msgs["fwd"]:
        return 0.0
    if s.cp_kind == "ring":
        kv = msgs["fwd"][0] if msgs["fwd"] else 0.0
        return 2 * (kv + max(msgs["bwd"])) + max(ring_work(att, n, s, itemsize).buffers.values())
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
    """Forward FLOPs of the layer's attention cores on one rank over all ``S x S`` scores
    (``4 n heads/tp S^2 d``, the :data:`~galvatron_fx.cost.flop_rules.SDPA_FORMULAS` count; a causal
    fused kernel executes half: :func:`core_attention_flops`)."""
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
