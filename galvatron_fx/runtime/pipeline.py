"""Pipeline parallelism: ``gfx.transform`` for plans with ``pp > 1``.

Per rank, top to bottom (the pp = 1 steps of :mod:`galvatron_fx.parallelize` run on the stage)::

    stage = stage_split(gm, plan.stages, k)        # this rank's stage k as a flat graph (passes/stage_split.py)
    stage = apply_tensor_parallel(stage, sub, rank, base)
    top   = split_layers(stage)                    # layers_<global index> submodules
    apply_boundary_outputs(top, ...)               # values sent on: into the boundary layout
    apply_checkpointing(top, sub); apply_data_parallel(top, sub, rank, bucket_bytes, base)
    apply_resharding(top, sub, rank, base)         # + received values: boundary layout -> each layer's
    PipelineModel(DistributedModel(top), ...)      # schedule: torch.distributed.pipelining

Rank layout (see :mod:`.groups`): stages outermost, stage ``k`` owns global ranks
``[k*N, (k+1)*N)`` with ``N = world_size / pp``; inside a stage every layer's TP/SP/DP/ZeRO/ckpt
strategy is applied by the pp = 1 machinery with the stage's rank offset ``base = k*N``.

Boundary layout. A batched value crossing a stage boundary travels in the layout
``Layout(tp=1, dp=N)`` of both stages: local rank ``j`` of stage ``k`` holds batch slice ``j`` of
``N`` of the micro-batch and sends it to local rank ``j`` of stage ``k+1`` (one p2p group per
``j``: ranks ``{j, N+j, 2N+j, ...}``), so each rank sends ``1/N`` of the micro-batch, whatever the
layers on either side do. The producing layer's layout is changed into it (sequence gathered,
batch sub-sliced) and the consuming layers' layouts are rebuilt from it with
:func:`~.reshard.plan_batched`, so gradients keep :mod:`.reshard`'s invariant across the boundary.
Replicated values (a tied weight, T5's position bias) are sent whole; their gradient is summed
over the consumer's DP group and divided by the producer's ``dp`` (:func:`~.reshard.replicated`),
so the producer's own DP reduction adds every use once. Graph inputs (e.g. the last stage's
labels) are never sent: every rank gets the whole global batch in ``train_step``.

NOTE: built on ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` /
``Schedule1F1B``) with static shapes (no meta-device shape inference, which the stage's
collectives would break). ``scale_grads=False``: the loss is scaled by ``1 / (dp * m)`` instead,
as in pp = 1 training, and the layers' flat buffers run their DP reduction on the schedule's
``last_backward``.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from ..errors import ConfigError, PlanMismatchError
from ..ir import META_KEY
from ..passes.split_layers import layer_module_name, split_layers
from ..passes.stage_split import StageInfo, cross_stage_params, stage_info, stage_split
from . import reshard
from .groups import GROUPS, Layout, group
from .module import DistributedModel, _split
from .reshard import slice_input


def _transform_module():
    # NOTE: ``galvatron_fx.parallelize`` the attribute is the function (re-exported by the package);
    # the apply_* steps live in the module of that name.
    import importlib

    return importlib.import_module("galvatron_fx.parallelize")


def boundary_layout(n: int, base: int) -> Layout:
    """The layout of batched values crossing a stage boundary (see the module docstring)."""
    return Layout(1, n, False, base)


def pass_on(x: torch.Tensor) -> torch.Tensor:
    """A value sent to the next stage: a contiguous tensor that is not one of the stage's inputs
    (p2p sends need contiguous memory; a received value handed on unchanged is still a new node)."""
    return x.view_as(x) if x.is_contiguous() else x.contiguous()


def transform_pipeline(gm: torch.fx.GraphModule, plan, loss_fn=None, *, bucket_bytes: int) -> PipelineModel:
    """This rank's stage of ``plan`` (``pp > 1``) as a :class:`PipelineModel`.

    Raises:
        PlanMismatchError: the world size does not match the plan or is not divisible by ``pp``.
    """
    T = _transform_module()

    world, rank = dist.get_world_size(), dist.get_rank()
    if plan.world_size != world or world % plan.pp:
        raise PlanMismatchError(f"the plan has pp={plan.pp} stages for world_size={plan.world_size}, but "
                                f"{world} processes are running; launch world_size={plan.world_size} ranks "
                                "(a multiple of pp) or re-plan for this world size")
    if len(plan.stages) != plan.pp:
        raise PlanMismatchError(f"the plan lists {len(plan.stages)} stages for pp={plan.pp}")
    for fqn, layers in cross_stage_params(gm, plan.stages).items():
        if any(plan.layers[i].tp > 1 for i in layers):
            raise ConfigError(
                f"parameter {fqn!r} is tied across pipeline stages (read by layers {layers}); a tied weight "
                "crosses stages whole, so the layers reading it need tp=1 (or put them in one stage)")
    n = world // plan.pp
    k, base = rank // n, rank // n * n
    # NOTE: dist.new_group is collective over the whole world: every rank creates every stage's
    # groups and the p2p groups, in one sorted order, before any stage uses one.
    sets: set = {tuple(j + s * n for s in range(plan.pp)) for j in range(n)}
    for s, (first, last) in enumerate(plan.stages):
        lays = [Layout(lp.tp, lp.dp, lp.sp, s * n) for lp in plan.layers[first:last + 1]]
        sets |= reshard.rank_sets(lays + [boundary_layout(n, s * n)], world)
    GROUPS.ensure(sets)

    sgm = stage_split(gm, plan.stages, k)
    info = stage_info(sgm)
    sub = _stage_plan(plan, k)
    layouts = [Layout(lp.tp, lp.dp, lp.sp, base) for lp in sub.layers]
    sgm = T.apply_tensor_parallel(sgm, sub, rank, base)
    top = split_layers(sgm)
    apply_boundary_outputs(top, info, layouts, boundary_layout(n, base), rank)
    T.apply_checkpointing(top, sub)
    stores = T.apply_data_parallel(top, sub, rank, bucket_bytes, base)
    out_layout = apply_boundary_inputs(top, sub, info, plan, boundary_layout(n, base), rank, base)
    _rename_layers(top, info.first)
    model = DistributedModel(top, top.graph, class_name=f"GalvatronStage{k}")
    model.meta[META_KEY] = sgm.meta[META_KEY]
    model.setup(sub, rank, loss_fn, out_layout, stores, T._tp_shards(sgm, layouts, rank))
    return PipelineModel(model, plan, info, n_inputs=sum(1 for x in gm.graph.nodes if x.op == "placeholder"),
                         rank=rank, stage_size=n)


def _stage_plan(plan, k: int):
    """The pp = 1 plan of stage ``k`` alone (its layers, ``world_size / pp`` devices)."""
    first, last = plan.stages[k]
    est = dict(plan.estimate)
    mem = est.get("memory_bytes_per_device")
    est["memory_bytes_per_device"] = [mem[k]] if isinstance(mem, list) and len(mem) > k else None
    return dataclasses.replace(plan, world_size=plan.devices_per_stage, pp=1, stages=[(0, last - first)],
                               layers=[dataclasses.replace(lp) for lp in plan.layers[first:last + 1]],
                               estimate=est)


def apply_boundary_outputs(top: torch.fx.GraphModule, info: StageInfo, layouts: list[Layout],
                           boundary: Layout, rank: int) -> None:
    """Values sent to the next stage leave in the boundary layout (batched) or whole (replicated);
    values only passed on go through :func:`pass_on`."""
    if info.is_last:
        return
    graph = top.graph
    out = next(x for x in graph.nodes if x.op == "output")
    new = []
    for node, cv in zip(out.args[0], info.sent):
        with graph.inserting_before(out):
            x = node
            if node.op != "placeholder" and cv.batched:
                for fn, extra in reshard.plan_batched(layouts[cv.producer_layer - info.first], boundary, rank):
                    x = graph.call_function(fn, (x, *extra))
            x = graph.call_function(pass_on, (x,))
        new.append(x)
    out.args = (tuple(new),)
    graph.lint()
    top.recompile()


def apply_boundary_inputs(top: torch.fx.GraphModule, sub, info: StageInfo, plan, boundary: Layout,
                          rank: int, base: int) -> Layout:
    """:func:`galvatron_fx.parallelize.apply_resharding` for the stage, then every read of a received
    value is rebuilt from the boundary layout (batched) or wrapped in :func:`~.reshard.replicated`.
    Returns the stage's output layout."""
    T = _transform_module()

    received = {cv.name: cv for cv in info.received}
    ph = {x.name: x for x in top.graph.nodes if x.op == "placeholder" and x.name in received}
    saved = {}
    for name, x in ph.items():   # NOTE: replicated values must not be sliced like graph inputs
        if not received[name].batched:
            saved[name] = x.meta.get("val")
            x.meta["val"] = None
    out_layout = T.apply_resharding(top, sub, rank, base)
    for name, val in saved.items():
        ph[name].meta["val"] = val
    graph = top.graph
    layouts = [Layout(lp.tp, lp.dp, lp.sp, base) for lp in sub.layers]
    cache: dict = {}
    for i, call in sorted(T._layer_calls(top).items()):
        dst = layouts[i]
        args = list(call.args)
        for j, a in enumerate(args):
            p = a
            if (isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target is slice_input
                    and a.args[0].op == "placeholder" and a.args[0].name in received):
                p = a.args[0]
            if not (isinstance(p, torch.fx.Node) and p.op == "placeholder" and p.name in received):
                continue
            if (p, i) not in cache:
                cv = received[p.name]
                x = p
                with graph.inserting_before(call):
                    if cv.batched:
                        for fn, extra in reshard.plan_batched(boundary, dst, rank):
                            x = graph.call_function(fn, (x, *extra))
                    else:
                        x = graph.call_function(reshard.replicated, (x, dst.dp_ranks(rank),
                                                                     plan.layers[cv.producer_layer].dp))
                cache[(p, i)] = x
            args[j] = cache[(p, i)]
        call.args = tuple(args)
    for x in list(graph.nodes):
        if x.op == "call_function" and x.target is slice_input and not x.users:
            graph.erase_node(x)
    graph.lint()
    top.recompile()
    return out_layout


