"""Token loss pass: a mean cross-entropy over non-ignored tokens becomes exact under any split.

HF causal / masked LM losses are ``cross_entropy(logits, labels, ignore_index=-100)`` with the
default ``reduction="mean"``: the mean over the tokens whose label is not ignored. Cut into DP
slices and micro-batches, a mean of per-slice means is *not* that mean once the slices hold
different numbers of ignored labels (padding), and neither are the gradients.

Takes GROUPED (the flat captured graph, before the stage split), leaves GROUPED with the loss
rewritten (on a copy: the input graph is not modified) when output 0 is such a loss::

    loss = cross_entropy(x, y, reduction="mean", ignore_index=i)
 -> loss = cross_entropy(x, y, reduction="sum", ignore_index=i) * galvatron_token_scale

``galvatron_token_scale`` is a 0-dim buffer the runtime sets to ``1 / N`` before each step, with
``N`` the number of non-ignored targets of the *whole global batch*, which every rank holds:
``ctx.token_count`` is a small GraphModule (the graph's own target computation, e.g. HF's label
shift, on the graph inputs) returning that count. Each rank's loss is then its share of the global
mean, so the DP sum of gradients and the sum of losses over ranks and micro-batches are exactly
single-device training's (see :class:`~galvatron_fx.runtime.module.TokenLoss`).

Left as they are (the runtime keeps its mean of means): losses that are not one cross-entropy
with ``reduction="mean"`` and no class ``weight`` (a weighted mean divides by the summed target
weights), and graphs whose targets depend on parameters. The fx / dynamo form
(``torch.nn.functional.cross_entropy``) and the export form (``aten.cross_entropy_loss``) are
recognised; label smoothing is kept (its mean is over the same tokens).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..ir import META_KEY, NodeInfo, ParamInfo
from ..runtime.module import TokenLoss
from ..sharding.losses import bind_cross_entropy
from .base import check
from .context import ContextPass
from .split_layers import fetch_attr, fresh_copy, is_param_node, is_split

SCALE_NAME = "galvatron_token_scale"
_SUM = 2   # at::Reduction (None = 0, Mean = 1)


def _mean_cross_entropy(node) -> tuple[torch.fx.Node, int] | None:
    """``(target node, ignore_index)`` when ``node`` is a mean cross-entropy without class weights."""
    ce = bind_cross_entropy(node)
    if ce is None or ce.weight is not None or ce.legacy or ce.reduction != "mean":
        return None
    return ce.target, ce.ignore_index


def _to_sum(node: torch.fx.Node) -> None:
    """Set the cross-entropy's reduction to a sum (keyword or positional, as the node has it)."""
    ce = bind_cross_entropy(node)
    (slot, key), value = ce.reduction_slot, _SUM if ce.aten else "sum"
    if len(node.args) > slot:
        node.args = (*node.args[:slot], value, *node.args[slot + 1:])
    else:
        node.kwargs = {**node.kwargs, key: value}


def _loss_output(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, int | None]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out.args[0]
    return out, (0 if isinstance(outs, (tuple, list)) else None)


def token_count_graph(gm: torch.fx.GraphModule, target: torch.fx.Node, ignore_index: int) -> torch.fx.GraphModule | None:
    """A GraphModule over all of ``gm``'s inputs returning ``(target != ignore_index).sum()``, made
    of the graph's own nodes computing ``target``; ``None`` if they read a parameter."""
    needed, todo = set(), [target]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        if is_param_node(n):
            return None
        needed.add(n)
        todo.extend(n.all_input_nodes)
    graph = torch.fx.Graph()
    env: dict = {}
    attrs = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
        elif n in needed:
            if n.op == "get_attr":
                attrs[n.target] = fetch_attr(gm, n.target)
            env[n] = graph.node_copy(n, lambda x: env[x])
    valid = graph.call_function(operator.ne, (env[target], ignore_index))
    graph.output(graph.call_method("sum", (valid,)))
    return torch.fx.GraphModule(attrs, graph, class_name="TokenCount")


class TokenLossPass(ContextPass):
    """See the module docstring. ``ctx.token_loss`` gets the :class:`TokenLoss` (count graph and
    scale buffer) when the loss is rewritten."""

    name = "token_loss"

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        check(not is_split(graph_module), "token_loss needs the flat captured graph (run it first)")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        if self.ctx.loss_fn is not None:   # the user computes the loss outside the graph
            return PassResult(graph_module, False)
        out, index = _loss_output(graph_module)
        loss = out.args[0][index] if index is not None else out.args[0]
        found = _mean_cross_entropy(loss)
        if found is None:
            return PassResult(graph_module, False)
        count = token_count_graph(graph_module, found[0], found[1])
        if count is None:
            return PassResult(graph_module, False)
        gm = fresh_copy(graph_module)
        out, _ = _loss_output(gm)
        ce = next(n for n in gm.graph.nodes if n.name == loss.name)
        val = ce.meta.get("val")
        device = val.device if isinstance(val, torch.Tensor) and val.device.type != "meta" else None
        scale = torch.ones((), dtype=torch.float32, device=device)
        gm.register_buffer(SCALE_NAME, scale)
        layer = ce.meta[META_KEY].layer
        with gm.graph.inserting_after(ce):
            attr = gm.graph.get_attr(SCALE_NAME)
            attr.meta = {"val": val.new_empty(()) if isinstance(val, torch.Tensor) else None,
                         META_KEY: NodeInfo(layer=layer, param=ParamInfo(SCALE_NAME, (), torch.float32,
                                                                         is_param=False, requires_grad=False))}
        with gm.graph.inserting_after(attr):
            scaled = gm.graph.call_function(operator.mul, (ce, attr))
        scaled.meta = {"val": val, META_KEY: NodeInfo(module_path=ce.meta[META_KEY].module_path, layer=layer)}
        ce.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
        _to_sum(ce)
        gm.recompile()
        self.ctx.token_loss = TokenLoss(count, scale)
        return PassResult(gm, True)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        if self.ctx.token_loss is None:
            return
        out, index = _loss_output(graph_module)
        loss = out.args[0][index] if index is not None else out.args[0]
        check(loss.target is operator.mul and loss.args[1].target == SCALE_NAME,
              "token_loss must leave the graph's loss as cross_entropy(sum) * galvatron_token_scale")
