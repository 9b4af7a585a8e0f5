"""Common base of galvatron_fx's graph passes (torch.fx.passes.infra conventions).

A pass has one job: ``requires(gm)`` checks its preconditions, ``call(gm)`` does the work and
returns ``PassResult(graph_module, modified)``, ``ensures(gm)`` checks the postconditions. Unlike
torch's ``PassBase.__call__``, :class:`GraphPass` runs ``ensures`` on the graph the pass *returns*,
since several of our passes build a new GraphModule rather than editing their input in place.
"""

from __future__ import annotations

import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult


class GraphPass(PassBase):
    def __call__(self, graph_module: torch.fx.GraphModule) -> PassResult:
        self.requires(graph_module)
        result = self.call(graph_module)
        self.ensures(result.graph_module)
        return result