def _rename_layers(top: torch.fx.GraphModule, first: int) -> None:
    """``layers_<local>`` -> ``layers_<global index>`` so the stage's code names the plan's layers."""
    if first == 0:
        return
    count = sum(1 for name, _ in top.named_children() if name.startswith("layers_"))
    for i in reversed(range(count)):
        mod = getattr(top, layer_module_name(i))
        delattr(top, layer_module_name(i))
        top.add_submodule(layer_module_name(first + i), mod)
    for x in reversed(list(top.graph.nodes)):
        if x.op in ("call_module", "get_attr") and x.target.startswith("layers_"):
            x.target = layer_module_name(first + int(x.target.split("_")[1]))
            if x.op == "call_module" or x.name.startswith("layers_"):
                x._rename(x.target)
    top.recompile()


# ------------------------------------------------------------------------------------ runtime
class _StageRunner(nn.Module):
    """What ``PipelineStage`` calls: ``forward(*received)`` -> the stage graph on this micro-batch's
    local graph inputs (set by :meth:`PipelineModel.train_step`) and the received values."""

    def __init__(self, stage: DistributedModel, first: bool):
        super().__init__()
        self.stage = stage
        self.first = first
        self.local: list[list[torch.Tensor]] = []
        self.chunk = 0

    def forward(self, *received):
        if self.first:   # stage 0: its local inputs are the schedule's root arguments
            return self.stage(*received)
        return self.stage(*self.local[self.chunk], *received)


