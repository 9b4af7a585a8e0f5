"""The ``torch.compile`` backend ``"galvatron"``: search (or load) a plan, run the distributed program.

Registered through the ``torch_dynamo_backends`` entry point (setup.cfg), so no import is needed::

    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)     # built before compiling, as usual
    compiled = torch.compile(model, backend="galvatron", fullgraph=True, dynamic=False,
                             options={"memory_budget": "16GiB"})
    for input_ids, labels in data:                           # the SAME global batch on every rank
        loss = compiled(input_ids, labels=labels).loss       # == single-device eager loss
        loss.backward()                                      # this rank's shards -> param.grad
        opt.step(); opt.zero_grad()

Options (``options={...}``, all optional): ``memory_budget`` (bytes or "16GiB"; default the device
memory), ``cluster`` (preset name, cluster JSON path or :class:`Cluster`; default
``Cluster.preset("local")``, which profiles the live world), ``plan`` (a plan JSON path or
:class:`Plan`: used as is, no search), ``global_batch_size`` (default: dim 0 of the first input;
the model must be called with that batch), ``reserve`` (framework reserve per device for the
search, bytes or string), ``constraints`` (dict for :func:`galvatron_fx.search`).

What one compile does (:func:`galvatron_backend`):

1. *Graph.* Dynamo hands the backend its graph with parameters and buffers as placeholders. Their
   sources (``L['self']._modules['h']._modules['0']..._parameters['weight']``) give the fully
   qualified names; the graph is normalised and grouped exactly like ``gfx.capture(method="dynamo")``
   (so plans made by ``galvatron-fx plan`` match), with the scalar loss moved to output 0.
2. *Plan.* ``options["plan"]`` is loaded on every rank, else rank 0 searches and broadcasts the plan.
   Either way every rank all-gathers a digest of (plan, model fingerprint) and **all** ranks raise
   :class:`PlanMismatchError` before the first step if any differs.
3. *Program.* :func:`galvatron_fx.parallelize.transform` builds this rank's ``DistributedModel``.
4. *Parameters.* The original ``nn.Parameter`` objects (those an optimizer built from
   ``model.parameters()`` holds) are re-pointed with ``param.data = view`` onto the distributed
   program's storage: a view of the layer's flat buffer (``sdp="none"``: the whole, TP-local
   parameter, shape kept) or of this rank's flat shard (ZeRO-2/3: the 1-D part of the parameter that
   lies in this rank's shard, possibly empty). ``optimizer.step()`` therefore updates the program's
   buffers in place; ZeRO-2's all-gather of updated shards runs at the start of the next call.
   Trainable parameters this rank holds no part of (other pipeline stages) become empty tensors.
5. *Calls.* Each call runs ``train_step`` (forward and backward over the plan's micro-batches)
   eagerly and returns the global-batch loss through :class:`_RouteGrads`, whose backward hands each
   original parameter its slice of this rank's gradient shard (times the incoming gradient), so
   ``loss.backward()`` fills ``param.grad`` through autograd's usual accumulation. Under
   ``torch.no_grad()`` the loss is returned detached (backward still runs inside; documented cost).
   Outputs other than the loss (logits, caches) are *not* materialised: each rank holds only its
   slice of them. They are returned as NaN tensors of the eager shape (zero memory: expanded views).

Recompiles: exactly one compile per compiled model. Dynamo guards on parameter and input shapes
would re-trace after step 4 changes parameter shapes (and the re-trace would fail on 1-D shards),
so the backend removes the guards whose source is a parameter, buffer or input of the graph
(``TracingContext`` guards, as dynamo itself does for synthetic locals); the runtime checks the
inputs' shapes and dtypes itself and raises :class:`ConfigError` on a change (the distributed graphs
are specialised to one global batch shape: use ``dynamic=False``, drop the last partial batch).
Other guards (config flags, module attributes, Python branches) stay.

Graph breaks: with ``fullgraph=True`` dynamo's own error names the line that broke. Without it,
the first partial graph has no scalar loss and the backend raises :class:`ConfigError` naming the
line where that graph ends.

Without torch.distributed initialised the backend warns and runs the captured graph on one device
(no guards removed, no parameters touched).

NOTE: importing this module (which ``torch.compile(backend="galvatron")`` does before tracing) adds
``logging.Logger`` methods to ``torch._dynamo.config.ignore_logging_functions``, so logging calls
inside models (transformers' ``warning_once``) do not break ``fullgraph=True``, as under export.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import warnings
import weakref
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn

from .errors import ConfigError, GalvatronError, PlanMismatchError
from .ir import META_KEY

stats = {"compiles": 0, "searches": 0}
"""Counters for tests and logs: backend compiles and plan searches in this process."""

_RUNTIMES: dict[int, weakref.ref] = {}  # id(original Parameter) -> its _Runtime


@dataclass
class BackendOptions:
    """``torch.compile(..., options={...})`` of the galvatron backend (see the module docstring)."""

    memory_budget: Any = None
    cluster: Any = None
    plan: Any = None
    global_batch_size: int | None = None
    reserve: Any = None
    constraints: dict | None = None

    @classmethod
    def parse(cls, options: dict | None) -> BackendOptions:
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"unknown galvatron backend option(s) {unknown}; known: {', '.join(known)}")
        opts = cls(**options)
        gbs = opts.global_batch_size
        if gbs is not None and (not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1):
            raise ConfigError(f"option global_batch_size must be a positive int, got {gbs!r}")
        return opts


# ----------------------------------------------------------------------------------- the backend
def galvatron_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None):
    """The dynamo backend: returns a callable taking the graph's placeholders (see module docstring)."""
    opts = BackendOptions.parse(options)
    stats["compiles"] += 1
    roles = _classify_placeholders(gm, example_inputs)
    if not (dist.is_available() and dist.is_initialized()):
        warnings.warn("galvatron backend: torch.distributed is not initialised; running the captured "
                      "graph on one device (launch with torchrun to run the distributed plan)", stacklevel=2)
        return gm.forward
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss_index = _loss_output(gm, out_node)
    graph = _normalised_graph(gm, example_inputs, roles, loss_index)
    data = [example_inputs[i] for i, r in enumerate(roles) if r.kind == "input"]
    batch = _batch_size(data)
    if opts.global_batch_size is not None and opts.global_batch_size != batch:
        raise ConfigError(f"option global_batch_size={opts.global_batch_size} but the model was called with "
                          f"a batch of {batch}: call it with the whole global batch on every rank")
    plan = _agreed_plan(graph, opts, batch)
    from .parallelize import transform

    dm = transform(graph, plan=plan)
    runtime = _Runtime(dm, plan, roles, example_inputs, out_node, loss_index)
    _remove_guards(gm, roles)
    return runtime


