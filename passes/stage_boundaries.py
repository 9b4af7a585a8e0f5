"""Stage boundary passes (pp > 1): values cross pipeline stages in one fixed layout.

Boundary layout. A batched value crossing a stage boundary travels in the layout
``Layout(tp=1, dp=N)`` of both stages (``ctx.boundary_layout()``; ``Layout(k, N / k)`` when a
micro-batch has fewer samples than the stage has ranks, context parallelism): local rank ``j`` of stage ``k``
holds batch slice ``j`` of ``N`` of the micro-batch and sends it to local rank ``j`` of stage
``k+1`` (one p2p group per ``j``: ranks ``{j, N+j, 2N+j, ...}``), so each rank sends ``1/N`` of the
micro-batch, whatever the layers on either side do. Replicated values (a tied weight, T5's
position bias) are sent whole; their gradient is summed over the consumer's DP group and divided
by the producer's ``dp`` (:func:`~galvatron_fx.runtime.reshard.replicated`), so the producer's own
DP reduction adds every use once. Graph inputs (e.g. the last stage's labels) are never sent:
every rank gets the whole global batch in ``train_step``.

* :class:`StageOutputsPass` (SPLIT -> SPLIT, before data parallelism): values sent to the next
  stage leave in the boundary layout (batched) or whole (replicated); every sent value goes
  through :func:`~galvatron_fx.runtime.pipeline.pass_on` (a contiguous tensor that is not a stage
  input).
* :class:`StageInputsPass` (SPLIT -> SPLIT, after resharding): every read of a received value is
  rebuilt from the boundary layout (batched) or wrapped in ``replicated``; then the layer
  submodules are renamed ``layers_<global index>`` so the stage's code names the plan's layers.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..ir import layer_module_name
from ..runtime import reshard
from ..runtime.pipeline_stage import pass_on
from .base import check
from .context import ContextPass
from .resharding import chain
from .split_layers import layer_calls


class _StagePass(ContextPass):
    needs_split = True

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        check(self.ctx.stage_info is not None, f"{self.name} needs a pipeline stage (run stage_split first)")
        super().requires(graph_module)


class StageOutputsPass(_StagePass):
    """See the module docstring."""

    name = "stage_outputs"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        info, ctx = self.ctx.stage_info, self.ctx
        if info.is_last:
            return PassResult(graph_module, False)
        layouts, boundary, graph = ctx.layouts(), ctx.boundary_layout(), graph_module.graph
        out = next(x for x in graph.nodes if x.op == "output")
        new = []
        for node, cv in zip(out.args[0], info.sent):
            x = node
            src = layouts[cv.producer_layer - info.first] if node.op != "placeholder" else None
            if src is not None and cv.batched:
                x = chain(graph, out, x, reshard.plan_batched(src, boundary, ctx.rank, ctx.is_sequence(node)))
            elif src is not None and ctx.is_sequence(node):   # rotary tables: their sequence only
                x = chain(graph, out, x, reshard.sequence_steps(src, boundary, ctx.rank)[0])
            with graph.inserting_before(out):
                new.append(graph.call_function(pass_on, (x,)))
        out.args = (tuple(new),)
        graph_module.recompile()
        return PassResult(graph_module, True)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        if self.ctx.stage_info.is_last:
            return
        out = next(x for x in graph_module.graph.nodes if x.op == "output")
        check(all(isinstance(x, torch.fx.Node) and x.target is pass_on for x in out.args[0]),
              "every value sent to the next stage must leave through pass_on")


class StageInputsPass(_StagePass):
    """See the module docstring."""

    name = "stage_inputs"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        ctx, info, top = self.ctx, self.ctx.stage_info, graph_module
        received = {cv.name: cv for cv in info.received}
        layouts, boundary, graph = ctx.layouts(), ctx.boundary_layout(), top.graph
        cache: dict = {}
        for i, call in sorted(layer_calls(top).items()):
            args = list(call.args)
            for j, p in enumerate(args):
                if not (isinstance(p, torch.fx.Node) and p.op == "placeholder" and p.name in received):
                    continue
                if (p, i) not in cache:
                    cv = received[p.name]
                    if cv.batched:
                        x = chain(graph, call, p, reshard.plan_batched(boundary, layouts[i], ctx.rank,
                                                                       ctx.is_sequence(p)))
                    else:
                        x = p
                        if ctx.is_sequence(p):   # rotary tables: their sequence only
                            x = chain(graph, call, p, reshard.sequence_steps(boundary, layouts[i], ctx.rank)[1])
                        with graph.inserting_before(call):
                            x = graph.call_function(reshard.replicated, (
                                x, layouts[i].dp_ranks(ctx.rank), ctx.plan.layers[cv.producer_layer].dp))
                    cache[(p, i)] = x
                args[j] = cache[(p, i)]
            call.args = tuple(args)
        _rename_layers(top, info.first)
        return PassResult(top, True)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        info = self.ctx.stage_info
        names = sorted(int(n.split("_")[1]) for n, _ in graph_module.named_children() if n.startswith("layers_"))
        check(names == list(range(info.first, info.last + 1)),
              f"stage {info.index} must hold layers_{info.first}..layers_{info.last}, holds {names}")


def _rename_layers(top: torch.fx.GraphModule, first: int) -> None:
    """``layers_<local>`` -> ``layers_<global index>`` so the stage's code names the plan's layers."""
    if first == 0:
        return
    count = sum(1 for name, _ in top.named_children() if name.startswith("layers_"))
    for i in reversed(range(count)):
        mod = getattr(top, layer_module_name(i))
        delattr(top, layer_module_name(i))
        top.add_submodule(layer_module_name(first + i), mod)
    for x in reversed(list(top.graph.nodes)):
        if x.op in ("call_module", "get_attr") and x.target.startswith("layers_"):
            x.target = layer_module_name(first + int(x.target.split("_")[1]))
            if x.op == "call_module" or x.name.startswith("layers_"):
                x._rename(x.target)
    top.recompile()
