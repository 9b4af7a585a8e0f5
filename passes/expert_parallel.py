"""Expert-parallel pass: each experts block of an ``ep > 1`` layer runs on this rank's experts.

Takes SPLIT (after :mod:`.local_batch`, so the block's sizes are this rank's), leaves SPLIT. For
every layer whose plan entry has ``ep > 1`` and every experts block in it
(:func:`galvatron_fx.sharding.experts.moe_blocks`):

* the block's nodes move into a GraphModule of their own (inputs: tokens, top-k ids, top-k
  weights, expert weights, sizes), each grouped matmul there becoming
  :func:`~galvatron_fx.runtime.experts.local_grouped_mm`; the layer calls it through an
  :class:`~galvatron_fx.runtime.experts.ExpertParallel` submodule ``experts_<j>`` (dispatch:
  ``ctx.expert_dispatch``);
* each expert weight ``[E, ...]`` becomes this rank's ``[E / ep, ...]`` slice (a new
  ``nn.Parameter`` under the same name, ``requires_grad`` kept), recorded as a dim-0 shard over the
  EP group (``ShardInfo`` in ``ctx.tp_shards``: gathering, norms and checkpoints treat it like a
  TP shard) and in ``ctx.expert_params`` (the data-parallel pass reduces its gradient over the
  ranks holding the same experts).

Expert tensor parallelism (``lp.expert_tp``, grouped blocks): the tensor-parallel pass has sharded
each expert weight along its FFN width and put its collectives inside the block (``f`` before the
column-parallel grouped matmul, the all-reduce after the row-parallel one); the block carries them
along, :class:`ExpertParallel` runs every TP rank on the same dispatched tokens (no token split)
and each rank keeps ``[E / ep, F / tp, ...]``: a nested ``ShardInfo`` (dim 0 over the EP group,
inner the TP shard) over :meth:`~galvatron_fx.runtime.groups.Layout.expert_ranks`, its gradient
reduced over the ranks holding the same slice.

A loop-form block (``kind="loop"``: an unrolled loop over a module list of experts) runs the same
way, its GraphModule holding only this rank's iterations (experts ``[e * E / ep, (e + 1) * E / ep)``,
renumbered from 0; the expert mask gets one more class, the sentinel's). The other experts'
parameters leave the rank: their ``get_attr`` nodes and attributes are removed, so no buffer,
state dict or optimizer here sees them. This rank's are whole parameters under their own names,
recorded in ``ctx.expert_params`` (reduced over the ranks holding the same experts) and with
``ctx.held_experts`` (every split loop expert's fqn -> whether this rank holds it: where
``full_state_dict`` and the norms look for the others).

A layer with ``ep > 1`` and no experts block keeps running as planned (``ep`` does not apply to
it; the plan's explanation says so); a block that cannot be split raises with the reason.
"""

from __future__ import annotations

import logging

import torch
import torch.fx
from torch import nn
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import ConfigError
from ..ir import ShardInfo, layer_module_name, node_info
from ..runtime import tp_ops
from ..runtime.experts import ExpertParallel, local_grouped_mm, op_key
from ..runtime.groups import Layout, group
from ..sharding.experts import MoEBlock, NotAnExpertsBlock, moe_blocks
from ..sharding.operands import GROUPED_MM
from ..sharding.state import op_name, set_arg
from .context import ContextPass
from .tensor_parallel import TOKENS_KEY, _set_param

log = logging.getLogger(__name__)


