"""Data-parallel pass: each layer's parameters -> views of flat buffers synchronised over DP.

:class:`DataParallelPass` takes SPLIT and leaves SPLIT: every layer submodule with parameters is
rewritten by :func:`flatten_layer_params` for its plan entry (``sdp`` mode, DP group of the rank
layout in :mod:`galvatron_fx.runtime.groups`): its trainable parameters go into one buffer,
all-reduced (``sdp="none"``), reduce-scattered with replicated parameters (``"zero2"``) or sharded
and all-gathered around use (``"zero3"``); its frozen ones (``requires_grad=False``) into a second
buffer, ``frozen_params``, with no gradient, no reduction and no optimizer state: sharded and
gathered around use under ZeRO-3, whole otherwise (ZeRO-2 shards only gradients and optimizer
states, which they have none of); see :mod:`galvatron_fx.runtime.data_parallel`. The stores land
in ``ctx.stores`` (layer order; per layer trainable first). An expert-parallel layer's expert weights
(``ctx.expert_params``, :mod:`.expert_parallel`) go into two more buffers, ``expert_params`` and
``frozen_expert_params``, reduced / sharded over the ranks holding the same experts
(:meth:`~galvatron_fx.runtime.groups.Layout.expert_dp_ranks`), their ``tp_ranks`` the EP group
(expert TP: :meth:`~galvatron_fx.runtime.groups.Layout.expert_ranks`); a
loop-form block's experts (``ctx.held_experts``: whole parameters) into ``held_expert_params`` /
``frozen_held_expert_params``, reduced alike, ``held_over`` the EP group. A layer that mixes the samples of a
batch computes on the whole batch on every DP rank (``ctx.whole_batch``): its store scales the
gradients by ``1 / dp`` before they are summed over the group.
Layers with ``sdp="none"`` of one DP group share DDP-style gradient buckets
(:class:`~galvatron_fx.runtime.data_parallel.GradBuckets`, ``ctx.bucket_bytes`` each); ZeRO-2 and
ZeRO-3 layers are chained for prefetch (:func:`link_prefetch`).
Under a mixed-precision policy (``ctx.precision``) each buffer holds fp32 masters and a
low-precision working copy the layer reads (:mod:`galvatron_fx.runtime.precision`).

One buffer (:func:`flatten_layer_params`). Input: a layer GraphModule from :mod:`.split_layers` (parameters are ``get_attr``
nodes with their original FQN targets), which of them to flatten, and the ``sdp`` mode and DP ranks.

Output (in place): the layer holds a :class:`~galvatron_fx.runtime.data_parallel.FlatParams`
submodule ``flat_params``; its graph starts with ``param_parts = dp_params(flat_params)`` /
``zero2_params`` / ``zero3_all_gather`` (the buffer's chunks, cut at every parameter and padding
gap: ``FlatParams.part_sizes``, each parameter's in its shape) and reads each parameter as
``param_parts[j]`` under the parameter's old node name; a ZeRO-3 layer ends with
``zero3_release(flat_params, outputs)`` (unless a view of its buffer is itself an output, a tied
weight, which keeps the buffer gathered). The original parameter attributes are removed, so
the layer holds no ``nn.Parameter`` (``flat_param`` is a plain tensor; the user sees per-parameter
views, :mod:`.bind_parameters`). Returns the store, or ``None`` when there is nothing to flatten.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..ir import layer_module_name
from ..runtime.data_parallel import ENTRY, FlatParams, GradBuckets, zero3_release
from ..runtime.groups import Layout
from .base import check
from .context import ContextPass
from .split_layers import is_param_node, is_trainable_param, layer_outputs, route_outputs


class DataParallelPass(ContextPass):
    """See the module docstring."""

    needs_split = True
    name = "data_parallel"

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        super().requires(graph_module)
        check(not self.ctx.stores, "data_parallel ran already on this context")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        ctx = self.ctx
        buckets: dict[tuple, GradBuckets] = {}
        for i, lp in enumerate(ctx.stage_plan.layers):
            layer = getattr(graph_module, layer_module_name(i))
            lay = Layout(lp.tp, lp.dp, base=ctx.base, ep=lp.ep, etp=lp.expert_tp, shard=lp.strategy.shard)
            experts = ctx.expert_params.get(i, set())

            def kind(fqn, experts=experts):
                return "" if fqn not in experts else "held" if fqn in ctx.held_experts else "split"

            frozen_mode = "zero3" if lp.sdp == "zero3" else "none"
            for trainable, attr, mode, expert in ((True, "flat_params", lp.sdp, ""),
                                                  (False, "frozen_params", frozen_mode, ""),
                                                  (True, "expert_params", lp.sdp, "split"),
                                                  (False, "frozen_expert_params", frozen_mode, "split"),
                                                  (True, "held_expert_params", lp.sdp, "held"),
                                                  (False, "frozen_held_expert_params", frozen_mode, "held")):
                nodes = [n for n in layer.graph.nodes if is_param_node(n) and is_trainable_param(n) == trainable
                         and kind(n.target) == expert]
                # NOTE: a loop's experts stay whole over TP even under expert TP (grouped ones only)
                xlay = lay if expert == "split" else dataclasses.replace(lay, etp=False)
                # NOTE: ZeRO shards over the layer's ZeRO group (HSDP: its shard group; the shards'
                # gradients are then all-reduced over the replicas), a replicated buffer over its DP group
                zero = mode != "none" and not expert
                dp_ranks = (xlay.expert_dp_ranks(ctx.rank) if expert else
                            lay.zero_ranks(ctx.rank) if zero else lay.dp_ranks(ctx.rank))
                store = flatten_layer_params(layer, mode, dp_ranks, ctx.rank, ctx.bucket_bytes,
                                             ckpt=lp.ckpt, compute_dtype=ctx.precision.compute_dtype,
                                             reduce_dtype=ctx.precision.reduce_dtype, nodes=nodes, attr=attr,
                                             offload=zero and trainable and lp.strategy.offload != "none")
                if store is None:
                    continue
                # NOTE: a grouped expert weight is a dim-0 shard over its EP group (ctx.tp_shards), whole
                # over TP (expert TP: sharded there too, its pieces over Layout.expert_ranks); a loop's
                # experts are whole on the EP rank holding them (the others' gathered from the EP group
                # by full_state_dict)
                store.layer, store.tp_ranks = i, lay.expert_ranks(ctx.rank) if expert == "split" else lay.tp_ranks(ctx.rank)
                if zero and store.trainable:
                    store.replica_ranks = lay.replica_ranks(ctx.rank)
                if expert == "held":
                    store.held_over = lay.ep_ranks(ctx.rank)
                if ctx.holds_whole_batch(i):   # every DP rank computes the whole batch's gradient
                    store.grad_scale = 1.0 / lp.dp
                if store.trainable and store.mode == "none" and store.dp > 1:
                    key = (store.dp_ranks, store.reduce_dtype)
                    store.buckets = buckets.setdefault(key, GradBuckets(store.dp_ranks, ctx.bucket_bytes))
                ctx.stores.append(store)
        link_prefetch(ctx.stores)
        return PassResult(graph_module, bool(ctx.stores))

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        for i in range(len(self.ctx.stage_plan.layers)):
            layer = getattr(graph_module, layer_module_name(i))
            left = [n.target for n in layer.graph.nodes if is_param_node(n)]
            check(not left, f"layer {i} still reads parameters outside its flat buffers: {left}")
            check(not list(torch.nn.Module.parameters(layer)), f"layer {i} still holds nn.Parameters")


def link_prefetch(stores: list[FlatParams]) -> None:
    """Chain a stage's ZeRO-2 (dp > 1) and ZeRO-3 layers in forward (= graph) order for
    FSDP2-style prefetch: each gather starts the next layer's all-gather in forward (ZeRO-3: the
    previous one's in backward)."""
    chain = [s for s in stores if s.mode == "zero3" or (s.mode == "zero2" and s.dp > 1)]
    for a, b in zip(chain, chain[1:]):
        # NOTE: plain attributes, not submodules: the chain is no part of the module tree
        object.__setattr__(a, "next_gather", b)
        object.__setattr__(b, "prev_gather", a)


