"""Data parallelism and its sharded kinds: fields ``dp`` and ``sdp``.

The ``dp`` ranks of a layer (its stage's devices over ``tp``) run different samples. ``sdp`` is the
kind: plain DP (states replicated, gradients all-reduced), ZeRO-2 (optimizer states and gradients
sharded over the group) or ZeRO-3 (parameters too, all-gathered around each use). Rewritten by
``passes/data_parallel.py`` (and ``passes/resharding.py`` between layouts); run by
``runtime/data_parallel.py`` over the dim-0 layout of ``runtime/zero_layout.py``.

Priced by :func:`buffer_terms` (one flat buffer's gradient reduction, ZeRO's gathers, their
buffers) and :func:`copy_times` (the runtime's copies around it), for a layer's own buffer here
(:func:`_cost_terms`) and for the experts' buffers by :meth:`galvatron_fx.cost.CostModel.expert_terms`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..layout import Layout
from .base import (
    CostTerms,
    Dimension,
    Field,
    LayerWork,
    PassSpec,
    SpaceOptions,
    layer_elems,
    one_of,
    positive_int,
    rule,
)

SDP_KINDS: tuple[str, ...] = ("none", "zero2", "zero3")
"""Data-parallel kinds, in enumeration order: plain DP (replicated states), ZeRO-2 (optimizer states
and gradients sharded over the ``dp`` group), ZeRO-3 (parameters sharded too)."""


def _sdp_needs_dp(s: Any, o: SpaceOptions) -> bool:
    """ZeRO shards states over the data-parallel group; with ``dp == 1`` there is nothing to shard,
    so ZeRO-2/3 equal plain DP (same memory, same time, no communication). We canonicalise such a
    layer to ``sdp="none"`` and prune the two duplicates: with ``dp == 1`` only ``sdp="none"``."""
    return s.dp > 1 or s.sdp == "none"


def _sdp_switch(s: Any, o: SpaceOptions) -> bool:
    """``zero2=False`` / ``zero3=False`` in the options drop that data-parallel kind."""
    return not (s.sdp == "zero2" and not o.zero2) and not (s.sdp == "zero3" and not o.zero3)


def _plan_sdp(w: str, layer, micro_batch: int) -> str | None:
    if layer.sdp not in SDP_KINDS:
        return f"plan {w}.sdp must be one of {list(SDP_KINDS)}, got {layer.sdp!r}"
    return None


def buffer_terms(cm: Any, s: Any, elems_tp: int, train_tp: int, dpg: list[int], first: bool,
                 neighbours: tuple[int, int] | None = None) -> CostTerms:
    """One flat buffer's data-parallel terms: ``elems_tp`` parameter elements per device
    (``train_tp`` trainable) reduced over the ranks ``dpg`` under ``s``'s kind (``first``: the
    stage's first layer). DP all-reduces the gradients once per step in buckets, ZeRO
    reduce-scatters every micro-batch's, ZeRO-2 re-gathers the updated parameters once per step,
    ZeRO-3 gathers the parameters in forward and backward; the transient buffers each holds.
    ``neighbours``: the parameter elements per device of the layers before and after it, whose
    buffers ZeRO-3 prefetches during its backward and forward (default: its own size)."""
    full_params, full_grads = elems_tp * cm.itemsize, train_tp * cm.reduce_itemsize
    ct = cm.cluster.collective_time
    exposed = regather = reduce_scatter = 0.0
    if not train_tp:
        sync = 0.0   # a frozen layer reduces nothing
    elif s.sdp == "none":
        # NOTE: the runtime packs DP gradients into buckets of bucket_bytes (one call each),
        # filled in reverse layer order; the last bucket's all-reduce starts once backward is
        # over, so its share of every layer's sync is exposed (all of it for a model smaller
        # than one bucket)
        share = min(1.0, full_grads / cm.bucket_bytes) if cm.bucket_bytes else 1.0
        sync = ct("all_reduce", full_grads, dpg, calls=share)
        if cm.bucket_bytes:
            exposed = sync * min(1.0, cm.bucket_bytes / max(cm.model_grad_bytes(), 1.0))
    else:
        # NOTE: ZeRO reduce-scatters every micro-batch's gradient (shards summed: no whole-buffer
        # gradient outlives a pass), beside the backward of the layers before it
        sync, reduce_scatter = 0.0, ct("reduce_scatter", full_grads, dpg)
        if s.sdp == "zero2":
            regather = ct("all_gather", train_tp * cm.itemsize, dpg)   # frozen ones stay whole
            if first:
                # NOTE: the first layer's re-gather has no layer before it to hide behind
                # (prefetch starts from it): priced as exposed step sync
                sync = exposed = regather
                regather = 0.0
    gather = 2 * ct("all_gather", full_params, dpg) if s.sdp == "zero3" else 0.0
    transient = 0.0
    if s.sdp == "zero3" and len(dpg) > 1:
        # NOTE: in the layer's backward: its gathered buffer, the previous layer's prefetched
        # buffer and its [dp, S] staging buffer, then the buffer's gradient, or (the own buffer
        # freed) the gradient's reduce-scatter staging; in its forward: its buffer, the next
        # layer's prefetched buffer and its staging
        before, after = (b * cm.itemsize for b in neighbours) if neighbours else (full_params, full_params)
        transient = full_params + max(2 * before + max(full_params, full_grads), 2 * after)
    elif s.sdp == "zero2" and len(dpg) > 1:
        transient = train_tp * cm.itemsize + full_grads   # a pass's gradient and its reduce-scatter staging
    elif len(dpg) > 1 and train_tp:
        transient = min(cm.bucket_bytes, full_grads)
    held = full_params if s.sdp == "zero3" and len(dpg) > 1 else 0.0
    return CostTerms(sync_s=sync, gather_s=gather, transient_bytes=transient, exposed_s=exposed,
                     regather_s=regather, reduce_scatter_s=reduce_scatter, held_bytes=held)


def copy_times(cm: Any, elems_tp: int, train_tp: int, s: Any) -> CostTerms:
    """The runtime's copies around a flat buffer (``runtime/data_parallel.py``) at the cluster's
    ``copy_s_per_byte``, as ``overhead_s`` per micro-batch and ``optimizer_s`` per step: every pass
    flattens the layer's gradients into one buffer (ZeRO: into the reduce-scatter staging) and
    ZeRO-3 copies its parameters out of the all-gather staging twice (forward and backward); once
    per step DP packs its gradients into buckets and ZeRO-2 copies out the re-gathered parameters."""
    per_byte = getattr(cm.cluster, "copy_s_per_byte", 0.0)
    if not per_byte:
        return CostTerms()
    grads = train_tp * (cm.itemsize if s.sdp == "none" else cm.reduce_itemsize)
    params = 2 * elems_tp * cm.itemsize if s.sdp == "zero3" else 0.0
    step = 0.0
    if s.sdp == "none" and s.dp > 1 and cm.bucket_bytes:
        step = train_tp * cm.reduce_itemsize
    elif s.sdp == "zero2":
        step = train_tp * cm.itemsize
    return CostTerms(overhead_s=(grads + params) * per_byte, optimizer_s=step * per_byte)


def _cost_terms(cm: Any, index: int, n: float, s: Any, work: LayerWork) -> CostTerms:
    """The layer's own buffer: its reduction and gathers over its ZeRO group, and the copies."""
    elems_tp, train_tp = layer_elems(cm, index, s)
    dpg = list(Layout(s.tp, s.dp, shard=s.shard).zero_ranks(0))
    # NOTE: the neighbours priced under this layer's strategy (the search prices one layer at a
    # time), whole where TP shards nothing of this layer (it runs replicated: priced as at tp 1)
    last = len(cm.layers) - 1
    ns = s if s.tp == 1 or cm.layer_params(index, s.tp).sharded else dataclasses.replace(s, tp=1)
    neighbours = tuple(layer_elems(cm, j, ns)[0] if 0 <= j <= last else 0 for j in (index - 1, index + 1))
    return (buffer_terms(cm, s, elems_tp, train_tp, dpg, index == 0, neighbours)
            + copy_times(cm, elems_tp, train_tp, s))


DIMENSION = Dimension(
    name="data",
    fields=(Field("dp", int, None, 20, derive=lambda n, chosen: n // chosen["tp"], check=positive_int, json_required=True),
            Field("sdp", str, "none", 30, values=lambda o, n, c: SDP_KINDS, check=one_of(SDP_KINDS), json_required=True)),
    rules=(rule(_sdp_needs_dp), rule(_sdp_switch)),
    label=lambda s: [(20, f"dp{s.dp}")] + ([(50, s.sdp)] if s.sdp != "none" else []),
    cost_terms=_cost_terms,
    passes=(PassSpec("data_parallel", after="checkpointing"),),
    runtime=("runtime.data_parallel", "runtime.zero_layout", "runtime.reshard"),
    plan_checks=(_plan_sdp,),
)
