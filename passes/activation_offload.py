"""Activation offload pass: every ``act_offload`` layer's saved activations go to host memory.

Takes SPLIT (the top graph of :mod:`.split_layers`), leaves SPLIT: the ``call_module`` of each
layer whose plan entry has ``act_offload: true`` becomes ``offload_layer(self.layers_<i>,
*inputs)`` (:func:`galvatron_fx.runtime.activation_offload.offload_layer`) under the call's old
node name; other layers are untouched. Runs after the checkpointing pass (a layer is offloaded or
checkpointed, never both: the dimension refuses the pair) and before the data-parallel pass, so
the hooks see the layer's ZeRO-3 gather and leave its buffer alone.
"""

from __future__ import annotations

import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..runtime.activation_offload import offload_layer
from .base import check
from .context import ContextPass
from .split_layers import layer_calls, run_layers_under


class ActivationOffloadPass(ContextPass):
    """See the module docstring."""

    needs_split = True
    name = "activation_offload"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        layers = self.ctx.stage_plan.layers
        modified = run_layers_under(graph_module, lambda i: offload_layer if layers[i].value("act_offload") else None)
        return PassResult(graph_module, modified)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        for i, call in layer_calls(graph_module).items():
            if self.ctx.stage_plan.layers[i].value("act_offload"):
                check(call.op == "call_function" and call.target is offload_layer,
                      f"layer {i}: the plan offloads its activations but it runs as {call.op} {call.target}")
