"""The ``torch.compile`` backend ``"galvatron"``: search (or load) a plan, run the distributed program.

Registered through the ``torch_dynamo_backends`` entry point (setup.cfg), so no import is needed::

    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)     # built before compiling, as usual
    compiled = torch.compile(model, backend="galvatron", fullgraph=True, dynamic=False,
                             options={"memory_budget": "16GiB"})
    for input_ids, labels in data:                           # the global batch (or this rank's shard)
        loss = compiled(input_ids, labels=labels).loss       # == single-device eager loss
        loss.backward()                                      # this rank's shards -> param.grad
        opt.step(); opt.zero_grad()

Options (``options={...}``, all optional): ``memory_budget`` (bytes or "16GiB"; default the device
memory), ``cluster`` (preset name, cluster JSON path or :class:`Cluster`; default
``Cluster.preset("local")``, which profiles the live world), ``plan`` (a plan JSON path or
:class:`Plan`: used as is, no search), ``global_batch_size`` (default: dim 0 of the first input;
the first call must carry that batch; later calls any batch the plan splits), ``reserve`` (framework reserve per device for the
search, bytes or string), ``constraints`` (dict for :func:`galvatron_fx.search`), ``precision``
(``"fp32"`` / ``"bf16-mixed"`` / ``"fp16-mixed"``: what the search prices and the program runs;
default the plan's, else the cluster's; see :mod:`galvatron_fx.runtime.precision`),
``reduce_dtype`` (mixed precision: gradients reduced in ``"fp32"``, the default, or ``"bf16"`` /
``"fp16"``), ``init`` (a model built on the meta device: ``"weights"`` initialises this rank's parts
with the model's own initialiser, as ``dist_model.init_weights()``; a directory loads them from its
``save_pretrained`` safetensors, as ``dist_model.load_pretrained(DIR)``; see
:mod:`galvatron_fx.runtime.materialize`), ``measure`` (``K``: every rank times the ``K`` best plans by
estimate and the baselines on the live world and runs the fastest: :mod:`galvatron_fx.selection`;
``measure_options``: its budget, as ``gfx.search``'s),
``schedule`` / ``virtual_stages`` (pin the search's pipeline schedule and chunks per rank, as the
constraints of the same names).

What one compile does (:func:`galvatron_backend`):

1. *Graph.* Dynamo hands the backend its graph with parameters and buffers as placeholders, its
   batch specialised to the call's. The backend captures the traced module again from the call's
   own arguments, as ``gfx.capture(model, args, kwargs, method="dynamo")`` does, with a symbolic
   batch (:func:`.graph.recaptured`; plans made by ``galvatron-fx plan`` match), and maps dynamo's
   placeholders and outputs onto it (tensor identity, node names). Where that is not possible it
   normalises dynamo's own graph: the placeholders' sources
   (``L['self']._modules['h']._modules['0']..._parameters['weight']``) give the fully qualified
   names, grouped exactly like ``gfx.capture(method="dynamo")``. Either way the scalar loss is
   output 0.
2. *Plan.* ``options["plan"]`` is loaded on every rank, else rank 0 searches and broadcasts the plan.
   Either way every rank all-gathers a digest of (plan, model fingerprint) and **all** ranks raise
   :class:`PlanMismatchError` before the first step if any differs.
3. *Program.* :func:`galvatron_fx.parallelize.transform` builds this rank's ``DistributedModel``.
   With ``measure``, steps 2-4 run at the first call instead (:class:`.binding._BuiltAtFirstCall`):
   candidates timed inside dynamo's compile run their Python ~1.4x slower than training does.
4. *Parameters.* The original ``nn.Parameter`` objects (those an optimizer built from
   ``model.parameters()`` holds) become :class:`~galvatron_fx.runtime.params.ShardedParameter` s
   in place (same objects, class changed, ``.data`` re-pointed): a view of this rank's part in the
   distributed program's buffers (``sdp="none"``: the whole TP-local parameter; ZeRO-2/3: its
   held dim-0 rows, possibly none). ``optimizer.step()`` therefore updates the program's buffers
   in place; ZeRO-2's all-gather of updated shards runs at the start of the next call; frozen
   parameters stay frozen (no gradient, no optimizer state); ``torch.nn.utils.clip_grad_norm_(
   model.parameters(), ...)`` returns the single-device norm. Parameters this rank holds no part
   of (other pipeline stages) become empty tensors.
5. *Calls.* A training call (grad enabled, the model in ``train()`` mode) runs ``train_step``
   (forward and backward over the plan's micro-batches) eagerly and returns the global-batch loss
   through :class:`_RouteGrads`, whose backward hands each original parameter its gradient view
   (times the incoming gradient, added to a gradient it already holds), so ``loss.backward()``
   fills ``param.grad`` as eager autograd would. Its other outputs (logits, caches) are ``None`` (warned
   once): they are not materialised across ranks. A call under ``torch.no_grad()`` or
   ``model.eval()`` runs ``eval_step`` (forward only) and returns the loss *and* the real outputs,
   assembled across ranks (every rank holds the global batch's outputs: that memory is the cost).

Recompiles: exactly one compile per compiled model. Dynamo guards on parameter and input shapes
would re-trace after step 4 changes parameter shapes (and the re-trace would fail on 1-D shards),
so the backend removes the guards whose source is a parameter, buffer or input of the graph
(``TracingContext`` guards, as dynamo itself does for synthetic locals), and the grad-mode
(global state) and ``training``-flag guards, which the runtime reads at each call; it checks the
inputs' shapes and dtypes itself: any batch the plan can split (a smaller last batch, this rank's
shard) runs, and a change of another dim raises :class:`ConfigError` (so does any change when the
program kept dynamo's static graph).
Other guards (config flags, other module attributes, Python branches) stay. The program is
captured once, in training mode; its dropout follows the call (:mod:`galvatron_fx.runtime.dropout`):
on in a training call, off under ``model.eval()`` or ``torch.no_grad()`` (which run ``eval_step``).

Graph breaks: with ``fullgraph=True`` dynamo's own error names the line that broke. Without it,
the first partial graph has no scalar loss and the backend raises :class:`ConfigError` naming the
line where that graph ends.

Without torch.distributed initialised the backend warns and runs the captured graph on one device
(no guards removed, no parameters touched).

Submodules, one concern each (this package holds the entry point :func:`galvatron_backend` and
:data:`stats`, and re-exports the public names):

* :mod:`.options`: :class:`BackendOptions`, the ``options={...}`` parsed and validated;
* :mod:`.graph`: step 1, placeholder roles and names, the loss output, the normalised graph
  (through :func:`galvatron_fx.frontend.normalise`, the same chain ``gfx.capture`` runs);
* :mod:`.agreement`: step 2, the plan loaded or searched and agreed across ranks;
* :mod:`.binding`: steps 4 and 5, parameters bound onto ``dm.stores``, the runtime callable,
  guard removal, :func:`distributed_model` and :func:`full_state_dict`.

NOTE: importing this package (which ``torch.compile(backend="galvatron")`` does before tracing) adds
``logging.Logger`` methods to ``torch._dynamo.config.ignore_logging_functions``, so logging calls
inside models (transformers' ``warning_once``) do not break ``fullgraph=True``, as under export.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.fx

from ..errors import ConfigError
from .agreement import _agreed_plan
from .binding import _BuiltAtFirstCall, _remove_guards, _Runtime, distributed_model, full_state_dict
from .door import profile_with_door
from .graph import _batch_size, _classify_placeholders, _loss_output, dynamo_graph, recaptured
from .options import BackendOptions, stats

__all__ = ["BackendOptions", "distributed_model", "full_state_dict", "galvatron_backend", "profile_with_door", "stats"]



# ----------------------------------------------------------------------------------- the backend
def galvatron_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None):
    """The dynamo backend: returns a callable taking the graph's placeholders (see package docstring)."""
    opts = BackendOptions.parse(options)
    stats["compiles"] += 1
    roles = _classify_placeholders(gm, example_inputs)
    if not (dist.is_available() and dist.is_initialized()):
        warnings.warn("galvatron backend: torch.distributed is not initialised; running the captured "
                      "graph on one device (launch with torchrun to run the distributed plan)", stacklevel=2)
        return gm.forward
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss_index = _loss_output(gm, out_node)
    again = (recaptured(example_inputs, roles, out_node, loss_index)
             or dynamo_graph(gm, example_inputs, roles, out_node, loss_index))   # its batch static
    graph = again.graph
    batch = _batch_size([example_inputs[i] for i in again.data_pos])
    if opts.global_batch_size is not None and opts.global_batch_size != batch:
        raise ConfigError(f"option global_batch_size={opts.global_batch_size} but the model was called with "
                          f"a batch of {batch}: call it with the whole global batch on every rank")

    def build() -> _Runtime:
        """Steps 2-4: the plan agreed, the program built, the parameters bound."""
        from ..parallelize import transform

        params = {r.name: v for v, r in zip(example_inputs, roles) if r.kind == "param"}
        plan = _agreed_plan(graph, opts, batch, sum(p.requires_grad for p in params.values()))
        dm = transform(graph, plan=plan, bind=params, reduce_dtype=opts.reduce_dtype)
        if opts.init is not None:   # a meta-device model: this rank's parts only (runtime/materialize.py)
            if opts.init == "weights":
                dm.init_weights(model=again.module)
            else:
                dm.load_pretrained(opts.init, model=again.module)
        return _Runtime(dm, roles, example_inputs, again)

    # NOTE: a measured plan is chosen at the first call, not here: inside dynamo's compile every
    # Python call runs slower, which timed the candidates' steps above the same plan's training
    # steps (measured: docs/measurements.md, "Figures behind the design")
    runtime = _BuiltAtFirstCall(build) if opts.measure else build()
    _remove_guards(gm, roles)
    return runtime


class _LoggerMethods(set):
    """A set that also contains every *current* ``logging.Logger`` method (including ones added
    after import, such as transformers' ``warning_once``)."""

    def __contains__(self, fn) -> bool:
        return set.__contains__(self, fn) or any(fn is v for v in vars(logging.Logger).values())


def _quiet_logging() -> None:
    cfg = torch._dynamo.config
    if not isinstance(cfg.ignore_logging_functions, _LoggerMethods):
        cfg.ignore_logging_functions = _LoggerMethods(cfg.ignore_logging_functions)


_quiet_logging()
