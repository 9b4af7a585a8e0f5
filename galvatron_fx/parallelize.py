"""``gfx.transform``: a captured graph plus a plan -> this rank's distributed module, for every plan.

One list of passes, built from the plan by :func:`parallelize_passes`, runs for ``pp = 1`` and
``pp > 1`` alike, in the order :data:`galvatron_fx.passes.REWRITE_ORDER` declares (the pass manager
checks it; each pass is one module of ``passes/`` with its contract in its docstring)::

{order}

The rank layout (which ranks form a layer's TP and DP groups, which batch slice a rank holds) is
documented in :mod:`galvatron_fx.runtime.groups`. ``dist_model.passes`` lists the passes that ran,
in order; ``print(dist_model.code)`` shows the layer calls with the inserted slicing / gathering
calls; ``print(dist_model.layers_1.code)`` shows a layer's own parameter collectives.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist
import torch.fx

from . import dims
from . import passes as passes_package
from .errors import ConfigError, PlanMismatchError
from .ir import META_KEY, GraphInfo, graph_batch_size
from .passes import REWRITE_ORDER
from .passes.base import GraphPass, PassManager
from .passes.bind_parameters import BindParametersPass, release_unheld
from .passes.codegen import CodegenPass
from .passes.context import ParallelContext
from .passes.local_batch import LocalBatchPass
from .passes.meta_device import MetaDevicePass
from .passes.mixed_precision import MixedPrecisionPass
from .passes.resharding import ReshardingPass
from .passes.split_layers import SplitLayersPass
from .passes.stage_boundaries import StageInputsPass, StageOutputsPass
from .passes.stage_split import StageSplitPass, cross_stage_params
from .passes.token_loss import TokenLossPass
from .plan import Plan
from .runtime import reshard
from .runtime.data_parallel import DEFAULT_BUCKET_BYTES
from .runtime.groups import GROUPS, Layout, batch_layout, input_layout
from .runtime.module import DistributedModel
from .runtime.pipeline import PipelineModel
from .runtime.precision import precision_policy
from .sharding.sequence import sequence_length
from .solver.schedules import check_schedule

ROLES = {
    "token_loss": "a mean cross-entropy -> sum x 1/(global non-ignored tokens): exact under any split",
    "stage_split": "(pp > 1) this rank's stage as a flat graph",
    "tensor_parallel": "layers with tp > 1, on the flat graph",
    "split_layers": "one submodule per layer: layers_0, layers_1, ...",
    "local_batch": "dynamo / export graphs: baked batch constants -> each layer's slice",
    "context_parallel": "(cp > 1 layers) sequence shards, ring / Ulysses attention",
    "expert_parallel": "(ep > 1 layers) experts split by expert, token dispatch",
    "stage_outputs": "(pp > 1) values sent on leave in the boundary layout",
    "checkpointing": "ckpt layers run under torch.utils.checkpoint",
    "data_parallel": "flat buffers: DP all-reduce / ZeRO-2 / ZeRO-3 (fp32 masters, working copies)",
    "mixed_precision": "(bf16/fp16-mixed plans) layers under autocast on low-precision inputs",
    "resharding": "batch / sequence slices between layers",
    "stage_inputs": "(pp > 1) received values -> each layer's layout; global layer names",
    "meta_device": "(a graph captured on the meta device) ops create tensors on this device",
    "codegen": "the DistributedModel (train_step, full_state_dict, ...)",
    "bind_parameters": "every original parameter -> a ShardedParameter view of this rank's part, under its name "
                       "(torch.compile: the user's own Parameter objects)",
}
"""What each pass of :data:`REWRITE_ORDER` does, in a line; a dimension's pass not listed here is
described by the first sentence of its module's docstring (the module docstring lists the order)."""


def _role(name: str) -> str:
    if name in ROLES:
        return ROLES[name]
    doc = importlib.import_module(f"{passes_package.__name__}.{name}").__doc__ or ""
    return " ".join(doc.split(".")[0].split())


__doc__ = __doc__.format(order="\n".join(f"    {name}{' ' * max(2, 19 - len(name))}{_role(name)}"
                                         for name in REWRITE_ORDER))