def _make_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        """PipelineStage telling the runner which micro-batch runs, the flat buffers which backward
        is the last, and recording the forward/backward order and the saved activation bytes."""

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            stats = self.stats
            self.submod.chunk = fwd_chunk_id
            stats["order"].append(f"F{fwd_chunk_id}")
            if not self.track_memory:
                out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
                stats["in_flight"] += 1
                stats["peak_in_flight"] = max(stats["peak_in_flight"], stats["in_flight"])
                return out
            counted: dict = {}
            params = self.param_storages()  # NOTE: ZeRO-3 buffers are re-allocated per gather:
            # the lookup below re-reads them when a saved tensor is not a known storage

            def pack(t):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in counted and ptr not in params and ptr not in self.param_storages():
                    counted[ptr] = st.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            nbytes = sum(counted.values())
            stats["chunk_bytes"][fwd_chunk_id] = nbytes
            stats["live_bytes"] += nbytes
            stats["in_flight"] += 1
            stats["peak_in_flight"] = max(stats["peak_in_flight"], stats["in_flight"])
            stats["peak_saved_bytes"] = max(stats["peak_saved_bytes"], stats["live_bytes"])
            return out

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            for s in self.stores:
                s.last_micro_batch = last_backward
            self.stats["order"].append(f"B{bwd_chunk_id}")
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            grads = self.bwd_cache.get(bwd_chunk_id)
            if grads is not None:   # NOTE: p2p sends need contiguous gradients
                self.bwd_cache[bwd_chunk_id] = tuple(g.contiguous() if isinstance(g, torch.Tensor) else g
                                                     for g in grads)
            self.stats["in_flight"] -= 1
            self.stats["live_bytes"] -= self.stats["chunk_bytes"].pop(bwd_chunk_id, 0)

    return _Stage


