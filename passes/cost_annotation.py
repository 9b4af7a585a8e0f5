"""Cost annotation pass: measure every distinct layer once and attach the cost model to the graph.

Input: a captured, layer-grouped GraphModule (``gm.meta["galvatron"].layers`` non-empty).
Output: the same GraphModule; ``gm.meta["galvatron"]`` gains two attributes (set dynamically, so
:mod:`galvatron_fx.ir` needs no new fields):

* ``costs``: one dict per layer (``layer``, ``signature``, FLOPs and bytes per sample as
  ``[a, c]`` affine fits in the per-device sample count, owned parameter elements ``params`` and
  how many of them TP at degree 2 shards, ``params_sharded_tp2``);
* ``cost_model``: the :class:`galvatron_fx.cost.CostModel` the search consumes.
"""

from __future__ import annotations

import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..cost import CostModel
from ..ir import META_KEY, GraphInfo
from .base import GraphPass, check


class CostAnnotationPass(GraphPass):
    """See the module docstring; keyword arguments go to :class:`CostModel`."""

    name = "cost_annotation"

    def __init__(self, cluster, **options):
        super().__init__()
        self.cluster, self.options = cluster, options

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        info = graph_module.meta.get(META_KEY)
        check(isinstance(info, GraphInfo) and bool(info.layers),
              "cost_annotation needs a layer-grouped graph: run gfx.capture (or LayerGroupingPass) first")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        cm = CostModel(graph_module, self.cluster, **self.options)
        info = graph_module.meta[META_KEY]
        info.cost_model = cm
        info.costs = [{"layer": rec.index, "signature": rec.signature,
                       "params": cm.layer_params(rec.index, 1).replicated,
                       "params_sharded_tp2": cm.layer_params(rec.index, 2).sharded,
                       **cm.measure(rec.index).to_dict()["fits"]} for rec in info.layers]
        return PassResult(graph_module, False)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        info = graph_module.meta[META_KEY]
        check(len(info.costs) == len(info.layers), "cost_annotation must price every layer")
