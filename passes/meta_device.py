"""Meta-device pass: a graph captured from a model on the meta device -> ops that create tensors on this process's device.

Takes SPLIT, leaves SPLIT (in place, the last rewrite before codegen): dynamo and export bake the
capture's device into the graph (``torch.arange(..., device=meta)`` for positions, ``torch.full``
for causal masks, ``x.to(meta)``), which would run on the meta device at run time. Every
``torch.device`` / device string naming ``meta`` in an op's arguments, in the top graph, every
layer graph and the token-loss count graph, becomes this process's device (the flat buffers',
:func:`galvatron_fx.distributed.pick_device`). A graph captured on a real device is left unchanged
(``modified=False``). NOTE: last, because the passes before it propagate fake tensors over the
graph with the meta-device parameters, which a real device beside them would break. Parameters
are not touched here: the data-parallel pass gives them empty buffers on that device and
:mod:`galvatron_fx.runtime.materialize` fills this rank's parts.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..distributed import pick_device
from .base import check
from .context import ContextPass

_META = torch.device("meta")


def _is_meta(value) -> bool:
    return (isinstance(value, torch.device) and value.type == "meta") or value == "meta"


def _names_meta(node: torch.fx.Node) -> bool:
    found = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), lambda v: found.append(v) if _is_meta(v) else v)
    return bool(found)


def _graphs(self_ctx, graph_module: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    out = [m for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    if self_ctx.token_loss is not None:
        out.append(self_ctx.token_loss.count)
    return out


class MetaDevicePass(ContextPass):
    """See the module docstring."""

    needs_split = True
    name = "meta_device"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        device, modified = None, False
        for gm in _graphs(self.ctx, graph_module):
            nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and _names_meta(n)]
            if not nodes:
                continue
            device = device or pick_device()
            for n in nodes:
                n.args, n.kwargs = torch.fx.node.map_aggregate(
                    (n.args, n.kwargs), lambda v: device if _is_meta(v) else v)
            gm.recompile()
            modified = True
        return PassResult(graph_module, modified)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        left = [n.name for gm in _graphs(self.ctx, graph_module) for n in gm.graph.nodes
                if n.op in ("call_function", "call_method") and _names_meta(n)]
        check(not left, f"ops still create tensors on the meta device: {left[:5]}")