def _fetch_owner(root: torch.nn.Module, target: str):
    *path, name = target.split(".")
    owner = root
    for atom in path:
        owner = getattr(owner, atom)
    return owner, name


def flatten_layer_params(layer: torch.fx.GraphModule, mode: str, dp_ranks, rank: int,
                         bucket_bytes: int, ckpt: bool = False, compute_dtype: torch.dtype | None = None,
                         reduce_dtype: torch.dtype | None = None, nodes=None,
                         attr: str = "flat_params", offload: bool = False) -> FlatParams | None:
    graph = layer.graph
    if nodes is None:
        nodes = [n for n in graph.nodes if is_trainable_param(n)]
    if not nodes:
        return None
    tensors = {}
    for n in nodes:
        owner, name = _fetch_owner(layer, n.target)
        tensors[n.target] = getattr(owner, name)
    trainable = is_trainable_param(nodes[0])
    store = FlatParams(tensors, mode, dp_ranks, rank, bucket_bytes, compute_dtype, reduce_dtype, trainable=trainable,
                       offload=offload)
    layer.add_submodule(attr, store)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    # NOTE: the entry call hands out the buffer's chunks itself, not a buffer the graph slices or
    # splits: a slice's backward writes a zero-filled gradient of the *whole* buffer (autograd adds
    # them up), a split's backward concatenates one; per micro-batch, both were the pipeline's
    # overhead over torch.distributed.pipelining
    with graph.inserting_before(first):
        fp = graph.get_attr(attr)
        parts = graph.call_function(ENTRY[mode], (fp,))
        want = "param_parts" if trainable else "frozen_parts"
        parts.name = want if want not in {n.name for n in graph.nodes} else parts.name
    views = set()
    for i, n in enumerate(nodes):
        with graph.inserting_before(n):
            view = graph.call_function(operator.getitem, (parts, store.part_index[i]))
        view.meta = dict(n.meta)
        n.replace_all_uses_with(view)
        old = n.name
        graph.erase_node(n)
        view.name = old
        views.add(view)
        owner, name = _fetch_owner(layer, n.target)
        delattr(owner, name)
    if mode == "zero3":
        if any(o in views for o in layer_outputs(graph)[1]):
            store.keep_gathered = True   # a tied weight leaves the layer: keep it until backward
        else:
            store.regather_in_backward = not ckpt
            route_outputs(graph, zero3_release, fp)
    layer.delete_all_unused_submodules()
    graph.lint()
    layer.recompile()
    return store
