"""Pipeline parallelism at run time: this rank's stage under a ``pp > 1`` plan.

:class:`PipelineModel` holds the stage's :class:`~.module.DistributedModel` (built by the one pass
list of :mod:`galvatron_fx.parallelize`: stage split, then the pp = 1 passes on the stage, then the
stage-boundary passes of :mod:`galvatron_fx.passes.stage_boundaries`, which document the boundary
layout) and runs it under a ``torch.distributed.pipelining`` schedule.

Rank layout (see :mod:`.groups`): stages outermost, stage ``k`` owns global ranks
``[k*N, (k+1)*N)`` with ``N = world_size / pp``; local rank ``j`` of every stage talks to local rank
``j`` of the next over the p2p group ``{j, N+j, 2N+j, ...}``. Under ``interleaved-1f1b`` with
``virtual_stages = v`` the plan's ``pp * v`` chunks go round-robin over the stages (chunk ``c`` on
stage ``c % pp``): each rank runs ``v`` chunks, each built by the same pass list, behind one
:class:`~.chunk_set.ChunkSet`.

Zero-bubble schedules (``interleaved-zb``, ``zbv``, ``dualpipev``) split each backward into an
input-gradient pass ``I`` and a weight-gradient pass ``W`` with torch's ``stage_backward_input``
/ ``stage_backward_weight`` logic: the weights are each parameter's view of its layer's buffer
(recorded per micro-batch in forward, :func:`~.data_parallel._entry`), so ``W`` stops at them and
re-runs nothing of the input-gradient chain; ``W`` hands each layer's gradients to its store
(DP reduction, ZeRO reduce-scatters) and ZeRO-3 buffers stay gathered (``pins``) from ``I`` to
``W``.

NOTE: built on ``torch.distributed.pipelining`` (``PipelineStage`` + the schedule classes of
:class:`galvatron_fx.schedule.Schedule`) with static shapes (no meta-device shape
inference, which the stage's collectives would break). ``scale_grads=False``: the loss is scaled by ``1 / (dp * m)`` instead,
as in pp = 1 training, and the layers' flat buffers run their DP reduction on the schedule's
``last_backward``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..ir import StageInfo
from ..schedule import SCHEDULE
from .dropout import evaluating
from .groups import group
from .inputs import apply_steps, match_inputs, to_shards
from .inputs import split as _split
from .module import DistributedModel, gather_outputs
from .pipeline_stage import StageRunner, make_stage_class, param_storages, schedule_stages
from .reshard import plan_batched


class PipelineModel(nn.Module):
    """This rank's pipeline stage under a ``pp > 1`` plan.

    ``stage`` is the stage's :class:`~.module.DistributedModel` (``print(dist_model.code)`` shows
    it: its ``layers_<i>`` submodules carry the plan's global layer indices); ``stage_index`` /
    ``num_stages`` / ``stage_info`` say which part of the model this rank runs. ``forward`` runs the
    stage graph on one micro-batch (``local inputs`` then received values, see
    :class:`~galvatron_fx.ir.StageInfo`); train with :meth:`train_step`.
    ``schedule_stats`` (after a step): the forward/backward order of this stage (``"F0", "B0"``;
    ``"F0@2"``: chunk 2's, when the rank runs several),
    ``peak_in_flight`` micro-batches (forwarded, not yet backwarded) and ``peak_saved_bytes`` (the
    activation bytes autograd held for them, parameters excluded); zero-bubble: ``peak_wgrad_bytes``
    (the output gradients held from the input- to the weight-gradient pass).
    """

    def __init__(self, chunks: list[DistributedModel], plan, infos: list[StageInfo], *, input_names: list[str],
                 rank: int, stage_size: int):
        super().__init__()
        from .chunk_set import ChunkSet

        self.stage = chunks[0] if len(chunks) == 1 else ChunkSet(chunks)
        self.plan, self.rank, self.stage_size = plan, rank, stage_size
        self.stage_info = infos[0]
        self.chunk_infos = list(infos)
        self.stage_index, self.num_stages = rank // stage_size, plan.pp
        self._input_names = list(input_names)
        last = next((c for c, i in zip(chunks, infos) if i.is_last), None)
        self.__dict__["_chunks"] = list(chunks)
        self.__dict__["_last"] = last   # the chunk computing the loss, where this rank holds it
        self.__dict__["_runners"] = [StageRunner(c, first=i.index == 0, loss_of=self._loss if i.is_last else None)
                                     for c, i in zip(chunks, infos)]
        self.__dict__["_schedules"] = {}   # (micro-batch rows, local input shapes) -> schedule
        self.schedule_stats: dict = {}

    @property
    def holds_first(self) -> bool:
        """Whether this rank runs the model's first chunk (it takes the schedule's inputs)."""
        return self.chunk_infos[0].index == 0

    @property
    def holds_last(self) -> bool:
        """Whether this rank runs the model's last chunk (it computes the loss)."""
        return self._last is not None

    @property
    def code(self) -> str:
        return self.stage.code

    @property
    def stores(self):
        """This stage's per-layer flat parameter stores (see :attr:`DistributedModel.stores`)."""
        return self.stage.stores

    @property
    def track_memory(self) -> bool:
        """Record the bytes each micro-batch saves for backward in :attr:`schedule_stats`
        (``peak_saved_bytes``). NOTE: off by default: it runs a Python hook per saved tensor."""
        return self.__dict__.get("_track_memory", False)

    @track_memory.setter
    def track_memory(self, on: bool) -> None:
        self.__dict__["_track_memory"] = bool(on)
        for schedule in self._schedules.values():
            for stage in schedule_stages(schedule):
                stage.track_memory = bool(on)

    def extra_repr(self) -> str:
        layers = ", ".join(f"{i.first}..{i.last}" for i in self.chunk_infos)
        return (f"stage_index={self.stage_index}, num_stages={self.num_stages}, layers {layers}, "
                f"schedule={self.plan.schedule}, micro_batches={self.plan.micro_batches}")

    def forward(self, *inputs):
        return self.stage(*inputs)

    # ---------------------------------------------------------------- training
    def train_step(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the full global batch through the pipeline schedule; returns the
        global-batch mean loss (the same 0-dim tensor on every rank, from the last stage).

        Inputs as :meth:`DistributedModel.train_step` (positional and/or by forward-argument
        name, each the whole global batch along dim 0, on every rank; extra positional inputs are
        targets of ``loss_fn(output, *targets)``). The batch is cut into ``plan.micro_batches``
        equal micro-batches; the loss is their mean of means, as single-device training on the full
        batch. Afterwards this stage's parameters hold their gradients.
        """
        return self._run(args, kwargs, "train_step", train=True)

    @torch.no_grad()
    def eval_step(self, *args: torch.Tensor, return_outputs: bool = False, **kwargs: torch.Tensor):
        """Forward only through the pipeline (``schedule.eval``); returns the global-batch mean loss
        on every rank and, with ``return_outputs=True``, ``(loss, outputs)``: the graph's outputs
        assembled over the last stage's DP group and the micro-batches, then sent from the last
        stage to every rank (memory: the global batch's outputs on every rank)."""
        with evaluating():   # dropout off, as under model.eval()
            return self._run(args, kwargs, "eval_step", train=False, collect=return_outputs)

    def _run(self, args, kwargs, where: str, *, train: bool, collect: bool = False):
        self.stage.check_ready()
        first = self._chunks[0]
        graph_inputs, targets = match_inputs(self.input_names, args, kwargs, where, first.baked_inputs)
        m = self.plan.micro_batches
        # NOTE: each chunk reads its own graph inputs (its StageInfo's local_inputs); one sharding
        # of all of them, then each chunk takes its own
        positions = [pos for info in self.chunk_infos for pos in info.local_inputs]
        (index, size), given = self.input_shard, [graph_inputs[i] for i in positions]
        batch = self._agreed_batch(first.call_batch(given + targets, where))
        shards, sharded = to_shards(given + targets, batch, index, size, m, where)
        local, targets = shards[:len(given)], shards[len(given):]
        per_chunk, at = [], 0
        for info in self.chunk_infos:
            per_chunk.append(local[at:at + len(info.local_inputs)])
            at += len(info.local_inputs)
        schedule = self._schedule(batch // m, per_chunk)
        last = self._last
        if last is not None and last.token_loss is not None:
            if sharded:
                counted = list(graph_inputs)
                for pos, t in zip(positions, local):
                    counted[pos] = t
                last.token_loss.prepare(counted, last.input_layout.dp_ranks(self.rank))
            else:
                last.token_loss.prepare(graph_inputs)
        self.stage.sync_params()   # ZeRO-2: the shards the user's optimizer updated -> whole buffers
        if train:
            self.stage.params.check_requires_grad()
        for s in self.stage.stores:
            s.zero_grad_state()
        for runner, mine in zip(self._runners, per_chunk):
            runner.local = [list(c) for c in zip(*[_split(t, m) for t in mine])] if mine else [[]] * m
            runner.outputs = {} if collect and runner.loss_of is not None else None
        self._targets = [_split(t, m) for t in targets]
        self._losses: list[torch.Tensor] = []
        stats = schedule_stages(schedule)[0].stats   # NOTE: one dict shared by this rank's chunks
        stats.update(order=[], chunk_bytes={}, live_bytes=0, in_flight=0, peak_in_flight=0, peak_saved_bytes=0,
                     wgrad_bytes=0, peak_wgrad_bytes=0)
        step = schedule.step if train else schedule.eval
        kw = {"target": torch.arange(m), "return_outputs": False} if self.holds_last else {}
        step(*per_chunk[0], **kw) if self.holds_first else step(**kw)
        if train:
            self.stage.finish_grad_sync()
        else:
            for s in self.stage.stores:
                s.free_full()
        self.schedule_stats = {k: stats[k] for k in ("order", "peak_in_flight", "peak_saved_bytes", "peak_wgrad_bytes")}
        device = next((p.device for p in self.stage.parameters()), None) or next(
            (t.device for t in graph_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        total = torch.zeros((), device=device)
        if last is not None:
            lay = last.output_layout
            per_rank = m * lay.dp if last.token_loss is None else 1
            total = torch.stack(self._losses).float().sum() / per_rank / (self.stage_size // lay.dp)
        # NOTE: the last stage's ranks each hold the mean (or, for a token loss, their share of the
        # global mean) over their output slice; the world sum of these (0 elsewhere) is the global
        # loss, bit-identical on every rank.
        dist.all_reduce(total)
        if not collect:
            return total
        box = [None]
        if last is not None:
            outputs = self._runners[-1].outputs
            box[0] = gather_outputs([outputs[k] for k in range(m)], last.output_layout, self.rank)
        # NOTE: the outputs exist on the last chunk's stage; each of its ranks hands them down its
        # p2p group, so every rank returns them (the cost: the global batch's outputs on every rank)
        pipe = self._pipe()
        src = pipe[self.plan.chunk_rank(self.plan.num_chunks - 1)]
        dist.broadcast_object_list(box, src=src, group=group(pipe))
        return total, box[0]

    def _pipe(self) -> tuple[int, ...]:
        """The global ranks of this rank's pipe: its local rank in every stage."""
        n = self.stage_size
        return tuple(self.rank % n + s * n for s in range(self.num_stages))

    def _agreed_batch(self, seen: int | None) -> int:
        """The global batch of this call on every stage: a stage that reads no input does not see
        it, so under a symbolic batch the stages exchange what they saw (one small all-gather)."""
        planned = self.plan.global_batch_size
        if not self._chunks[0].symbolic_batch:
            return seen or planned
        pipe = self._pipe()
        device = next((p.device for p in self.stage.parameters()), torch.device("cpu"))
        mine = torch.tensor([seen or 0], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in pipe]
        dist.all_gather(every, mine, group=group(pipe))
        sizes = {int(x) for x in every if x}
        if len(sizes) > 1:
            raise ConfigError(f"the pipeline stages were given different global batches {sorted(sizes)}; give "
                              "every rank the same step's inputs")
        return sizes.pop() if sizes else planned

    @property
    def input_names(self) -> list[str]:
        """The model's inputs in order (forward-argument names), as :attr:`DistributedModel.input_names`."""
        return self._input_names

    @property
    def input_shard(self) -> tuple[int, int]:
        """``(index, size)`` of this rank's data shard within its stage (:attr:`DistributedModel.input_shard`;
        a stage that reads no input may be given ``None`` for it)."""
        return self._chunks[0].input_shard

    def _loss(self, out, k: int) -> torch.Tensor:
        """Micro-batch ``k``'s loss over this rank's output slice (the last stage's runner output)."""
        last = self._last
        steps = plan_batched(last.input_layout, last.output_layout, self.rank)
        targets = [apply_steps(steps, t[k]) for t in self._targets]
        loss = last._loss(out, targets)
        self._losses.append(loss.detach())
        return loss

    def _scaled_loss(self, loss, _index):
        """The schedule's loss: the micro-batch loss times :attr:`DistributedModel.loss_scale`, so
        the DP *sum* of gradients is the gradient of the global loss."""
        return loss * self._last.loss_scale

    def _schedule(self, micro_batch: int, per_chunk: list[list[torch.Tensor]]):
        key = (micro_batch, tuple(tuple(tuple(t.shape) for t in local) for local in per_chunk))
        if key in self._schedules:   # NOTE: one per batch size seen (a last, smaller batch; eval)
            return self._schedules[key]
        from torch.distributed.pipelining import schedules

        n, m = self.stage_size, self.plan.micro_batches

        def meta(cv):
            shape = (micro_batch // n * cv.rows, *cv.shape[1:]) if cv.batched else cv.shape
            return torch.empty(shape, dtype=cv.dtype, device="meta").requires_grad_(cv.requires_grad)

        device = next((p.device for p in self.stage.parameters()), torch.device("cpu"))
        pipe = group(self._pipe())
        stats: dict = {}
        stages = []
        for runner, info, local in zip(self._runners, self.chunk_infos, per_chunk):
            if info.index == 0:
                inputs = tuple(c[0] for c in (_split(t, m) for t in local))
            else:
                inputs = tuple(meta(cv) for cv in info.received)
            outputs = (torch.empty((), device="meta"),) if info.is_last else tuple(meta(cv) for cv in info.sent)
            stage = make_stage_class()(runner, info.index, info.num_stages, device,
                                        input_args=inputs, output_args=outputs, group=pipe)
            stage.stats = stats
            stage.chunk_tag = f"@{info.index}" if len(per_chunk) > 1 else ""   # "F3@2": micro-batch 3, chunk 2
            stage.track_memory = self.track_memory
            stage.stores = runner.stage.stores
            stage.split = SCHEDULE[self.plan.schedule].split_backward   # backward as I, then W
            stage.views, stage._mb = {}, None                  # micro-batch -> its parameter views
            stage.held = {}                                    # micro-batch -> gradient bytes held to W
            stage.param_storages = param_storages(self.stage)
            stages.append(stage)
        sch = SCHEDULE[self.plan.schedule]
        cls = getattr(schedules, sch.torch_class)
        if sch.single_chunk:
            schedule = cls(stages[0], n_microbatches=m, loss_fn=self._scaled_loss, scale_grads=False)
        else:
            schedule = cls(stages, n_microbatches=m, loss_fn=self._scaled_loss, scale_grads=False)
        self._schedules[key] = schedule
        return schedule

    # -------------------------------------------------------------- parameters
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This stage's parameters under their original names (:meth:`DistributedModel.named_parameters`)."""
        return self.stage.named_parameters(prefix)

    def parameters(self, recurse: bool = True):
        return self.stage.parameters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """The whole model's gradient norm (every stage's; the same on every rank), this stage's
        gradients clipped by it: torchtitan's pipeline ``clip_grad_norm_`` (collective over the world)."""
        return self.stage.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """This stage's :meth:`DistributedModel.state_dict` (other stages hold the other entries)."""
        return self.stage.state_dict(destination=destination, prefix=prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """:meth:`DistributedModel.load_state_dict` for this stage's parameters (entries of other
        stages are ignored; ``strict`` checks that this stage's are all there)."""
        mine = {k: v for k, v in dict(state_dict).items() if k in self.stage.params.params}
        if strict:
            missing = [k for k in self.stage.params.params if k not in mine]
            if missing:
                raise ConfigError(f"load_state_dict: missing {missing[:5]} of pipeline stage {self.stage_index}")
        return self.stage.load_state_dict(mine, strict=False)

    def init_weights(self, fn=None, seed: int | None = None, model=None) -> None:
        """:meth:`DistributedModel.init_weights` (every stage initialises in the same order)."""
        self.stage.init_weights(fn=fn, seed=seed, model=model)

    def load_pretrained(self, directory: str, model=None) -> None:
        """:meth:`DistributedModel.load_pretrained` for this stage's parameters."""
        self.stage.load_pretrained(directory, model=model)

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
