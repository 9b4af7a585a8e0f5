"""The distributed module ``gfx.transform`` returns: a GraphModule with ``train_step``.

``DistributedModel`` is the top graph of :mod:`galvatron_fx.passes.split_layers` after the
runtime rewrites; ``forward(*graph_inputs)`` runs one micro-batch (every rank passes the *whole*
micro-batch; the graph keeps this rank's slice) and returns this rank's output (the loss over its
batch slice for zoo models).

Its parameters are the original ones, under their original names: ``named_parameters()`` yields a
:class:`~.params.ShardedParameter` per parameter of the stage (this rank's part of it, a view of the
layer buffers; see :mod:`.params`), so the user's optimizer, param groups, frozen parameters and
``torch.nn.utils.clip_grad_norm_`` work as on the original model. ``state_dict()`` holds the same
objects (DCP saves and loads them in place); ``load_state_dict`` also takes whole tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
from torch.utils._pytree import tree_map_only

from ..errors import ConfigError
from ..ir import META_KEY
from .data_parallel import FlatParams, wait_for_host_copies
from .dropout import evaluating
from .groups import Layout
from .inputs import apply_steps, call_batch, gather_rows, match_inputs, to_shards
from .inputs import split as _split
from .params import ShardedParameter
from .precision import DynamicLossScaler, Precision
from .reshard import plan_batched


@dataclass
class TokenLoss:
    """The exact token mean of a rewritten cross-entropy (see ``passes/token_loss.py``): the graph's
    loss is ``sum of this slice's token losses * scale``; :meth:`prepare` sets ``scale = 1 / N``
    with ``N`` the non-ignored targets of the whole global batch (``count(*graph_inputs)``), so the
    losses and gradients of all ranks and micro-batches *sum* to single-device training's."""

    count: torch.fx.GraphModule
    scale: torch.Tensor

    @torch.no_grad()
    def prepare(self, graph_inputs, shard_ranks: tuple[int, ...] = ()) -> None:
        """``graph_inputs``: the whole global batch, or (``shard_ranks``: the ranks whose shards
        make it up) this rank's shard, whose rows the count reads are gathered first."""
        if len(shard_ranks) > 1:
            used = {i for i, n in enumerate(n for n in self.count.graph.nodes if n.op == "placeholder") if n.users}
            graph_inputs = [gather_rows(t, shard_ranks) if i in used else t for i, t in enumerate(graph_inputs)]
        self.scale.copy_(1.0 / self.count(*graph_inputs).to(self.scale))


