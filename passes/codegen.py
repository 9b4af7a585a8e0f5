"""Codegen pass: the rewritten top graph -> this rank's :class:`~galvatron_fx.runtime.module.DistributedModel`.

Takes SPLIT after every rewrite, leaves a ``DistributedModel`` (a GraphModule with
``train_step``), built from the top graph and set up with what the passes before it recorded in
the context: the stage plan, the DP/ZeRO stores, the output layout and the TP shards. Its
``meta["galvatron"]`` is the (stage's) :class:`~galvatron_fx.ir.GraphInfo`. For ``pp > 1`` the
transform wraps it in a :class:`~galvatron_fx.runtime.pipeline.PipelineModel`.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..ir import META_KEY
from ..runtime.module import DistributedModel
from .base import check
from .context import ContextPass


class CodegenPass(ContextPass):
    """See the module docstring."""

    needs_split = True
    name = "codegen"

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        super().requires(graph_module)
        check(self.ctx.output_layout is not None, "codegen needs the output layout (run resharding first)")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        ctx = self.ctx
        name = "GalvatronDistributed" if ctx.plan.pp == 1 else f"GalvatronStage{ctx.chunk_index}"
        model = DistributedModel(graph_module, graph_module.graph, class_name=name)
        model.meta[META_KEY] = graph_module.meta[META_KEY]
        model.setup(ctx.stage_plan, ctx.rank, ctx.loss_fn, ctx.output_layout, ctx.stores, ctx.tp_shards,
                    ctx.token_loss, ctx.precision, ctx.input_layout)
        model.symbolic_batch = ctx.symbolic_batch
        return PassResult(model, True)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        check(isinstance(graph_module, DistributedModel), "codegen must return a DistributedModel")
        left = [name for name, _ in torch.nn.Module.named_parameters(graph_module)]
        check(not left, f"every parameter of the distributed module must live in a flat buffer, not {left[:3]}")