@dataclass
class _Role:
    kind: str           # "param" | "buffer" | "input"
    name: str           # fqn (param/buffer) or input name
    source: Any = None  # dynamo Source, for guard removal


def _source_name(node: torch.fx.Node) -> str:
    arg = node.meta.get("grapharg")
    src = getattr(arg, "source", None)
    if src is None:
        return ""
    name = src.name
    return name() if callable(name) else str(name)


def _traced_names() -> dict[int, str]:
    """id(tensor) -> first FQN in the module(s) being traced (``named_parameters`` order, so tied
    weights get the name ``gfx.capture`` gives them), from dynamo's current frame's locals."""
    from .passes.normalize import model_tensors

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        local_vars = dict(getattr(tx, "f_locals", {}) or {})
    except Exception:  # noqa: BLE001 - private API; fall back to names from dynamo's sources
        return {}
    names: dict[int, str] = {}
    for value in local_vars.values():
        if isinstance(value, nn.Module):
            for key, info in model_tensors(value).items():
                names.setdefault(key, info.fqn)
    return names


def _classify_placeholders(gm: torch.fx.GraphModule, example_inputs) -> list[_Role]:
    roles, used = [], set()
    traced = _traced_names()
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        src = _source_name(node)
        source = getattr(node.meta.get("grapharg"), "source", None)
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"the graph input {node.name!r} ({src or type(value).__name__}) is not a tensor "
                              "(dynamic shapes?): compile with torch.compile(..., dynamic=False)")
        state = re.findall(r"\._(modules|parameters|buffers)\['([^']*)'\]", src)
        if isinstance(value, nn.Parameter) or (state and state[-1][0] in ("parameters", "buffers")):
            fqn = traced.get(id(value)) or ".".join(name for _kind, name in state) or node.name
            roles.append(_Role("param" if isinstance(value, nn.Parameter) else "buffer", fqn, source))
        elif src.startswith("L["):
            tokens = re.findall(r"\[(?:'([^']*)'|(\d+))\]", src)
            parts = [k or i for k, i in tokens if k != "kwargs"] or [node.name]
            name = _unique("_".join(parts), used)
            roles.append(_Role("input", name, source))
        else:  # a tensor captured from a global or closure: treat it as a (constant) buffer
            roles.append(_Role("buffer", _unique(f"_captured_{node.name}", used), source))
    return roles


