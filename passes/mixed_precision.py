"""Mixed-precision pass: every layer computes under autocast on low-precision inputs.

:class:`MixedPrecisionPass` takes SPLIT (after data parallelism, whose flat buffers already hold
the fp32 masters and the low-precision working copies: ``ctx.precision``) and leaves SPLIT. For a
mixed policy (``bf16-mixed`` / ``fp16-mixed``; nothing changes for fp32), in each layer graph:

* ``ac = enter_autocast(device_type, dtype)`` right after the placeholders and
  ``exit_autocast(ac, outputs)`` right before the output (a recomputed checkpointed layer enters
  it again: the calls are graph nodes);
* every floating-point placeholder is read through ``cast_input(x, dtype)``;
* every grouped expert matmul (a custom op autocast does not know; transformers casts its tokens
  to the weights' dtype *at capture*: fp32) runs as
  :func:`~galvatron_fx.runtime.experts.local_grouped_mm`, which casts them to the weights' dtype.

Under ``pp > 1`` every floating-point value sent to the next stage is cast too (inside its
``pass_on``), and the stage's crossing-value records (``ctx.stage_info.sent`` / ``received``) say
the compute dtype, so both ends of a p2p transfer agree on it. See
:mod:`galvatron_fx.runtime.precision` for the whole policy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..ir import StageInfo
from ..runtime.pipeline_stage import pass_on
from ..runtime.precision import cast_input, enter_autocast, exit_autocast
from .base import check
from .context import ContextPass
from .expert_parallel import as_local_grouped_mm
from .split_layers import layer_calls, route_outputs


class MixedPrecisionPass(ContextPass):
    """See the module docstring."""

    needs_split = True
    name = "mixed_precision"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        dtype = self.ctx.precision.compute_dtype
        if dtype is None:
            return PassResult(graph_module, False)
        device_type = _device_type(graph_module)
        for call in layer_calls(graph_module).values():
            autocast_layer(_layer_of(graph_module, call), device_type, dtype)
        info = self.ctx.stage_info
        if info is not None:
            _cast_sent(graph_module, dtype)
            self.ctx.stage_info = _retyped(info, dtype)
        graph_module.recompile()
        return PassResult(graph_module, True)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        if self.ctx.precision.compute_dtype is None:
            return
        for i, call in layer_calls(graph_module).items():
            layer = _layer_of(graph_module, call)
            check(any(n.target is enter_autocast for n in layer.graph.nodes),
                  f"layer {i} must run under autocast in a mixed-precision plan")


def autocast_layer(layer: torch.fx.GraphModule, device_type: str, dtype: torch.dtype) -> None:
    """Rewrite one layer graph in place (see the module docstring)."""
    graph = layer.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        ac = graph.call_function(enter_autocast, (device_type, dtype))
        for p in placeholders:
            val = p.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                cast = graph.call_function(cast_input, (p, dtype))
                p.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
                cast.meta = dict(p.meta)
    route_outputs(graph, exit_autocast, ac)
    as_local_grouped_mm(graph)
    graph.lint()
    layer.recompile()


def _layer_of(top: torch.fx.GraphModule, call: torch.fx.Node) -> torch.fx.GraphModule:
    """The layer submodule a layer call runs (``self.layers_i(...)`` or ``checkpoint_layer(self.layers_i, ...)``)."""
    return top.get_submodule(call.args[0].target if call.op == "call_function" else call.target)


def _device_type(top: torch.fx.GraphModule) -> str:
    """The device type the layers run on (their parameters' and buffers'; else the default device)."""
    for t in list(top.parameters()) + list(top.buffers()):
        if t.device.type != "meta":
            return t.device.type
    from ..distributed import pick_device

    return pick_device().type


def _cast_sent(top: torch.fx.GraphModule, dtype: torch.dtype) -> None:
    out = next(n for n in top.graph.nodes if n.op == "output")
    for node in out.args[0] if isinstance(out.args[0], (tuple, list)) else ():
        if isinstance(node, torch.fx.Node) and node.target is pass_on:
            (x,) = node.args
            with top.graph.inserting_before(node):
                node.args = (top.graph.call_function(cast_input, (x, dtype)),)


def _retyped(info: StageInfo, dtype: torch.dtype) -> StageInfo:
    """Crossing values that are floating point travel in the compute dtype."""
    def one(cv):
        return dataclasses.replace(cv, dtype=dtype) if cv.dtype.is_floating_point else cv

    return dataclasses.replace(info, sent=[one(cv) for cv in info.sent],
                               received=[one(cv) for cv in info.received])
