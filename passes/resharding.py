"""Resharding pass: the slicing / gathering calls that move values between layer layouts.

Takes SPLIT, leaves SPLIT (the top graph gains calls of :mod:`galvatron_fx.runtime.reshard`
between the layer calls):

* graph inputs arrive in the *input layout* (``ctx.input_layout``: ``tp = 1, dp = N`` over the
  stage's ``N`` ranks, so rank ``j`` holds slice ``j`` of each micro-batch: what
  ``DistributedSampler(num_replicas=N, rank=j)`` hands a data-parallel rank) and go through
  :func:`~galvatron_fx.runtime.reshard.plan_batched` to each reader's layout (a TP group's ranks
  all-gather their slices: token ids, small);
* batched activations (computed from graph inputs; batch on dim 0, sequence on dim 1) go through
  :func:`~galvatron_fx.runtime.reshard.plan_batched` from the producer's layout to the reader's;
* replicated values that need a gradient (tied weights) cross to another layout through
  :func:`~galvatron_fx.runtime.reshard.replicated`;
* a sequence-sharded graph output is gathered (``ctx.output_layout``: the output's layout, ``sp``
  off; under ``cp`` its sequence activations are gathered over the CP group, its batch slices stay
  where :meth:`~galvatron_fx.runtime.groups.Layout.batch_slices` says).

On a pipeline stage the values received from the previous stage are left alone here: the
stage-inputs pass (:mod:`.stage_boundaries`) rebuilds them from the boundary layout.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..ir import carries_batch, layer_module_name
from ..runtime import reshard
from ..runtime.groups import Layout
from .base import check
from .context import ContextPass
from .split_layers import layer_calls


class ReshardingPass(ContextPass):
    """See the module docstring."""

    needs_split = True
    name = "resharding"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        ctx, top = self.ctx, graph_module
        layouts, rank, graph = ctx.layouts(), ctx.rank, top.graph
        ctx.input_layout = ctx.boundary_layout()
        received = {cv.name: cv for cv in (ctx.stage_info.received if ctx.stage_info else [])}
        batched: dict[torch.fx.Node, bool] = {}
        producer: dict[torch.fx.Node, int | None] = {}
        for n in graph.nodes:
            if n.op == "placeholder":
                val = n.meta.get("val")
                cv = received.get(n.name)
                batched[n] = cv.batched if cv else isinstance(val, torch.Tensor) and val.dim() >= 1
                producer[n] = None
        cache: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}
        for i, call in sorted(layer_calls(top).items()):
            args = list(call.args)
            first = 1 if call.op == "call_function" else 0   # checkpoint_layer(mod, *inputs)
            orig = args[first:]
            for j in range(first, len(args)):
                a = args[j]
                if a.op == "placeholder" and a.name in received:
                    continue
                if (a, i) not in cache:
                    cache[(a, i)] = _reshard(graph, call, a, batched[a], producer[a], layouts, layouts[i], rank,
                                             ctx.input_layout, ctx.is_sequence(a))
                args[j] = cache[(a, i)]
            call.args = tuple(args)
            flags = batched_outputs(getattr(top, layer_module_name(i)), [batched[a] for a in orig])
            batched[call], producer[call] = (flags[0] if len(flags) == 1 else flags), i
            for u in call.users:
                if u.op == "call_function" and u.target is operator.getitem:
                    batched[u], producer[u] = flags[u.args[1]], i
        ctx.output_layout = self._gather_output(graph, batched, producer, layouts)
        top.recompile()
        return PassResult(top, True)

    def _gather_output(self, graph, batched, producer, layouts) -> Layout:
        out = next(n for n in graph.nodes if n.op == "output")
        last = max((producer.get(n) for n in out.all_input_nodes if producer.get(n) is not None),
                   default=len(layouts) - 1)
        src = layouts[last]
        final = Layout(src.tp, src.dp, False, src.base, cp=src.cp)
        if src.sp or src.cp > 1:
            rank = self.ctx.rank

            def fix(n):
                val = n.meta.get("val")
                if not (batched.get(n) and isinstance(val, torch.Tensor) and val.dim() >= 2):
                    return n
                if src.cp > 1:   # sequence shards gathered: the ranks of a CP group hold their batch slice whole
                    gather = reshard.sequence_steps(src, Layout(src.tp, src.dp, False, src.base), rank)[0]
                    return chain(graph, out, n, gather) if self.ctx.is_sequence(n) else n
                return chain(graph, out, n, reshard.plan_batched(src, final, rank))
            out.args = (torch.fx.node.map_arg(out.args[0], fix),)
        return final

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        check(self.ctx.output_layout is not None and not self.ctx.output_layout.sp,
              "resharding must leave the graph output with its sequence gathered")
        check(self.ctx.input_layout is not None and self.ctx.input_layout.size == self.ctx.stage_size,
              "resharding must record the input layout (over the stage's ranks)")


def _reshard(graph, call, a, is_batched, src_layer, layouts, dst: Layout, rank: int, inputs: Layout, seq: bool):
    if src_layer is None:  # a graph input: this rank's slice in the input layout
        return chain(graph, call, a, reshard.plan_batched(inputs, dst, rank, seq)) if is_batched else a
    src = layouts[src_layer]
    if is_batched:
        return chain(graph, call, a, reshard.plan_batched(src, dst, rank, seq))
    if seq:   # a whole-batch sequence activation (rotary cos / sin): only its sequence moves
        gather, take = reshard.sequence_steps(src, dst, rank)
        a = chain(graph, call, a, gather + take)
    if (src.tp, src.dp) == (dst.tp, dst.dp):
        return a
    with graph.inserting_before(call):
        return graph.call_function(reshard.replicated, (a, dst.dp_ranks(rank), src.dp))


def chain(graph: torch.fx.Graph, before: torch.fx.Node, a: torch.fx.Node, steps) -> torch.fx.Node:
    """Insert ``steps`` (``(fn, extra_args)`` pairs of :mod:`~galvatron_fx.runtime.reshard`) on
    ``a`` before ``before``; returns the last value."""
    for fn, extra in steps:
        with graph.inserting_before(before):
            a = graph.call_function(fn, (a, *extra))
    return a


def batched_outputs(layer: torch.fx.GraphModule, in_flags: list[bool]) -> list[bool]:
    """Which outputs of ``layer`` carry the batch dim: computed from a batched input."""
    flags: dict[torch.fx.Node, bool] = {}
    it = iter(in_flags)
    for n in layer.graph.nodes:
        if n.op == "placeholder":
            flags[n] = next(it)
        elif n.op == "get_attr":
            flags[n] = False
        elif n.op == "output":
            outs = n.args[0]
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            return [flags.get(o, False) if isinstance(o, torch.fx.Node) else False for o in outs]
        else:
            flags[n] = carries_batch(n) and any(flags.get(x, False) for x in n.all_input_nodes)
    return []