def _unique(name: str, used: set) -> str:
    from .frontend import _identifier

    base, k = _identifier(name), 1
    name = base
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name


def _loss_output(gm: torch.fx.GraphModule, out_node: torch.fx.Node) -> int:
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for i, o in enumerate(outs):
        val = o.meta.get("example_value", o.meta.get("val")) if isinstance(o, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point():
            return i
    last = [n for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_method"]
    trace = (last[-1].meta.get("stack_trace") or "").strip().splitlines() if last else []
    where = next((line.strip() for line in reversed(trace) if line.strip().startswith("File")), "")
    raise ConfigError(
        "the graph torch.compile handed the galvatron backend returns no scalar loss: either the model's "
        "output is not its training loss, or a graph break cut the forward before the loss"
        + (f" (the graph ends at {where})" if where else "")
        + "; compile with fullgraph=True to see dynamo's reason for the break and make that code traceable")


def _holder(gm, example_inputs, roles) -> nn.Module:
    """A module tree holding the graph's parameters and buffers under their FQNs (for NormalizePass)."""
    root = nn.Module()
    for value, role in zip(example_inputs, roles):
        if role.kind == "input":
            continue
        *path, leaf = role.name.split(".")
        mod = root
        for atom in path:
            if not hasattr(mod, atom):
                mod.add_module(atom, nn.Module())
            mod = getattr(mod, atom)
        if role.kind == "param":
            mod.register_parameter(leaf, value)
        else:
            mod.register_buffer(leaf, value)
    return root


def _normalised_graph(gm, example_inputs, roles, loss_index: int) -> torch.fx.GraphModule:
    from .passes.layer_grouping import LayerGroupingPass
    from .passes.normalize import NormalizePass

    raw = torch.fx.GraphModule(gm, _loss_first(gm.graph, loss_index))
    placeholders = [n for n in raw.graph.nodes if n.op == "placeholder"]
    sources = {n.name: t for n, t in zip(placeholders, example_inputs)}
    data = [t for t, r in zip(example_inputs, roles) if r.kind == "input"]
    names = [r.name for r in roles if r.kind == "input"]
    graph = NormalizePass(_holder(gm, example_inputs, roles), data, names, sources, method="dynamo")(raw).graph_module
    return LayerGroupingPass()(graph).graph_module


def _loss_first(graph: torch.fx.Graph, loss_index: int) -> torch.fx.Graph:
    """A copy of ``graph`` whose output is ``(loss, *others)`` (train_step reads output 0)."""
    new = torch.fx.Graph()
    env: dict = {}
    out = new.graph_copy(graph, env)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    outs.insert(0, outs.pop(loss_index))
    new.output(tuple(outs) if len(outs) > 1 else outs[0])
    return new


def _batch_size(data: list[torch.Tensor]) -> int:
    batched = [t for t in data if t.dim() >= 1]
    if not batched:
        raise ConfigError("the compiled model got no batched tensor input; the galvatron backend needs "
                          "the global batch along dim 0 of its tensor arguments")
    return int(batched[0].shape[0])


# ---------------------------------------------------------------------------------------- plan
def _search(graph, opts: BackendOptions, batch: int, cluster):
    """Search a plan (rank 0). Separate so tests can count or forbid it."""
    from .planner import search

    stats["searches"] += 1
    cost = {}
    if opts.reserve is not None:
        cost["reserve_bytes"] = opts.reserve
    return search(graph, cluster, opts.memory_budget, batch, constraints=opts.constraints,
                  world_size=dist.get_world_size(), **cost)


def _agreed_plan(graph, opts: BackendOptions, batch: int):
    """The plan every rank runs: loaded, or searched on rank 0 and broadcast; then verified."""
    from .plan import Plan
    from .planner import resolve_cluster

    info = graph.meta[META_KEY]
    if opts.plan is not None:
        plan = opts.plan if isinstance(opts.plan, Plan) else Plan.load(opts.plan)
    else:
        cluster = resolve_cluster(opts.cluster)  # None: profiles the live world (collective on every rank)
        box: list = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = ("ok", _search(graph, opts, batch, cluster).to_dict())
            except GalvatronError as exc:
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status != "ok":
            raise ConfigError(f"the plan search on rank 0 failed: {value}")
        plan = Plan.from_dict(value)
    digest = hashlib.sha256(json.dumps([plan.to_dict(), info.fingerprint], sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PlanMismatchError(
            f"ranks disagree on the plan or the model before the first step (plan/model digest of rank 0 "
            f"{digests[0]}, ranks {odd} differ: {[digests[r] for r in odd]}); give every rank the same "
            "options['plan'] file and the same model")
    if plan.global_batch_size != batch:
        raise ConfigError(f"the plan is for global batch {plan.global_batch_size} but the model was called with "
                          f"{batch} samples; call it with the plan's global batch or re-plan")
    return plan


# ------------------------------------------------------------------------------------- runtime
class _RouteGrads(torch.autograd.Function):
    """``loss`` in forward; in backward each original parameter gets its precomputed gradient."""

    @staticmethod
    def forward(ctx, loss, grads, *params):
        ctx.grads = grads
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, g):
        return (None, None, *[None if gr is None else gr * g for gr in ctx.grads])


@dataclass
class _Binding:
    param: nn.Parameter
    store: Any          # the FlatParams holding it, or None (this rank holds none of it)
    lo: int = 0         # element range in store.flat_param
    hi: int = 0
    shape: tuple | None = None  # kept shape (sdp="none"), else 1-D

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        part = flat[self.lo:self.hi]
        return part.view(self.shape) if self.shape is not None else part


class _Runtime:
    """The callable the backend returns (see the module docstring, steps 4 and 5)."""

    def __init__(self, dm, plan, roles, example_inputs, out_node, loss_index: int):
        self.dm, self.plan, self.roles = dm, plan, roles
        self.data_pos = [i for i, r in enumerate(roles) if r.kind == "input"]
        self.input_meta = [(tuple(example_inputs[i].shape), example_inputs[i].dtype) for i in self.data_pos]
        outs = out_node.args[0]
        self.tuple_out = isinstance(outs, (tuple, list))
        outs = list(outs) if self.tuple_out else [outs]
        self.out_meta = [_meta(o) for o in outs]
        self.loss_index = loss_index
        params = {r.name: example_inputs[i] for i, r in enumerate(roles) if r.kind == "param"}
        self.bindings = _bind_parameters(dm, params)
        self.param_pos = [i for i, r in enumerate(roles) if r.kind == "param" and r.name in self.bindings]
        self.calls = 0
        for b in self.bindings.values():
            _RUNTIMES[id(b.param)] = weakref.ref(self)

    def __call__(self, *args):
        data = [args[i] for i in self.data_pos]
        for t, (shape, dtype), i in zip(data, self.input_meta, self.data_pos):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ConfigError(
                    f"galvatron: input {self.roles[i].name!r} is {tuple(t.shape)} {t.dtype}, but the model was "
                    f"compiled for {shape} {dtype}; the distributed program is specialised to one global batch "
                    "shape: keep it fixed (drop the last partial batch) or compile a fresh model")
        if self.calls and hasattr(self.dm, "sync_params"):
            self.dm.sync_params()  # ZeRO-2: all-gather the shards the optimizer updated
        self.calls += 1
        with torch.enable_grad():
            loss = self.dm.train_step(*data)
        if torch.is_grad_enabled():
            params = [args[i] for i in self.param_pos]
            grads = tuple(self._grad(self.bindings[self.roles[i].name]) for i in self.param_pos)
            loss = _RouteGrads.apply(loss, grads, *params)
        else:
            loss = loss.detach()
        outs = [loss if k == self.loss_index else _nan_like(m, loss.device) for k, m in enumerate(self.out_meta)]
        return tuple(outs) if self.tuple_out else outs[0]

    @staticmethod
    def _grad(b: _Binding):
        if b.store is None:
            return None
        g = b.store.flat_param.grad
        return None if g is None else b.view(g)


def _meta(node) -> tuple | None:
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None


def _nan_like(meta, device) -> torch.Tensor | None:
    if meta is None:
        return None
    shape, dtype = meta
    fill = math.nan if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((), fill, dtype=dtype, device=device).expand(shape)


def _bind_parameters(dm, params: dict[str, nn.Parameter]) -> dict[str, _Binding]:
    """Re-point each original Parameter onto this rank's storage in ``dm`` (``param.data = view``)."""
    bindings: dict[str, _Binding] = {}
    stores = getattr(dm, "_stores", None)
    if stores is None:  # pp > 1: runtime.pipeline.PipelineModel holds this rank's stage
        stores = getattr(getattr(dm, "stage", None), "_stores", None) or []
    for store in stores:
        flat = store.flat_param
        base = 0 if store.mode == "none" else store.dp_index * store.shard_numel
        end = base + flat.numel()
        for fqn, off, shape in zip(store.fqns, store.offsets, store.shapes):
            p = params.get(fqn)
            if p is None:
                continue
            n = math.prod(shape)
            if store.mode == "none":
                b = _Binding(p, store, off, off + n, tuple(shape))
            else:
                lo = min(max(off, base), end)
                hi = max(min(off + n, end), lo)
                b = _Binding(p, store, lo - base, hi - base, None)
            bindings[fqn] = b
    for fqn, p in params.items():
        if fqn not in bindings and p.requires_grad:
            bindings[fqn] = _Binding(p, None)  # e.g. a parameter of another pipeline stage
    with torch.no_grad():
        for b in bindings.values():
            b.param.data = b.view(b.store.flat_param.data) if b.store is not None else b.param.data.new_empty(0)
    return bindings


def _remove_guards(gm: torch.fx.GraphModule, roles: list[_Role]) -> None:
    """Drop dynamo's guards on the graph's parameters, buffers and inputs (see module docstring)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is None:
        return
    guards = ctx.guards_context.dynamo_guards
    for role in roles:
        if role.source is not None:
            guards.remove_guards_with_source(role.source)


def distributed_model(model_or_param) -> Any:
    """The ``DistributedModel`` behind a model compiled with this backend (after its first call),
    e.g. for ``full_state_dict()`` or ``states_bytes(optimizer)``; ``None`` if there is none."""
    params = [model_or_param] if isinstance(model_or_param, torch.Tensor) else list(model_or_param.parameters())
    for p in params:
        ref = _RUNTIMES.get(id(p))
        rt = ref() if ref is not None else None
        if rt is not None and any(b.param is p for b in rt.bindings.values()):
            return rt.dm
    return None


class _LoggerMethods(set):
    """A set that also contains every *current* ``logging.Logger`` method (including ones added
    after import, such as transformers' ``warning_once``)."""

    def __contains__(self, fn) -> bool:
        return set.__contains__(self, fn) or any(fn is v for v in vars(logging.Logger).values())


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """fqn -> unsharded parameter of a model compiled with this backend, on every rank (collective:
    first all-gathers ZeRO-2 shards updated by the last ``optimizer.step()``)."""
    dm = distributed_model(model)
    if dm is None:
        raise ConfigError("full_state_dict: this model has not run under the galvatron backend yet")
    if hasattr(dm, "sync_params"):
        dm.sync_params()
    return dm.full_state_dict()


def _quiet_logging() -> None:
    cfg = torch._dynamo.config
    if not isinstance(cfg.ignore_logging_functions, _LoggerMethods):
        cfg.ignore_logging_functions = _LoggerMethods(cfg.ignore_logging_functions)


_quiet_logging()
