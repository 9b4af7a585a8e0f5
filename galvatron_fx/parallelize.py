"""``gfx.transform``: a captured graph plus a plan -> this rank's distributed module (pp = 1).

Reads top to bottom as the plan is applied (torchtitan's ``parallelize`` order)::

    gm  = apply_tensor_parallel(gm, plan)      # layers with tp > 1 (passes/tensor_parallel.py)
    top = split_layers(gm)                     # one submodule per layer: layers_0, layers_1, ...
    apply_checkpointing(top, plan)             # ckpt layers run under torch.utils.checkpoint
    apply_data_parallel(top, plan)             # flat buffers: DP all-reduce / ZeRO-2 / ZeRO-3
    apply_resharding(top, plan)                # batch / sequence slices between layers

The rank layout (which ranks form a layer's TP and DP groups, which batch slice a rank holds) is
documented in :mod:`galvatron_fx.runtime.groups`. ``print(dist_model.code)`` shows the layer calls
with the inserted slicing / gathering calls; ``print(dist_model.layers_1.code)`` shows a layer's
own parameter collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx

from .errors import ConfigError
from .ir import META_KEY, GraphInfo, carries_batch
from .passes.data_parallel import flatten_layer_params
from .passes.split_layers import layer_module_name, split_layers
from .plan import Plan
from .runtime import reshard
from .runtime.checkpointing import checkpoint_layer
from .runtime.data_parallel import DEFAULT_BUCKET_BYTES, FlatParams
from .runtime.groups import GROUPS, Layout, group
from .runtime.module import DistributedModel


def transform(gm: torch.fx.GraphModule, plan: Plan | None = None, loss_fn=None, *,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> DistributedModel:
    """This rank's distributed module for ``plan`` (see the module docstring and
    :class:`~galvatron_fx.runtime.module.DistributedModel` for ``train_step``).

    Args:
        gm: a graph from :func:`galvatron_fx.capture` (not modified; parameters are copied).
        plan: the parallel plan; its ``world_size``, fingerprint and layer names must match.
        loss_fn: ``loss_fn(output, *targets) -> scalar mean`` when the graph's output is not the loss.
        bucket_bytes: largest single DP gradient all-reduce, in bytes.

    Raises:
        ConfigError: torch.distributed not initialised, no plan, or ``pp > 1``.
        PlanMismatchError: the plan does not match the world size or the model.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("gfx.transform needs torch.distributed: call dist.init_process_group() (or "
                          "galvatron_fx.distributed.init_distributed() under torchrun) first")
    if plan is None:
        raise ConfigError("gfx.transform needs a plan here: pass plan=gfx.search(...) or gfx.Plan.uniform(...)")
    info = gm.meta.get(META_KEY)
    if not isinstance(info, GraphInfo) or not info.layers:
        raise ConfigError("gfx.transform needs a graph from gfx.capture() (with its layer records)")
    plan.validate_for(world_size=dist.get_world_size(), fingerprint=info.fingerprint,
                      layer_names=[rec.name for rec in info.layers])
    if plan.pp != 1:  # pipeline stages: galvatron_fx.runtime.pipeline runs the steps below per stage
        from .runtime.pipeline import transform_pipeline
        return transform_pipeline(gm, plan, loss_fn, bucket_bytes=bucket_bytes)
    rank = dist.get_rank()
    layouts = [Layout(lp.tp, lp.dp, lp.sp) for lp in plan.layers]
    # NOTE: dist.new_group is collective over the whole world: every rank creates every group
    # any rank needs, in one sorted order, before any rewrite uses one.
    GROUPS.ensure(reshard.rank_sets(layouts, dist.get_world_size()))

    gm = apply_tensor_parallel(gm, plan, rank)
    top = split_layers(gm)
    apply_local_batch(top, plan)
    apply_checkpointing(top, plan)
    stores = apply_data_parallel(top, plan, rank, bucket_bytes)
    output_layout = apply_resharding(top, plan, rank)
    model = DistributedModel(top, top.graph, class_name="GalvatronDistributed")
    model.meta[META_KEY] = info
    return model.setup(plan, rank, loss_fn, output_layout, stores, _tp_shards(gm, layouts, rank))


