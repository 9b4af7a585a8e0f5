"""Parameter binding pass: the user's ``nn.Parameter`` objects -> views of this rank's storage.

Takes the ``DistributedModel`` of :mod:`.codegen` and a ``fqn -> nn.Parameter`` map of the
original model (the torch.compile backend's parameters, which an optimizer built from
``model.parameters()`` holds); leaves the model unchanged and re-points each parameter with
``param.data = view`` onto the distributed program's storage:

* ``sdp="none"``: a view of the layer's flat buffer, the whole (TP-local) parameter, shape kept;
* ZeRO-2/3: this rank's dim-0 slice of the parameter in its flat shard, 1-D (possibly empty);
* a trainable parameter this rank holds no part of (another pipeline stage): an empty tensor.

``optimizer.step()`` on the original parameters therefore updates the program's buffers in
place. The bindings (:class:`Binding`, with :meth:`Binding.grad` for the matching gradient view)
land in ``ctx.bindings`` and on the model as ``model.bindings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.infra.pass_base import PassResult

from ..runtime.module import DistributedModel
from .base import check
from .context import ContextPass, ParallelContext


@dataclass
class Binding:
    """Where one original parameter lives on this rank."""

    param: nn.Parameter
    store: Any          # the FlatParams holding it, or None (this rank holds none of it)
    lo: int = 0         # element range in store.flat_param
    hi: int = 0
    shape: tuple | None = None  # kept shape (sdp="none"), else 1-D

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        part = flat[self.lo:self.hi]
        return part.view(self.shape) if self.shape is not None else part

    def grad(self) -> torch.Tensor | None:
        """The view of this rank's gradient matching the bound parameter (None if there is none)."""
        if self.store is None:
            return None
        g = self.store.flat_param.grad
        return None if g is None else self.view(g)


def bind_parameters(stores, params: dict[str, nn.Parameter]) -> dict[str, Binding]:
    """Re-point each of ``params`` onto ``stores`` (see the module docstring); fqn -> Binding."""
    bindings: dict[str, Binding] = {}
    for store in stores:
        for i, (fqn, shape) in enumerate(zip(store.fqns, store.shapes)):
            p = params.get(fqn)
            if p is None:
                continue
            lo, hi = store.shard_span(i)
            bindings[fqn] = Binding(p, store, lo, hi, tuple(shape) if store.mode == "none" else None)
    for fqn, p in params.items():
        if fqn not in bindings and p.requires_grad:
            bindings[fqn] = Binding(p, None)  # e.g. a parameter of another pipeline stage
    with torch.no_grad():
        for b in bindings.values():
            b.param.data = b.view(b.store.flat_param.data) if b.store is not None else b.param.data.new_empty(0)
    return bindings


class BindParametersPass(ContextPass):
    """See the module docstring."""

    name = "bind_parameters"

    def __init__(self, ctx: ParallelContext, params: dict[str, nn.Parameter]):
        super().__init__(ctx)
        self.params = params

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        check(isinstance(graph_module, DistributedModel), "bind_parameters needs the DistributedModel (run codegen first)")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        self.ctx.bindings = bind_parameters(graph_module.stores, self.params)
        graph_module.bindings = self.ctx.bindings
        return PassResult(graph_module, False)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        for fqn, b in self.ctx.bindings.items():
            if b.store is not None:
                st = b.store.flat_param.untyped_storage().data_ptr()
                check(b.param.untyped_storage().data_ptr() == st,
                      f"parameter {fqn!r} must share its flat buffer's storage after binding")
