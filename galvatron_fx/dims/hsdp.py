"""Hybrid sharded data parallelism (HSDP): field ``shard``, the size of a layer's ZeRO group.

A ZeRO-2 / ZeRO-3 layer normally shards its states over its whole DP group, so every all-gather
and reduce-scatter spans the DP group's slowest link. Under HSDP (FSDP2's 2-D mesh, torchtitan's
``dp_replicate x dp_shard``) it shards them over ``shard`` consecutive DP ranks (the DP ranks of one
node) and replicates the shards over the ``dp / shard`` shard groups: gathers and reduce-scatters
stay inside the shard group, and once per step each rank all-reduces its gradient shard (``1 /
shard`` of the layer's gradient) with the ranks holding the same shard. ``shard = dp`` is plain
ZeRO and the default (a strategy built without ``shard`` completes it to ``dp``).

The search offers the DP ranks of one node (``devices_per_node / tp``), two nodes, four, ... where
that is fewer than ``dp`` and divides it, on ZeRO layers without expert or context parallelism. Ranks:
:meth:`galvatron_fx.layout.Layout.zero_ranks` / :meth:`~galvatron_fx.layout.Layout.replica_ranks`;
run by ``runtime/data_parallel.py`` (the ZeRO group is the shard group, the shard's gradient
all-reduced over the replicas); priced by the cost model's ZeRO terms over the shard group plus
:func:`_cost_terms` here.
"""

from __future__ import annotations

from typing import Any

from ..layout import Layout
from .base import CostTerms, Dimension, Field, SpaceOptions, layer_elems, rule


def shard_sizes(o: SpaceOptions, chosen: dict) -> tuple[int, ...]:
    """The HSDP shards the space offers a ``(tp, dp, sdp)`` choice: the DP ranks of one node, of
    two, four, ... nodes, each fewer than ``dp`` and dividing it (none without ZeRO, with HSDP
    switched off, or when a node holds one DP rank or a whole DP group)."""
    tp, dp = chosen["tp"], chosen["dp"]
    k = o.devices_per_node // tp if o.devices_per_node % tp == 0 else 0
    if chosen["sdp"] == "none" or not o.more.get("hsdp", True) or k < 2:
        return ()
    out = []
    while k < dp:
        if dp % k == 0:
            out.append(k)
        k *= 2
    return tuple(out)


def _values(o: SpaceOptions, n: int, chosen: dict) -> tuple:
    return (chosen["dp"], *shard_sizes(o, chosen))


def _check(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be an int >= 1 (the ZeRO group size, dividing dp), got {value!r}"
    return None


def _divides(s: Any) -> str | None:
    if s.dp % s.shard:
        return f"Strategy.shard {s.shard} must divide dp={s.dp} (shard = dp: plain ZeRO)"
    if s.shard < s.dp and s.sdp == "none":
        return (f"Strategy.shard {s.shard} < dp={s.dp} needs sdp 'zero2' or 'zero3' (HSDP shards ZeRO "
                "states); use shard = dp with sdp 'none'")
    return None


def _hsdp_plain(s: Any, o: SpaceOptions) -> bool:
    """HSDP is offered to layers without expert or context parallelism (their own DP groups are
    not split into shard groups yet)."""
    return s.shard == s.dp or (s.ep == 1 and s.cp == 1)


def _hsdp_switch(s: Any, o: SpaceOptions) -> bool:
    """``constraints={"hsdp": False}`` drops HSDP (every ZeRO group is the whole DP group)."""
    return s.shard == s.dp or o.more.get("hsdp", True)


def _plan_shard(w: str, layer, micro_batch: int) -> str | None:
    shard = layer.value("shard")
    if shard is None:
        return None
    if _check(shard) or layer.dp % shard:
        return f"plan {w}.shard must be an integer dividing dp={layer.dp}, got {shard!r}"
    if shard < layer.dp and layer.sdp == "none":
        return f"plan {w}.shard {shard} < dp needs sdp zero2 or zero3; set shard to {layer.dp}"
    return None


def _cost_terms(cm: Any, index: int, n: float, s: Any, work: Any) -> CostTerms:
    """Each rank's all-reduce of its gradient shard over the replicas, once per step (started as
    the layer's last reduce-scatter lands, beside the backward of the layers before it; the
    stage's first layer's is exposed)."""
    if s.shard == s.dp:
        return CostTerms()
    train = layer_elems(cm, index, s)[1]
    if not train:
        return CostTerms()
    replicas = list(Layout(s.tp, s.dp, shard=s.shard).replica_ranks(0))
    sync = cm.cluster.collective_time("all_reduce", train * cm.reduce_itemsize / s.shard, replicas)
    return CostTerms(sync_s=sync, exposed_s=sync if index == 0 else 0.0)


DIMENSION = Dimension(
    name="hsdp",
    fields=(Field("shard", int, None, 100, values=_values, check=_check, complete=lambda s: s.dp),),
    rules=(rule(_hsdp_plain), rule(_hsdp_switch)),
    checks=(_divides,),
    label=lambda s: [(55, f"hsdp{s.shard}")] if getattr(s, "shard", s.dp) < s.dp else [],
    cost_terms=_cost_terms,
    plan_checks=(_plan_shard,),
    constraints=("hsdp",),
    space_options=lambda c: {"hsdp": bool(c["hsdp"])} if "hsdp" in c else {},
)