class DistributedModel(torch.fx.GraphModule):
    """This rank's part of a model under a plan (pp = 1). See :meth:`train_step`."""

    symbolic_batch = False   # the graph computes its batch sizes: any multiple of dp x m runs (codegen sets it)
    shards_before = False    # the last call passed this rank's shard (a call of another size does too)

    def setup(self, plan, rank: int, loss_fn, output_layout: Layout, stores: list[FlatParams],
              tp_shards: dict[str, tuple[object, tuple[int, ...]]],
              token_loss: TokenLoss | None = None, precision: Precision | None = None,
              input_layout: Layout | None = None) -> DistributedModel:
        self.plan, self.rank, self.loss_fn = plan, rank, loss_fn
        self.token_loss = token_loss
        self.precision = precision or Precision()
        # fp16-mixed: dynamic loss scaling (runtime/precision.py); ``loss_scaler.last_skipped``
        # says whether the last train_step dropped its gradients after an overflow
        self.loss_scaler = DynamicLossScaler() if self.precision.loss_scaling else None
        self.output_layout = output_layout
        self.input_layout = input_layout or Layout(1, plan.world_size)
        self._stores = stores
        self._tp_shards = tp_shards
        self.params = None   # ParamRegistry, set by the bind_parameters pass
        # NOTE: False under torch.compile, whose backward hands out the gradients (scaled by the
        # incoming gradient) instead of train_step
        self.grads_after_step = True
        return self

    @property
    def stores(self) -> list[FlatParams]:
        """This rank's flat buffers, :class:`~.data_parallel.FlatParams` (per layer: one for its
        trainable parameters, one for its frozen ones, where it has them; in layer order): the
        storage behind :meth:`named_parameters`, used by benchmarks and memory checks."""
        return self._stores

    # -------------------------------------------------------------- parameters
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """``(original fqn, ShardedParameter)`` for every parameter of this rank's stage, trainable
        and frozen, in the model's order (tied weights once, under their first name)."""
        for fqn, p in self.params.named():
            yield prefix + fqn, p

    def parameters(self, recurse: bool = True):
        for _fqn, p in self.named_parameters():
            yield p

    # ----------------------------------------------------- meta-device models
    def captured_model(self):
        """The model this program was captured from (``None`` when it is gone)."""
        ref = getattr(self.meta.get(META_KEY), "model_ref", None)
        return ref() if ref is not None else None

    def init_weights(self, fn=None, seed: int | None = None, model=None) -> None:
        """Initialise this rank's parts only (:func:`.materialize.init_weights`): the model's own
        initialiser, one module at a time on the CPU, the random stream as one device's
        ``torch.manual_seed(seed); model.initialize_weights()`` (``reset_parameters`` / ``fn(module)``
        for other models). For a graph captured on the meta device; collective for ZeRO-2."""
        from .materialize import init_weights

        init_weights(self, self._model_or(model), fn=fn, seed=seed)

    def load_pretrained(self, directory: str, model=None) -> None:
        """Read only this rank's pieces from a ``save_pretrained`` directory's safetensors
        (:func:`.materialize.load_pretrained`)."""
        from .materialize import load_pretrained

        load_pretrained(self, self._model_or(model), directory)

    def _model_or(self, model):
        model = model if model is not None else self.captured_model()
        if model is None:
            raise ConfigError("the captured model is gone: pass it, dist_model.init_weights(model=...)")
        return model

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the total ``norm_type``-norm of
        every gradient (every pipeline stage's), the same on every rank; clips this rank's
        gradients by it and returns it (collective over the world: call it on every rank)."""
        return self.params.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """fqn -> :class:`~.params.ShardedEntry` (the parameter's global shape, this rank's pieces
        of it, viewing the parameter): a DCP sharded state dict, as FSDP2's DTensors are;
        ``torch.distributed.checkpoint.load`` into it loads the model in place (then call
        :meth:`load_state_dict` with it). Buffers (position ids, rotary tables) are rebuilt by the
        graph and not included. :meth:`full_state_dict` gathers whole tensors."""
        from .params import ShardedEntry

        out = destination if destination is not None else {}
        for fqn, p in self.params.named():
            out[prefix + fqn] = ShardedEntry(p)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load parameters by original name: whole tensors (a ``full_state_dict()``, a consolidated
        checkpoint, the original model's ``state_dict()``; this rank keeps its part) or this
        model's own :meth:`state_dict` after ``dcp.load`` filled it. Collective for ZeRO-2 (the
        replicated buffers are re-gathered)."""
        from torch.nn.modules.module import _IncompatibleKeys

        missing, unexpected = self.params.load_whole(dict(state_dict), strict=strict)
        self.loaded()
        return _IncompatibleKeys(missing, unexpected)

    def loaded(self) -> None:
        """After values were copied into the parameters: mark the buffers initialised (a meta-device
        model; ``strict=False`` leaves the rest to you), refresh the working copies (collective for
        ZeRO-2)."""
        for s in self._stores:
            s.initialized = True
            s.masters_changed()
        self.sync_params()

    # ---------------------------------------------------------------- training
    @property
    def input_shard(self) -> tuple[int, int]:
        """``(index, size)``: ``DistributedSampler(num_replicas=size, rank=index)`` gives this rank's
        shard of a global batch, which :meth:`train_step` / :meth:`eval_step` accept instead of the
        whole batch (:mod:`.inputs`; ``size``: the ranks of this rank's pipeline stage)."""
        return self.input_layout.batch_index(self.rank), self.input_layout.dp

    @property
    def baked_inputs(self) -> dict:
        """Non-tensor inputs given at capture (``return_loss=True``), which calls may repeat."""
        info = self.meta.get(META_KEY)
        return getattr(info, "baked_inputs", None) or {}

    @property
    def input_names(self) -> list[str]:
        """The graph's inputs in order: the model's forward-argument names (``input_ids``, ...)."""
        return [n.name for n in self.graph.nodes if n.op == "placeholder"]

    def train_step(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the full global batch; returns the global-batch mean loss.

        The inputs are the graph's inputs (the model's tensor arguments, e.g. ``input_ids, labels``),
        positionally in :attr:`input_names` order and/or by name (``input_ids=..., labels=...``),
        each the *whole global batch* along dim 0, on every rank; further positional inputs are
        targets for ``loss_fn(output, *targets)`` (used only when the graph's output is not a scalar
        loss). The batch is cut into ``plan.micro_batches`` micro-batches (gradient accumulation).
        Gradients are reset at the start; on return each parameter of :meth:`parameters` (the layer
        buffers or this rank's shards) holds in ``.grad`` the gradient of the global-batch mean
        loss, and the returned loss (a 0-dim tensor) is the same on every rank.
        """
        self.check_ready()
        batches = self._micro_batches(args, kwargs, "train_step")
        self.params.check_requires_grad()
        for s in self._stores:
            s.zero_grad_state()
        total = None
        for k, (inputs, targets) in enumerate(batches):
            for s in self._stores:
                s.last_micro_batch = k == len(batches) - 1
            loss = self._loss(self(*inputs), targets)
            (loss * self.loss_scale).backward()
            total = loss.detach() if total is None else total + loss.detach()
        self.finish_grad_sync()
        return self.global_loss(total)

    def check_ready(self) -> None:
        """Raise naming the fix when a meta-device model has no values yet (:mod:`.materialize`)."""
        if not getattr(self, "_ready", False):
            from .materialize import check_materialized

            check_materialized(self)
            self._ready = True

    def finish_grad_sync(self) -> None:
        """End of a step's backward: wait for the DP reductions and fill the masters' ``.grad``;
        fp16: unscale them, or drop them on every rank after an inf/NaN on any rank (collective
        over the world); then hand each parameter its gradient view."""
        for s in self._stores:
            s.finish_grad_sync()
        wait_for_host_copies(self._stores)
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_or_skip([s for s in self._stores if s.trainable])
        if self.grads_after_step:
            self.params.attach_grads()

    def _micro_batches(self, args, kwargs, where: str) -> list[tuple[list, list]]:
        """Match the inputs (the whole global batch or this rank's shard, :mod:`.inputs`), prepare
        the step (the token count of a token loss) and cut the shard: per micro-batch, the graph
        inputs (this rank's input-layout slice) and its slices of the ``loss_fn`` targets."""
        graph_inputs, targets = match_inputs(self.input_names, args, kwargs, where, self.baked_inputs)
        m, index, size = self.plan.micro_batches, *self.input_shard
        batch = self.call_batch(graph_inputs + targets, where) or self.plan.global_batch_size
        shards, sharded = to_shards(graph_inputs + targets, batch, index, size, m, where)
        if self.token_loss is not None:
            if sharded:
                self.token_loss.prepare(shards[:len(graph_inputs)], self.input_layout.dp_ranks(self.rank))
            else:
                self.token_loss.prepare(graph_inputs)
        # NOTE: no sync_params(): each ZeRO-2 layer re-gathers its shards when the forward first
        # reads it, prefetched by the layer before (overlapping its compute)
        micro = [_split(t, m) for t in shards[:len(graph_inputs)]]
        micro_t = [_split(t, m) for t in shards[len(graph_inputs):]]
        to_output = plan_batched(self.input_layout, self.output_layout, self.rank)
        return [([mb[k] for mb in micro], [apply_steps(to_output, t[k]) for t in micro_t]) for k in range(m)]

    def call_batch(self, values: list, where: str) -> int | None:
        """This call's global batch (:func:`.inputs.call_batch`; remembers whether it came as shards)."""
        batch, sharded = call_batch(values, self.plan.global_batch_size, self.input_shard[1], self.plan.micro_batches,
                                    symbolic=self.symbolic_batch, shards_before=self.shards_before, where=where)
        if sharded is not None:
            self.shards_before = sharded
        return batch

    @property
    def loss_scale(self) -> float:
        """What each micro-batch's loss is scaled by before backward so that the DP *sum* of
        gradients is the gradient of the global loss: ``1 / (dp * m)`` for a mean over this
        rank's slice, 1 for a token loss (already its share of the global mean); times the
        dynamic loss scale under fp16 (:meth:`finish_grad_sync` divides it out again)."""
        share = 1.0 if self.token_loss is not None else 1.0 / (self.output_layout.dp * self.plan.micro_batches)
        return share * (self.loss_scaler.scale if self.loss_scaler is not None else 1.0)

    def global_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        """The global-batch loss from this rank's sum of micro-batch losses (collective; the same
        on every rank). NOTE: every TP rank of an output DP group holds the same value."""
        total = local_sum.float()
        if self.token_loss is None:
            return _world_mean(total / self.plan.micro_batches)
        if dist.get_world_size() > 1:
            dist.all_reduce(total)
        return total / (dist.get_world_size() // self.output_layout.dp)

    @torch.no_grad()
    def eval_step(self, *args: torch.Tensor, return_outputs: bool = False, **kwargs: torch.Tensor):
        """Forward only over the full global batch (inputs as :meth:`train_step`); returns the
        global-batch mean loss, the same on every rank, and with ``return_outputs=True`` also the
        graph's outputs assembled across ranks (``(loss, outputs)``; each output's batch slices
        all-gathered over the output's DP group and micro-batches concatenated, on every rank:
        the memory of the whole global batch's outputs, e.g. ``batch x seq x vocab`` logits)."""
        total, outs = None, []
        self.check_ready()
        for inputs, targets in self._micro_batches(args, kwargs, "eval_step"):
            with evaluating():   # dropout off, as under model.eval()
                out = self(*inputs)
            loss = self._loss(out, targets)
            total = loss if total is None else total + loss
            if return_outputs:
                outs.append(out)
        for s in self._stores:
            s.free_full()   # ZeRO-3 layers kept nothing gathered for a backward that never comes
        loss = self.global_loss(total)
        if not return_outputs:
            return loss
        return loss, gather_outputs(outs, self.output_layout, self.rank)

    def _loss(self, out, targets):
        if self.loss_fn is not None:
            if self.precision.mixed:   # the user's loss runs on fp32 outputs (the loss is fp32)
                out = tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, out)
            return self.loss_fn(out, *targets)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise ConfigError("the model's output is not a scalar loss; pass loss_fn=... to gfx.transform "
                              "and the targets as extra train_step inputs")
        return out.reshape(())

    # --------------------------------------------------------------- optimizer
    def optimizer(self, cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
        """``cls`` over the trainable :meth:`parameters` (``**kwargs`` its hyper-parameters): a
        convenience; any ``torch.optim`` optimizer the user builds over :meth:`parameters` or
        param groups from :meth:`named_parameters` works the same."""
        return cls([p for p in self.parameters() if p.requires_grad], **kwargs)

    def sync_params(self) -> None:
        """ZeRO-2: all-gather the shards an optimizer step (or a checkpoint load) changed into the
        whole buffers (collective over each DP group; a no-op when nothing changed). The forward
        does it layer by layer (prefetched) and :meth:`full_state_dict` runs it first, so users
        never need to."""
        for s in self._stores:
            s.sync_after_step()

    # ------------------------------------------------------------- state dicts
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fqn -> unsharded parameter (original fully qualified names; tied weights under their
        first name), on **every rank** (collective: call it on all ranks)."""
        self.sync_params()
        out: dict[str, torch.Tensor] = {}
        for s in self._stores:
            mine = {}
            for fqn, t in s.unsharded().items():
                if fqn in self._tp_shards:
                    info, ranks = self._tp_shards[fqn]
                    t = _unshard(t, info, ranks)
                mine[fqn] = t.detach().clone()
            if len(s.held_over) > 1:   # a loop's experts: every EP rank holds its own
                from .groups import group

                held: list = [None] * len(s.held_over)
                dist.all_gather_object(held, mine, group=group(s.held_over))
                mine = {k: v.to(s.device) for d in held for k, v in d.items()}
            out.update(mine)
        return out

    def states_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """This rank's measured bytes of model states, counting each storage once: ``params`` the
        buffers the layers compute with (fp32: the parameters themselves, ZeRO-2's whole buffer
        included; mixed: the low-precision working copies; ZeRO-3's gathered buffer is empty at
        rest), ``masters`` the fp32 masters of a mixed plan (0 for fp32), ``grads``, ``optimizer``
        and ``total``; ``host``: what offloaded layers keep in host memory (their masters, gradient
        copies and optimizer states: not in the other figures)."""
        seen: set[int] = set()

        def size(tensors) -> int:
            n = 0
            for t in tensors:
                st = t.untyped_storage()
                if st.data_ptr() in seen or st.size() == 0:
                    continue
                seen.add(st.data_ptr())
                n += st.nbytes()
            return n

        on = [s for s in self._stores if not s.offload]
        off = [s for s in self._stores if s.offload]
        working = [s.full for s in self._stores if s.full is not None] + [s.source for s in off if s.source is not None]
        mixed = any(s.mixed for s in self._stores)
        masters = size([s.flat_param for s in on]) if mixed else 0
        params = size(working if mixed else [s.flat_param for s in on] + working)
        grads = size([s.flat_param.grad for s in on if s.flat_param.grad is not None])
        offloaded, mine = {id(s) for s in off}, {id(s) for s in self._stores}
        # NOTE: the optimizer's states of this program's parameters (a chunk of a pipeline rank
        # counts its own), on the host for an offloaded layer's
        state = [(id(p.spec.store), st) for p, st in (optimizer.state.items() if optimizer is not None else ())
                 if isinstance(p, ShardedParameter) and id(p.spec.store) in mine]

        def states(host: bool) -> list:
            return [v for store, st in state if (store in offloaded) == host
                    for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        opt = size(states(False))
        host = size([s.flat_param for s in off] + [s.flat_param.grad for s in off if s.flat_param.grad is not None]
                    + states(True))
        return {"params": params, "masters": masters, "grads": grads, "optimizer": opt,
                "total": params + masters + grads + opt, "host": host}


def _world_mean(local: torch.Tensor) -> torch.Tensor:
    """The world mean of each rank's local mean loss: every TP rank of an output DP group holds the
    same local mean, so this is the mean over DP groups, bit-identical on every rank."""
    if dist.get_world_size() > 1:
        dist.all_reduce(local)
        local = local / dist.get_world_size()
    return local


def gather_outputs(per_micro_batch: list, lay: Layout, rank: int):
    """Graph outputs of every micro-batch on this rank -> the global batch's, on every rank of the
    output DP group: batched tensors (dim 0 = this rank's slice) all-gathered over DP, then the
    micro-batches concatenated; scalars (the loss) are dropped to ``None``. Vocab-sharded logits
    (:func:`~.vocab_parallel.vocab_shard_output`: training keeps only each TP rank's slice) are
    first assembled over their TP group."""
    from .groups import group
    from .vocab_parallel import assemble_output

    single = not isinstance(per_micro_batch[0], (tuple, list))
    rows = [[o] if single else list(o) for o in per_micro_batch]
    lay = lay.batch_slices()    # under cp, the ranks of a CP group hold the same (gathered) slice
    ranks = lay.dp_ranks(rank)
    out = []
    for j in range(len(rows[0])):
        parts = []
        for row in rows:
            t = row[j]
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                parts = None
                break
            t = assemble_output(t)
            if lay.dp > 1:
                chunks = [torch.empty_like(t) for _ in ranks]
                dist.all_gather(chunks, t.contiguous(), group=group(ranks))
                t = torch.cat(chunks)
            parts.append(t)
        out.append(None if parts is None else torch.cat(parts))
    return out[0] if single else tuple(out)


def _unshard(t: torch.Tensor, info, ranks: tuple[int, ...]) -> torch.Tensor:
    """The whole tensor from the TP shards of ``ranks`` (collective over the TP group)."""
    from ..sharding import unshard
    from .groups import all_gather_single, group

    t = t.detach()   # NOTE: ZeRO-2's whole buffer is an autograd leaf: its clone would require grad
    flat = t.new_empty(len(ranks) * t.numel())
    all_gather_single(flat, t.contiguous().reshape(-1), group=group(ranks))
    return unshard([c.view(t.shape) for c in flat.chunk(len(ranks))], info)
