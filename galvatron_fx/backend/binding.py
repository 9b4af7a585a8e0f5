"""Parameter binding and the runtime callable of the galvatron backend (steps 4 and 5 of the
package docstring).

Takes this rank's ``DistributedModel`` (from :func:`galvatron_fx.parallelize.transform`), the
plan, the placeholder roles and dynamo's example inputs; gives :class:`_Runtime`, the callable the
backend returns. The ``bind_parameters`` pass of :func:`~galvatron_fx.parallelize.transform` has
turned every original ``nn.Parameter`` into a :class:`~galvatron_fx.runtime.params.ShardedParameter`
view of the distributed program's storage (``dm.params``); each call runs ``train_step`` and
returns the loss through :class:`_RouteGrads`, whose backward hands each parameter its gradient
view (times the incoming gradient). Also gives :func:`_remove_guards` (dynamo's guards on the graph's
placeholders), and :func:`distributed_model` / :func:`full_state_dict` to reach the program behind
a compiled model afterwards (via ``_RUNTIMES``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.fx

from ..errors import ConfigError
from ..ir import META_KEY
from .graph import Recaptured, _Role

_RUNTIMES: dict[int, weakref.ref] = {}  # id(original Parameter) -> its _Runtime


class _RouteGrads(torch.autograd.Function):
    """``loss`` in forward; in backward each original parameter gets its gradient view of this
    rank's buffers, scaled by the incoming gradient (added to a gradient it holds already), set as
    ``param.grad`` directly: autograd's own accumulation would store a plain copy, not the
    :class:`~galvatron_fx.runtime.params.ShardedGrad` whose norm is the whole parameter's."""

    @staticmethod
    def forward(ctx, loss, registry, *params):
        ctx.registry, ctx.n = registry, len(params)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, g):
        ctx.registry.attach_grads(scale=g)
        return (None, None, *[None] * ctx.n)


class _BuiltAtFirstCall:
    """The backend's callable when the plan is measured: ``build()`` (plan, program, parameters)
    runs at the first call, outside dynamo's compile, with gradients on (the candidates train);
    then every call goes to the :class:`_Runtime` it returned."""

    def __init__(self, build) -> None:
        self.build, self.runtime = build, None

    def __call__(self, *args):
        if self.runtime is None:
            with torch.enable_grad():
                self.runtime = self.build()
            self.build = None
        return self.runtime(*args)


