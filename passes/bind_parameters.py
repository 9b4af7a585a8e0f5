"""Parameter binding pass: every original parameter -> a :class:`~galvatron_fx.runtime.params.ShardedParameter`
view of this rank's part in the flat buffers, under its original name.

Takes the ``DistributedModel`` of :mod:`.codegen` (its stores: every parameter of the stage, trainable
and frozen, lives in one) and optionally ``fqn -> nn.Parameter`` of the user's model (the torch.compile
backend's parameters, which an optimizer built from ``model.parameters()`` holds). Leaves the model
with a :class:`~galvatron_fx.runtime.params.ParamRegistry` (``model.params``) whose entries
``named_parameters()`` yields: new ``ShardedParameter`` objects, or, given the user's parameters,
those very objects with their class changed in place and ``.data`` re-pointed at the views (see
:mod:`galvatron_fx.runtime.params`). A user parameter this rank holds no part of (another pipeline
stage's) becomes an empty tensor once every chunk of the rank is built (:func:`release_unheld`,
called by :func:`galvatron_fx.parallelize.transform`). ``optimizer.step()`` on these parameters updates the buffers in
place; after each step's backward they hold their gradient views.

Each parameter's ``slot`` is its position among the parameters of the *whole* model
(``ctx.param_fqns``, every stage's), the index of the norm reduction (:mod:`galvatron_fx.runtime.grad_norm`).
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn
from torch.fx.passes.infra.pass_base import PassResult

from ..runtime.module import DistributedModel
from ..runtime.params import ParamRegistry, ParamSpec, ShardedParameter
from ..sharding import full_shape
from .base import check
from .context import ContextPass, ParallelContext


def build_registry(ctx: ParallelContext, stores, user: dict[str, nn.Parameter] | None) -> ParamRegistry:
    """The registry of ``stores`` (see the module docstring)."""
    slots = {fqn: i for i, fqn in enumerate(ctx.param_fqns)}
    device = stores[0].device if stores else torch.device("cpu")
    stage = tuple(range(ctx.base, ctx.base + ctx.stage_size))
    # NOTE: a loop's experts split over EP ranks are, like other stages' parameters, held elsewhere:
    # the norms then add what other ranks asked for
    registry = ParamRegistry(ctx.rank, max(len(slots), 1), ctx.plan.pp > 1 or bool(ctx.held_experts), device, stage)
    registry.elsewhere = {f for f, held in ctx.held_experts.items() if not held}
    user = user or {}
    for store in stores:
        for i, (fqn, shape) in enumerate(zip(store.fqns, store.shapes)):
            shard = ctx.tp_shards.get(fqn, (None, ()))[0]
            global_shape = full_shape(shape, shard)
            if fqn not in slots:   # NOTE: a graph made without gfx.capture's records: slots of its own
                slots[fqn] = len(slots)
                registry.slots = len(slots)
            spec = ParamSpec(fqn, store, i, shard, global_shape, slots[fqn], registry)
            registry.add(spec, user.get(fqn))
    return registry


def release_unheld(user: dict[str, nn.Parameter] | None, held) -> None:
    """Empty the user's trainable parameters this rank holds no part of (other pipeline stages'),
    once all of this rank's chunks are bound (a chunk's graph may still read another's)."""
    for fqn, p in (user or {}).items():
        if fqn not in held and p.requires_grad and not isinstance(p, ShardedParameter):
            with torch.no_grad():
                p.data = p.data.new_empty(0)


class BindParametersPass(ContextPass):
    """See the module docstring."""

    name = "bind_parameters"

    def __init__(self, ctx: ParallelContext, params: dict[str, nn.Parameter] | None = None):
        super().__init__(ctx)
        self.params = params

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        check(isinstance(graph_module, DistributedModel), "bind_parameters needs the DistributedModel (run codegen first)")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph_module.params = build_registry(self.ctx, graph_module.stores, self.params)
        return PassResult(graph_module, False)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        registry = graph_module.params
        held = {f for s in graph_module.stores for f in s.fqns}
        check(set(registry.params) == held, "bind_parameters must expose every parameter of the stage once")
        for fqn, p in registry.named():
            check(isinstance(p, ShardedParameter), f"parameter {fqn!r} is not a ShardedParameter")
            check(p.untyped_storage().data_ptr() == p._gfx.store.flat_param.untyped_storage().data_ptr(),
                  f"parameter {fqn!r} must share its flat buffer's storage")