def apply_tensor_parallel(gm: torch.fx.GraphModule, plan: Plan, rank: int, base: int = 0) -> torch.fx.GraphModule:
    """Shard the layers with ``tp > 1`` (Megatron-style) with the tensor-parallel pass.
    ``base``: the first global rank of the pipeline stage (0 for ``pp = 1``).

    NOTE: TP comes first, on the flat graph, so that the layer split, the DP buffers and the
    ZeRO shards are all built from the TP-local parameter shards.
    """
    layer_tp = {i: (lp.tp, lp.sp) for i, lp in enumerate(plan.layers) if lp.tp > 1}
    if not layer_tp:
        return gm
    try:
        from .passes.tensor_parallel import apply_tensor_parallel as tp_pass
    except ImportError as exc:
        raise ConfigError("the plan uses tp > 1 but the tensor-parallel pass is not available "
                          f"({exc}); use a plan with tp = 1") from exc

    gm = _fresh_copy(gm)  # NOTE: the TP pass edits its graph in place; the caller's gm stays intact

    def tp_rank_of(i: int) -> int:
        return Layout(plan.layers[i].tp, plan.layers[i].dp, base=base).tp_index(rank)

    def tp_group_of(i: int):
        return group(Layout(plan.layers[i].tp, plan.layers[i].dp, base=base).tp_ranks(rank))

    return tp_pass(gm, layer_tp, tp_rank_of=tp_rank_of, tp_group_of=tp_group_of)