def parallelize_passes(ctx: ParallelContext, bind: dict | None = None) -> list[GraphPass]:
    """The passes that turn a captured graph into this rank's module under ``ctx.plan``, in
    :data:`~galvatron_fx.passes.REWRITE_ORDER`: the skeleton's (below) and each registered
    dimension's (:class:`~galvatron_fx.dims.PassSpec`: its module's pass class, where the plan needs it)."""
    pipelined = ctx.plan.pp > 1
    skeleton = {
        # NOTE: the loss rewrite comes first, on the whole graph: its token count reads the labels of
        # the global batch, whichever stage computes the loss
        "token_loss": lambda: TokenLossPass(ctx),
        # NOTE: the stage split comes first, so every later pass sees one stage as if it were the
        # whole model (its layers renumbered from 0, its ranks offset by ctx.base); TP (a dimension's
        # pass) follows it, on the flat graph, so the layer submodules, the DP buffers and the ZeRO
        # shards are all built from the TP-local parameter shards
        "stage_split": lambda: StageSplitPass(ctx.plan.stages, ctx.chunk_index, ctx) if pipelined else None,
        "split_layers": SplitLayersPass,
        "local_batch": lambda: LocalBatchPass(ctx),
        # NOTE: checkpointing (after this) wraps whole layer calls before DP rewrites the layers, so
        # a ZeRO-3 layer's all-gather is inside the checkpoint and is redone in backward
        "stage_outputs": lambda: StageOutputsPass(ctx) if pipelined else None,
        "mixed_precision": lambda: MixedPrecisionPass(ctx) if ctx.precision.mixed else None,
        "resharding": lambda: ReshardingPass(ctx),
        # NOTE: after resharding, which leaves received values alone: they enter from the boundary
        # layout, not from a graph input's whole micro-batch
        "stage_inputs": lambda: StageInputsPass(ctx) if pipelined else None,
        # NOTE: last rewrite: the passes before propagate fake tensors with meta-device parameters
        "meta_device": lambda: MetaDevicePass(ctx),
        "codegen": lambda: CodegenPass(ctx),
        "bind_parameters": lambda: BindParametersPass(ctx, bind),
    }
    specs = dims.pass_specs()
    passes: list[GraphPass] = []
    for name in REWRITE_ORDER:
        if name in skeleton:
            made = skeleton[name]()
        elif specs[name].when is None or specs[name].when(ctx):
            spec = specs[name]
            made = getattr(importlib.import_module(f"{passes_package.__name__}.{spec.name}"), spec.class_name)(ctx)
        else:
            made = None
        if made is not None:
            passes.append(made)
    return passes


