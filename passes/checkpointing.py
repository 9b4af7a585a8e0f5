"""Checkpointing pass: every ``ckpt`` layer runs under activation checkpointing.

Takes SPLIT (the top graph of :mod:`.split_layers`), leaves SPLIT: the ``call_module`` of each
layer whose plan entry has ``ckpt: true`` becomes ``checkpoint_layer(self.layers_<i>, *inputs)``
(:func:`galvatron_fx.runtime.checkpointing.checkpoint_layer`, non-reentrant), and of each with
``ckpt: "selective"`` ``selective_checkpoint_layer(...)`` (the outputs of matmuls and attention
kernels saved, the rest recomputed), of each with ``ckpt: "selective-op"``
``selective_op_checkpoint_layer(...)`` (every second linear matmul recomputed too), under the
call's old node name; other layers are untouched.

NOTE: it runs before the data-parallel pass, so the checkpoint wraps the whole layer including
its ZeRO-3 all-gather: backward recomputes with freshly gathered parameters instead of keeping
the gathered buffer alive.
"""

from __future__ import annotations

import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..runtime.checkpointing import RUNNERS
from .base import check
from .context import ContextPass
from .split_layers import layer_calls, run_layers_under


class CheckpointingPass(ContextPass):
    """See the module docstring."""

    needs_split = True
    name = "checkpointing"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        layers = self.ctx.stage_plan.layers
        modified = run_layers_under(graph_module, lambda i: RUNNERS[layers[i].ckpt] if layers[i].ckpt else None)
        return PassResult(graph_module, modified)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        for i, call in layer_calls(graph_module).items():
            ckpt = self.ctx.stage_plan.layers[i].ckpt
            runner = call.target if call.op == "call_function" else None
            check(runner is RUNNERS.get(ckpt), f"layer {i}: runs under {getattr(runner, '__name__', runner)} "
                  f"but the plan says ckpt={ckpt!r}")