def _fresh_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with a copied graph, copied node records and its own module tree holding the
    same tensors (so rewriting it, or setting attributes on it, leaves ``gm`` unchanged)."""
    import copy

    graph = torch.fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new in env.items():
        new.meta = dict(old.meta)
        if META_KEY in old.meta:
            new.meta[META_KEY] = copy.copy(old.meta[META_KEY])
    root = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            obj = gm
            for atom in n.target.split("."):
                obj = getattr(obj, atom)
            root[n.target] = obj
    new_gm = torch.fx.GraphModule(root, graph, class_name=type(gm).__name__)
    new_gm.meta = dict(gm.meta)
    if META_KEY in gm.meta:  # NOTE: the TP pass rewrites its layer records' node lists
        new_gm.meta[META_KEY] = copy.deepcopy(gm.meta[META_KEY])
    return new_gm


def _layer_calls(top: torch.fx.GraphModule) -> dict[int, torch.fx.Node]:
    """layer index -> the top-graph node that runs it (call_module, or checkpoint_layer call)."""
    calls = {}
    for n in top.graph.nodes:
        if n.op == "call_module" and n.target.startswith("layers_"):
            calls[int(n.target.split("_")[1])] = n
        elif n.op == "call_function" and n.target is checkpoint_layer:
            calls[int(n.args[0].target.split("_")[1])] = n
    return calls


def apply_local_batch(top: torch.fx.GraphModule, plan: Plan) -> None:
    """Rewrite shape constants baked for the captured batch (dynamo / export graphs) to each
    layer's micro-batch slice (see :mod:`galvatron_fx.passes.local_batch`; fx graphs: no-op)."""
    from .passes.local_batch import global_batch_of, localize_batch

    info = top.meta.get(META_KEY)
    batch = global_batch_of(top)
    if batch and getattr(info, "method", "") in ("dynamo", "export"):  # fx graphs keep x.size(0)
        localize_batch(top, batch, [batch // (plan.micro_batches * lp.dp) for lp in plan.layers])


def apply_checkpointing(top: torch.fx.GraphModule, plan: Plan) -> None:
    """Run every ``ckpt`` layer as ``checkpoint_layer(self.layers_i, *inputs)``.

    NOTE: the checkpoint wraps the whole layer including its ZeRO-3 all-gather, so backward
    recomputes with freshly gathered parameters instead of keeping the gathered buffer alive.
    """
    for i, call in _layer_calls(top).items():
        if not plan.layers[i].ckpt:
            continue
        with top.graph.inserting_before(call):
            mod = top.graph.get_attr(call.target)
            new = top.graph.call_function(checkpoint_layer, (mod, *call.args))
        new.meta = dict(call.meta)
        call.replace_all_uses_with(new)
        top.graph.erase_node(call)
        new.name = call.target
    top.recompile()


def apply_data_parallel(top: torch.fx.GraphModule, plan: Plan, rank: int,
                        bucket_bytes: int, base: int = 0) -> list[FlatParams]:
    """Flatten each layer's parameters into one buffer synchronised over the layer's DP group:
    all-reduced (``sdp="none"``), reduce-scattered with replicated parameters (``"zero2"``) or
    sharded and all-gathered around use (``"zero3"``); see :mod:`galvatron_fx.runtime.data_parallel`.
    """
    stores = []
    for i, lp in enumerate(plan.layers):
        layer = getattr(top, layer_module_name(i))
        ranks = Layout(lp.tp, lp.dp, base=base).dp_ranks(rank)
        store = flatten_layer_params(layer, lp.sdp, ranks, rank, bucket_bytes, ckpt=lp.ckpt)
        if store is not None:
            stores.append(store)
    return stores


def apply_resharding(top: torch.fx.GraphModule, plan: Plan, rank: int, base: int = 0) -> Layout:
    """Insert the slicing / gathering calls that move values between layer layouts.

    Graph inputs (the whole micro-batch on every rank) are cut to each reader's batch slice;
    batched activations (those computed from graph inputs; batch on dim 0, sequence on dim 1)
    go through :func:`~galvatron_fx.runtime.reshard.plan_batched`; replicated values that
    need a gradient (tied weights) cross to another layout through
    :func:`~galvatron_fx.runtime.reshard.replicated`. Returns the layout of the graph output
    (sequence gathered: ``sp`` off).
    """
    layouts = [Layout(lp.tp, lp.dp, lp.sp, base) for lp in plan.layers]
    graph = top.graph
    batched: dict[torch.fx.Node, bool] = {}
    producer: dict[torch.fx.Node, int | None] = {}
    for n in list(graph.nodes):
        if n.op == "placeholder":
            val = n.meta.get("val")
            batched[n], producer[n] = isinstance(val, torch.Tensor) and val.dim() >= 1, None
    calls = _layer_calls(top)
    cache: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}
    for i, call in sorted(calls.items()):
        dst = layouts[i]
        args = list(call.args)
        first = 1 if call.op == "call_function" else 0
        orig = args[first:]
        for j in range(first, len(args)):
            a = args[j]
            if (a, i) not in cache:
                cache[(a, i)] = _reshard(graph, call, a, batched[a], producer[a], layouts, dst, rank)
            args[j] = cache[(a, i)]
        call.args = tuple(args)
        layer = getattr(top, layer_module_name(i))
        flags = _batched_outputs(layer, [batched[a] for a in orig])
        batched[call], producer[call] = (flags[0] if len(flags) == 1 else flags), i
        for u in call.users:
            if u.op == "call_function" and u.target is _getitem():
                batched[u], producer[u] = flags[u.args[1]], i
    out = next(n for n in graph.nodes if n.op == "output")
    out_nodes = out.all_input_nodes
    last = max((producer.get(n) for n in out_nodes if producer.get(n) is not None), default=len(layouts) - 1)
    src = layouts[last]
    final = Layout(src.tp, src.dp, False)
    if src.sp:
        def fix(n):
            if batched.get(n) and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 2:
                return _chain(graph, out, n, reshard.plan_batched(src, final, rank))
            return n
        out.args = (torch.fx.node.map_arg(out.args[0], fix),)
    graph.lint()
    top.recompile()
    return final


def _getitem():
    import operator
    return operator.getitem


def _reshard(graph, call, a, is_batched, src_layer, layouts, dst: Layout, rank: int):
    if src_layer is None:  # a graph input: every rank holds the whole micro-batch
        if not is_batched or dst.dp == 1:
            return a
        with graph.inserting_before(call):
            return graph.call_function(reshard.slice_input, (a, dst.batch_index(rank), dst.dp))
    src = layouts[src_layer]
    if is_batched:
        return _chain(graph, call, a, reshard.plan_batched(src, dst, rank))
    if (src.tp, src.dp) == (dst.tp, dst.dp):
        return a
    with graph.inserting_before(call):
        return graph.call_function(reshard.replicated, (a, dst.dp_ranks(rank), src.dp))


def _chain(graph, before, a, steps):
    for fn, extra in steps:
        with graph.inserting_before(before):
            a = graph.call_function(fn, (a, *extra))
    return a


def _batched_outputs(layer: torch.fx.GraphModule, in_flags: list[bool]) -> list[bool]:
    """Which outputs of ``layer`` carry the batch dim: computed from a batched input."""
    flags: dict[torch.fx.Node, bool] = {}
    it = iter(in_flags)
    for n in layer.graph.nodes:
        if n.op == "placeholder":
            flags[n] = next(it)
        elif n.op == "get_attr":
            flags[n] = False
        elif n.op == "output":
            outs = n.args[0]
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            return [flags.get(o, False) if isinstance(o, torch.fx.Node) else False for o in outs]
        else:
            flags[n] = carries_batch(n) and any(flags.get(x, False) for x in n.all_input_nodes)
    return []


def _tp_shards(gm: torch.fx.GraphModule, layouts: list[Layout], rank: int) -> dict[str, tuple[object, tuple]]:
    """fqn -> (ShardInfo, TP ranks) for parameters the tensor-parallel pass sharded.

    NOTE: reads the ``ShardInfo`` the TP pass records on the parameter's node
    (``node.meta["galvatron"].shard``).
    """
    out = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        info = n.meta.get(META_KEY)
        shard = getattr(info, "shard", None)
        if shard is None or info.layer is None:
            continue
        lay = layouts[info.layer]
        if lay.tp > 1:
            out[n.target] = (shard, lay.tp_ranks(rank))
    return out