class _Runtime:
    """The callable the backend returns (see the package docstring, steps 4 and 5)."""

    def __init__(self, dm, roles, example_inputs, graph: Recaptured):
        self.dm, self.plan, self.roles = dm, dm.plan, roles
        module = graph.module
        self.module = weakref.ref(module) if module is not None else None   # for its .training flag
        self.warned = set()
        self.data_pos = graph.data_pos     # the distributed program's inputs, as dynamo's placeholders
        self.out_pos = graph.out_pos       # dynamo's outputs, as the program's (None: not an output of it)
        self.symbolic = graph.graph.meta[META_KEY].symbolic_batch
        self.input_meta = [(tuple(example_inputs[i].shape), example_inputs[i].dtype) for i in self.data_pos]
        self.tuple_out = graph.tuple_out
        stage = getattr(dm, "stage", dm)
        stage.grads_after_step = False   # _RouteGrads hands them out in loss.backward()
        self.registry = stage.params     # by the bind_parameters pass (galvatron_fx/passes/bind_parameters.py)
        self.param_pos = [i for i, r in enumerate(roles)
                          if r.kind == "param" and r.name in self.registry.params and example_inputs[i].requires_grad]
        self.calls = 0
        for p in self.registry.params.values():
            _RUNTIMES[id(p)] = weakref.ref(self)

    def __call__(self, *args):
        data = [args[i] for i in self.data_pos]
        size = self.dm.input_shard[1]
        for t, (shape, dtype), i in zip(data, self.input_meta, self.data_pos):
            # NOTE: the whole global batch, or this rank's shard of it (dm.input_shard); any number
            # of samples when the batch is symbolic (train_step names the sizes it can split)
            shard = shape[:1] and (shape[0] // size, *shape[1:])
            ok = tuple(t.shape[1:]) == shape[1:] if self.symbolic and shape else tuple(t.shape) in (shape, shard)
            if not ok or t.dtype != dtype:
                raise ConfigError(
                    f"galvatron: input {self.roles[i].name!r} is {tuple(t.shape)} {t.dtype}, but the model was "
                    + (f"compiled for [batch, {', '.join(map(str, shape[1:]))}] {dtype}; the distributed program is "
                       "specialised to these other dims: keep them fixed (pad) or compile a fresh model"
                       if self.symbolic and shape else
                       f"compiled for {shape} {dtype} (or this rank's shard, {shard}); the distributed program "
                       "is specialised to one global batch shape (dynamo's graph, kept because the model could "
                       "not be captured with a symbolic batch): keep it fixed or compile a fresh model"))
        self.calls += 1
        module = self.module() if self.module is not None else None
        if not torch.is_grad_enabled() or (module is not None and not module.training):
            return self._evaluate(data)
        loss = self.dm.train_step(*data)
        params = [args[i] for i in self.param_pos]
        loss = _RouteGrads.apply(loss, self.registry, *params)
        if len(self.out_pos) > 1:
            self._warn_once("train", "a training call returns the loss only; the model's other outputs (logits, ...) "
                            "are None (they are not materialised across ranks). Call the model under "
                            "torch.no_grad() or model.eval() to get them")
        outs = [loss if k == 0 else None for k in self.out_pos]
        return tuple(outs) if self.tuple_out else outs[0]

    def _evaluate(self, data):
        """Forward only: the loss and the real outputs, assembled across ranks (``eval_step``)."""
        loss, outs = self.dm.eval_step(*data, return_outputs=True)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        if None in self.out_pos:
            self._warn_once("eval", f"{self.out_pos.count(None)} output(s) of torch.compile's graph (e.g. a KV cache "
                            "object's tensors) are not outputs of the distributed program and are None")
        result = [loss if k == 0 else None if k is None else outs[k] for k in self.out_pos]
        return tuple(result) if self.tuple_out else result[0]

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"galvatron backend: {msg}", stacklevel=3)


def _remove_guards(gm: torch.fx.GraphModule, roles: list[_Role]) -> None:
    """Drop dynamo's guards on the graph's parameters, buffers and inputs (see package docstring)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is None:
        return
    guards = ctx.guards_context.dynamo_guards
    for role in roles:
        if role.source is not None:
            guards.remove_guards_with_source(role.source)
    # NOTE: grad mode (the global-state guard) and the modules' ``training`` flags are read by
    # the runtime at each call (train vs eval), so a switch to eval must not re-trace the model
    # over its re-pointed parameter shards.
    drop = [g for g in guards.inner if getattr(g.create_fn, "__name__", "") == "GLOBAL_STATE"
            or _is_training_flag(g.name)]
    if drop:
        guards.inner = type(guards.inner)(g for g in guards.inner if g not in drop)
        guards.source_to_guards.clear()
        for g in guards.inner:
            guards.track_guard_by_source(g)


def _is_training_flag(source_name: str) -> bool:
    return source_name.endswith(".training") or source_name.endswith("['training']")


def distributed_model(model_or_param) -> Any:
    """The ``DistributedModel`` behind a model compiled with this backend (after its first call),
    e.g. for ``full_state_dict()`` or ``states_bytes(optimizer)``; ``None`` if there is none."""
    params = [model_or_param] if isinstance(model_or_param, torch.Tensor) else list(model_or_param.parameters())
    for p in params:
        ref = _RUNTIMES.get(id(p))
        rt = ref() if ref is not None else None
        if rt is not None and any(q is p for q in rt.registry.params.values()):
            return rt.dm
    return None


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """fqn -> unsharded parameter of a model compiled with this backend, on every rank (collective:
    first all-gathers ZeRO-2 shards updated by the last ``optimizer.step()``)."""
    dm = distributed_model(model)
    if dm is None:
        raise ConfigError("full_state_dict: this model has not run under the galvatron backend yet")
    if hasattr(dm, "sync_params"):
        dm.sync_params()
    return dm.full_state_dict()