class PipelineModel(nn.Module):
    """This rank's pipeline stage under a ``pp > 1`` plan.

    ``stage`` is the stage's :class:`~.module.DistributedModel` (``print(dist_model.code)`` shows
    it: its ``layers_<i>`` submodules carry the plan's global layer indices); ``stage_index`` /
    ``num_stages`` / ``stage_info`` say which part of the model this rank runs. ``forward`` runs the
    stage graph on one micro-batch (``local inputs`` then received values, see
    :class:`~galvatron_fx.passes.stage_split.StageInfo`); train with :meth:`train_step`.
    ``schedule_stats`` (after a step): the forward/backward order of this stage (``"F0", "B0"``),
    ``peak_in_flight`` micro-batches (forwarded, not yet backwarded) and ``peak_saved_bytes`` (the
    activation bytes autograd held for them, parameters excluded).
    """

    def __init__(self, stage: DistributedModel, plan, info: StageInfo, *, n_inputs: int, rank: int,
                 stage_size: int):
        super().__init__()
        self.stage = stage
        self.plan, self.stage_info, self.rank, self.stage_size = plan, info, rank, stage_size
        self.stage_index, self.num_stages = info.index, info.num_stages
        self._n_inputs = n_inputs
        self.__dict__["_runner"] = _StageRunner(stage, first=info.index == 0)
        self.__dict__["_built"] = None
        self.schedule_stats: dict = {}

    @property
    def code(self) -> str:
        return self.stage.code

    @property
    def track_memory(self) -> bool:
        """Record the bytes each micro-batch saves for backward in :attr:`schedule_stats`
        (``peak_saved_bytes``). NOTE: off by default: it runs a Python hook per saved tensor."""
        return self.__dict__.get("_track_memory", False)

    @track_memory.setter
    def track_memory(self, on: bool) -> None:
        self.__dict__["_track_memory"] = bool(on)
        if self._built is not None:
            self._built[1]._stage.track_memory = bool(on)

    def extra_repr(self) -> str:
        return (f"stage_index={self.stage_index}, num_stages={self.num_stages}, layers "
                f"{self.stage_info.first}..{self.stage_info.last}, schedule={self.plan.schedule}, "
                f"micro_batches={self.plan.micro_batches}")

    def forward(self, *inputs):
        return self.stage(*inputs)

    # ---------------------------------------------------------------- training
    def train_step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the full global batch through the pipeline schedule; returns the
        global-batch mean loss (the same 0-dim tensor on every rank, from the last stage).

        ``inputs`` are the graph's inputs, each the whole global batch along dim 0, on every rank,
        then any targets of ``loss_fn(output, *targets)``. The batch is cut into
        ``plan.micro_batches`` equal micro-batches; the loss is their mean of means, as single-device
        training on the full batch. Afterwards this stage's parameters hold their gradients.
        """
        if len(inputs) < self._n_inputs:
            raise ConfigError(f"train_step needs the graph's {self._n_inputs} inputs, got {len(inputs)}")
        graph_inputs, targets = inputs[:self._n_inputs], inputs[self._n_inputs:]
        m, info = self.plan.micro_batches, self.stage_info
        local = [graph_inputs[i] for i in info.local_inputs]
        batch = next((t.shape[0] for t in graph_inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if batch is None or batch % m or (batch // m) % self.stage_size:
            raise ConfigError(f"the global batch of {batch} samples must split into micro_batches={m} "
                              f"micro-batches divisible by the {self.stage_size} ranks of a stage")
        schedule = self._schedule(batch // m, local)
        for s in self.stage._stores:
            s.zero_grad_state()
        runner = self._runner
        runner.local = [list(c) for c in zip(*[_split(t, m) for t in local])] if local else [[]] * m
        self._targets = [_split(t, m) for t in targets]
        self._losses: list[torch.Tensor] = []
        stats = schedule._stage.stats
        stats.update(order=[], chunk_bytes={}, live_bytes=0, in_flight=0, peak_in_flight=0, peak_saved_bytes=0)
        kwargs = {"target": torch.arange(m), "return_outputs": False} if info.is_last else {}
        if info.index == 0:
            schedule.step(*local, **kwargs)
        else:
            schedule.step(**kwargs)
        for s in self.stage._stores:
            s.finish_grad_sync()
        self.schedule_stats = {k: stats[k] for k in ("order", "peak_in_flight", "peak_saved_bytes")}
        total = torch.zeros(())
        if info.is_last:
            total = torch.stack(self._losses).float().sum() / m / self.stage_size
        # NOTE: the last stage's ranks each hold the mean over their output slice; a world sum of
        # those / N (0 elsewhere) is the global mean, bit-identical on every rank.
        dist.all_reduce(total)
        return total

    def _loss(self, out, index):
        lay, m = self.stage.output_layout, self.plan.micro_batches
        k = int(index.reshape(-1)[0])
        targets = [slice_input(t[k], lay.batch_index(self.rank), lay.dp) for t in self._targets]
        loss = self.stage._loss(out, targets)
        self._losses.append(loss.detach())
        return loss / (lay.dp * m)

    def _schedule(self, micro_batch: int, local: list[torch.Tensor]):
        key = (micro_batch, tuple(tuple(t.shape) for t in local))
        if self._built is not None and self._built[0] == key:
            return self._built[1]
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        info, n = self.stage_info, self.stage_size
        m = self.plan.micro_batches

        def meta(cv):
            shape = (micro_batch // n, *cv.shape[1:]) if cv.batched else cv.shape
            return torch.empty(shape, dtype=cv.dtype, device="meta").requires_grad_(cv.requires_grad)

        if info.index == 0:
            inputs = tuple(c[0] for c in (_split(t, m) for t in local))
        else:
            inputs = tuple(meta(cv) for cv in info.received)
        outputs = (torch.empty((), device="meta"),) if info.is_last else tuple(meta(cv) for cv in info.sent)
        device = next((p.device for p in self.stage.parameters()), torch.device("cpu"))
        pipe = group(tuple(self.rank % n + s * n for s in range(self.num_stages)))
        stage = _make_stage_class()(self._runner, info.index, self.num_stages, device,
                                    input_args=inputs, output_args=outputs, group=pipe)
        stage.stats = {}
        stage.track_memory = self.track_memory
        stage.stores = self.stage._stores
        stores = weakref.ref(self.stage)

        def param_storages():
            st = stores()
            ptrs = set()
            for s in (st._stores if st is not None else []):
                ptrs.add(s.flat_param.untyped_storage().data_ptr())
                if s.full is not None:
                    ptrs.add(s.full.untyped_storage().data_ptr())
            return ptrs

        stage.param_storages = param_storages
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.plan.schedule]
        schedule = cls(stage, n_microbatches=m, loss_fn=self._loss, scale_grads=False)
        self.__dict__["_built"] = (key, schedule)
        return schedule

    # --------------------------------------------------------------- optimizer
    def optimizer(self, cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
        """An optimizer over this stage's parameters (see :meth:`DistributedModel.optimizer`)."""
        return self.stage.optimizer(cls, **kwargs)

    def sync_params(self) -> None:
        self.stage.sync_params()

    # ------------------------------------------------------------- state dicts
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fqn -> unsharded parameter of the whole model (every stage's), on **every rank**
        (collective over the world; tied weights under their owner stage's name)."""
        local = self.stage.full_state_dict()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local if self.rank % self.stage_size == 0 else None)
        out: dict[str, torch.Tensor] = {}
        for d in gathered:
            if d:
                out.update(d)
        return out

    def states_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """This rank's measured parameter / gradient / optimizer-state bytes (its stage's)."""
        return self.stage.states_bytes(optimizer)