def check_transformable(gm: torch.fx.GraphModule) -> GraphInfo:
    """The graph's layer records, once torch.distributed is up and ``gm`` came from ``gfx.capture``;
    :class:`ConfigError` naming the fix otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("gfx.transform needs torch.distributed: call dist.init_process_group() (or "
                          "galvatron_fx.distributed.init_distributed() under torchrun) first")
    info = gm.meta.get(META_KEY)
    if not isinstance(info, GraphInfo) or not info.layers:
        raise ConfigError("gfx.transform needs a graph from gfx.capture() (with its layer records)")
    return info


def transform(gm: torch.fx.GraphModule, plan: Plan, loss_fn=None, *,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, bind: dict | None = None,
              reduce_dtype: str | None = None) -> DistributedModel | PipelineModel:
    """This rank's distributed module for ``plan`` (see the module docstring and
    :class:`~galvatron_fx.runtime.module.DistributedModel` for ``train_step``).

    Args:
        gm: a graph from :func:`galvatron_fx.capture` (not modified; parameters are copied).
        plan: the parallel plan; its ``world_size``, fingerprint and layer names must match
            (``gfx.transform(gm)``, :func:`galvatron_fx.api.transform`, searches one first).
        loss_fn: ``loss_fn(output, *targets) -> scalar mean`` when the graph's output is not the loss.
        bucket_bytes: largest single DP gradient all-reduce, in bytes.
        reduce_dtype: mixed-precision plans: the dtype gradients are reduced in over DP, ``"fp32"``
            (default) or the compute dtype's name (``"bf16"`` / ``"fp16"``: half the traffic).
            The plan's ``precision`` decides the rest (:mod:`galvatron_fx.runtime.precision`).
        bind: ``fqn -> nn.Parameter`` of the user's model to turn into this rank's parameter views
            (the torch.compile backend's parameter binding; :mod:`galvatron_fx.runtime.params`).

    Raises:
        ConfigError: torch.distributed not initialised, or a graph without layer records.
        PlanMismatchError: the plan does not match the world size or the model.
    """
    info = check_transformable(gm)
    if not isinstance(plan, Plan):
        raise ConfigError(f"transform builds a given plan, got {type(plan).__name__}; gfx.transform(gm) "
                          "(galvatron_fx.api.transform) searches one first")
    world = dist.get_world_size()
    plan.validate_for(world_size=world, fingerprint=info.fingerprint, layer_names=[rec.name for rec in info.layers])
    _check_pipeline(gm, plan, world)
    whole_batch = _check_batch_coupling(gm, plan)
    ctx = ParallelContext(plan, dist.get_rank(), world, method=info.method, global_batch=graph_batch_size(gm),
                          symbolic_batch=info.symbolic_batch,
                          bucket_bytes=bucket_bytes, loss_fn=loss_fn,
                          precision=precision_policy(plan.precision, reduce_dtype), param_fqns=_param_fqns(gm),
                          whole_batch=whole_batch, seq_len=sequence_length(gm))
    # NOTE: dist.new_group is collective over the whole world: every rank creates every group any
    # rank needs (every stage's, and the p2p groups), in one sorted order, before a pass uses one.
    GROUPS.ensure(_rank_sets(plan, world, whole_batch))
    if plan.pp == 1:
        return _build(gm, ctx, bind)
    # NOTE: one program per chunk this rank runs (one under GPipe / 1F1B), each by the same passes
    chunks = [_build(gm, ctx.for_chunk(c), bind) for c in plan.rank_chunks(ctx.stage)]
    release_unheld(bind, {fqn for c in chunks for fqn in c.params.params})
    pipe = PipelineModel(chunks, plan, [c.stage_info for c in chunks], input_names=[n.name for n in _placeholders(gm)],
                         rank=ctx.rank, stage_size=ctx.stage_size)
    pipe.passes = chunks[0].passes
    return pipe


def _build(gm: torch.fx.GraphModule, ctx: ParallelContext, bind: dict | None) -> DistributedModel:
    """This rank's program for ``ctx`` (one chunk of a pipeline): the pass list run on ``gm``."""
    manager = PassManager(parallelize_passes(ctx, bind), order=REWRITE_ORDER)
    model = manager(gm).graph_module
    model.passes = list(manager.ran)
    model.stage_info = ctx.stage_info
    return model


def _param_fqns(gm: torch.fx.GraphModule) -> list[str]:
    """The whole model's parameters (trainable and frozen), in graph order, each once."""
    out: dict[str, None] = {}
    for n in gm.graph.nodes:
        p = getattr(n.meta.get(META_KEY), "param", None)
        if n.op == "get_attr" and p is not None and p.is_param:
            out.setdefault(p.fqn)
    return list(out)


def _placeholders(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _check_pipeline(gm: torch.fx.GraphModule, plan: Plan, world: int) -> None:
    if plan.pp == 1:
        return
    if world % plan.pp:
        raise PlanMismatchError(f"the plan has pp={plan.pp} stages for world_size={plan.world_size}, but "
                                f"{world} processes are running; launch world_size={plan.world_size} ranks "
                                "(a multiple of pp) or re-plan for this world size")
    check_schedule(plan.schedule, plan.pp, plan.virtual_stages, plan.micro_batches)
    if len(plan.stages) != plan.num_chunks:
        raise PlanMismatchError(f"the plan lists {len(plan.stages)} stages for pp={plan.pp} x "
                                f"virtual_stages={plan.virtual_stages}")
    for fqn, layers in cross_stage_params(gm, plan.stages).items():
        if any(plan.layers[i].tp > 1 for i in layers):
            raise ConfigError(
                f"parameter {fqn!r} is tied across pipeline stages (read by layers {layers}); a tied weight "
                "crosses stages whole, so the layers reading it need tp=1 (or put them in one stage)")


def _check_batch_coupling(gm: torch.fx.GraphModule, plan: Plan) -> frozenset:
    """The layers that mix the samples of a batch (in-batch similarity matrices, batch norm in
    training mode: :func:`galvatron_fx.batch_symbol.coupling`) and run split over DP ranks: they
    compute on the all-gathered batch (:func:`~galvatron_fx.runtime.groups.batch_layout`), exact
    with gradients. Refuses micro-batches there: each would compute something else than the whole
    batch does, and no gather across micro-batches can undo it."""
    whole = []
    for i, (rec, lp) in enumerate(zip(gm.meta[META_KEY].layers, plan.layers)):
        if not rec.batch_coupled:
            continue
        if plan.micro_batches > 1:
            raise ConfigError(f"layer {rec.name!r} mixes the samples of a batch: {rec.batch_coupled[0]}; the plan cuts "
                              f"the batch into micro_batches={plan.micro_batches}, which would change the result; use "
                              "micro_batches=1 (DP ranks are fine: the layer all-gathers the batch) or let gfx.search "
                              "choose (it does)")
        if lp.dp > 1:
            whole.append(i)
    return frozenset(whole)


def _rank_sets(plan: Plan, world: int, whole_batch: frozenset = frozenset()) -> set:
    """Every rank set any rank's program communicates over (TP, DP, resharding and p2p groups)."""
    n = world // plan.pp
    sets: set = set()
    if plan.pp > 1:
        sets |= {tuple(j + s * n for s in range(plan.pp)) for j in range(n)}
    for c, (first, last) in enumerate(plan.stages):
        base = plan.chunk_rank(c) * n
        lays = [Layout(lp.tp, lp.dp, lp.sp, base, lp.ep, lp.cp, lp.expert_tp, lp.strategy.shard)
                for lp in plan.layers[first:last + 1]]
        lays += [batch_layout(lp.tp, lp.dp, lp.sp, base, whole_batch=True)
                 for i, lp in enumerate(plan.layers[first:last + 1], first) if i in whole_batch]
        # NOTE: the graph inputs' layout, always: a stage boundary, and the rows a rank's shard of
        # the batch is gathered over (a token loss counts the whole batch's targets; tp2 x dp2
        # failed in a fresh process, passing only after a test that had made the group)
        lays.append(input_layout(n, plan.global_batch_size // plan.micro_batches, base))
        sets |= reshard.rank_sets(lays, world)
    return sets