class ExpertParallelPass(ContextPass):
    """See the module docstring."""

    needs_split = True
    name = "expert_parallel"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        ctx, modified = self.ctx, False
        for i, lp in enumerate(ctx.stage_plan.layers):
            if lp.ep == 1:
                continue
            layer = getattr(graph_module, layer_module_name(i))
            blocks = moe_blocks(layer.graph)
            if not blocks:
                log.info("layer %s: ep=%d does not apply (no experts block)", lp.name, lp.ep)
                continue
            if ctx.holds_whole_batch(i):
                raise ConfigError(f"layer {lp.name}: ep={lp.ep} on a layer mixing the samples of a batch is not "
                                  "supported; use ep=1 there")
            lay = Layout(lp.tp, lp.dp, lp.sp, ctx.base, lp.ep, etp=lp.expert_tp)
            for j, b in enumerate(blocks):
                if isinstance(b, NotAnExpertsBlock):
                    raise ConfigError(f"layer {lp.name}: ep={lp.ep} cannot split its experts: {b}; use ep=1")
                if b.num_experts % lp.ep:
                    raise ConfigError(f"layer {lp.name}: its {b.num_experts} experts do not divide by ep={lp.ep}; "
                                      f"use an ep dividing {b.num_experts}")
                self._rewrite(layer, b, j, lay, i)
            layer.graph.lint()
            layer.recompile()
            modified = True
        return PassResult(graph_module, modified)

    def _rewrite(self, layer: torch.fx.GraphModule, b: MoEBlock, j: int, lay: Layout, i: int) -> None:
        ctx, rank = self.ctx, self.ctx.rank
        ep_ranks = lay.ep_ranks(rank)
        ep_index = ep_ranks.index(rank)
        # NOTE: TP ranks holding the same tokens split them (sequence-parallel shards are apart
        # already; under expert TP every TP rank computes its width slice of all of them)
        etp = lay.etp and b.kind == "grouped"
        tp = lay.tp if b.x.meta.get(TOKENS_KEY, "replicated") == "replicated" and not etp else 1
        tp_key = tp_ops.register_group(group(lay.tp_ranks(rank)), lay.tp) if tp > 1 else None
        per = b.num_experts // lay.ep
        lo = ep_index * per
        mine = range(lo, lo + per)
        inputs = b.inputs if b.kind == "grouped" else [
            b.x, b.index, b.weights, *(p for e in mine for p in b.loop.params[e]), *b.sizes]
        block = _extract(b) if b.kind == "grouped" else _extract_loop(b, inputs, lo, per)
        module = ExpertParallel(block, b.num_experts, ep_ranks, ep_index, group(ep_ranks),
                                ctx.stage_plan.layers[i].extra.get("ep_dispatch", "allgather"), tp,
                                lay.tp_index(rank), tp_key, sizes=len(b.sizes),
                                compact=ctx.symbolic_batch and b.compactable())
        name = f"experts_{j}"
        layer.add_module(name, module)
        graph = layer.graph
        order = {n: k for k, n in enumerate(graph.nodes)}
        last_input = max((a for a in inputs if a.op != "get_attr"), key=order.__getitem__)
        with graph.inserting_after(last_input):
            call = graph.call_module(name, tuple(inputs))
        for a in inputs:   # NOTE: a loop's expert weights are read (get_attr) where its iteration began
            if a.op == "get_attr" and order[a] > order[last_input]:
                call.prepend(a)
        call.meta = dict(b.output.meta)
        if any(order[u] < order[last_input] for u in b.output.users):
            raise ConfigError(f"internal: the experts block {b.path} is used before all its inputs exist")
        b.output.replace_all_uses_with(call)
        for n in reversed(b.nodes):
            graph.erase_node(n)
        fqns = ctx.expert_params.setdefault(i, set())
        if b.kind == "loop":
            for e, params in enumerate(b.loop.params):
                for p in params:
                    ctx.held_experts[p.target] = e in mine
                    if e in mine:
                        fqns.add(p.target)
                    else:   # another EP rank's expert: it does not exist here
                        owner, _, attr = p.target.rpartition(".")
                        delattr(layer.get_submodule(owner), attr)
                        graph.erase_node(p)
            return
        for p in b.params:
            full = layer.get_parameter(p.target)
            with torch.no_grad():
                local = full.detach()[lo:lo + per].clone()
            _set_param(layer, p.target, nn.Parameter(local, requires_grad=full.requires_grad))
            inner = node_info(p).shard if etp else None   # the TP shard along the width
            if etp and inner is None:
                raise ConfigError(f"layer {ctx.stage_plan.layers[i].name}: expert tensor parallelism left "
                                  f"{p.target} whole over tp={lay.tp}; set the layer's extra expert_tp to false")
            shard = ShardInfo(0, lay.ep, ep_index, (b.num_experts,), inner)
            node_info(p).shard = shard
            ctx.tp_shards[p.target] = (shard, lay.expert_ranks(rank) if etp else ep_ranks)
            fqns.add(p.target)
            if "val" in p.meta:
                p.meta["val"] = p.meta["val"][lo:lo + per]


def _extract(b: MoEBlock) -> torch.fx.GraphModule:
    """The block's nodes as a GraphModule of its inputs (:attr:`MoEBlock.inputs`), each grouped
    matmul computing only this rank's experts."""
    g = torch.fx.Graph()
    env = _placeholders(g, b.inputs)
    for n in b.nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[b.output])
    as_local_grouped_mm(g)
    return torch.fx.GraphModule(nn.Module(), g, class_name="ExpertsBlock")


def _placeholders(g: torch.fx.Graph, inputs) -> dict[torch.fx.Node, torch.fx.Node]:
    """The block's inputs as placeholders: ``x, index, weights``, then under their own names."""
    env = {}
    for k, a in enumerate(inputs):
        env[a] = g.placeholder(f"{('x', 'index', 'weights')[k]}" if k < 3 else a.name)
        env[a].meta = dict(a.meta)
    return env


def _extract_loop(b: MoEBlock, inputs, lo: int, per: int) -> torch.fx.GraphModule:
    """A loop-form block as a GraphModule of ``inputs`` (this rank's experts' parameters only)
    running experts ``[lo, lo + per)`` as ``0 .. per-1`` (the ids :class:`ExpertParallel` hands
    it), the other iterations dropped; the mask's extra class ``E`` holds the sentinel."""
    loop, g = b.loop, torch.fx.Graph()
    env = _placeholders(g, inputs)
    dropped = {n for e, it in enumerate(loop.iterations) if not lo <= e < lo + per for n in it}
    skip = {u: e for e, u in enumerate(loop.accumulate) if not lo <= e < lo + per}
    for n in b.nodes:
        if n in dropped:
            continue
        if n in skip:   # another rank's expert adds nothing here: the running sum goes on
            env[n] = env[n.args[0]]
            continue
        env[n] = g.node_copy(n, env.__getitem__)
        if n is loop.one_hot:
            set_arg(env[n], (1,) if len(n.args) > 1 else ("num_classes",), b.num_experts + 1)
        elif n in loop.selectors:
            e = loop.selectors.index(n)
            set_arg(env[n], (1,) if op_name(n) == "getitem" else (2,), e - lo)
    g.output(env[b.output])
    return torch.fx.GraphModule(nn.Module(), g, class_name="ExpertsLoop")


def as_local_grouped_mm(graph: torch.fx.Graph) -> None:
    """Every grouped matmul of ``graph`` as :func:`~galvatron_fx.runtime.experts.local_grouped_mm`:
    the groups its weight holds (this rank's experts), tokens cast to the weight's dtype (a
    mixed-precision working copy; the mixed-precision pass runs every layer's through it)."""
    for n in list(graph.nodes):
        if n.op == "call_function" and op_name(n) in GROUPED_MM and len(n.args) >= 2:
            with graph.inserting_before(n):
                new = graph.call_function(local_grouped_mm, (op_key(n.target), *n.args), dict(n.kwargs))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            graph.erase_node(n)
