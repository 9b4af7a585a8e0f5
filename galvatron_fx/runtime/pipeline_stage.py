"""A pipeline stage as torch's ``PipelineStage`` runs it: the stage module class a plan's stage
graph becomes (its inputs passed on where a later stage needs them), the split backward of the
zero-bubble schedules (``I``: input gradients, ``W``: weight gradients, torch's
``stage_backward_input`` / ``stage_backward_weight`` over the layers' parameter views) and what
:class:`~.pipeline.PipelineModel` reads back from a running schedule."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from ..errors import ConfigError
from .module import DistributedModel
from .saved import state_storages


class _PassOn(torch.autograd.Function):
    """Identity sharing ``x``'s storage whose output is not a view (``x.detach()`` is none), so the
    schedule may ``detach_()`` it: torch's split backward (zero-bubble ``I``) does."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def pass_on(x: torch.Tensor) -> torch.Tensor:
    """A value sent to the next stage: a contiguous tensor that is not one of the stage's inputs
    (p2p sends need contiguous memory; a received value handed on unchanged is still a new node)."""
    if not x.is_contiguous():
        return x.contiguous()
    return _PassOn.apply(x) if x.requires_grad else x.detach()


class StageRunner(nn.Module):
    """What ``PipelineStage`` calls: ``forward(*received)`` -> the stage graph on this micro-batch's
    local graph inputs (set by :meth:`PipelineModel.train_step`) and the received values.

    On the last stage it returns the micro-batch's loss (``loss_of(output, chunk)``), not the graph
    output. NOTE: a model output such as HF's ``(loss, logits)`` is several tensors, which the
    schedule would try to send on; the loss is all the schedule needs."""

    def __init__(self, stage: DistributedModel, first: bool, loss_of=None):
        super().__init__()
        self.stage = stage
        self.first = first
        self.loss_of = loss_of
        self.local: list[list[torch.Tensor]] = []
        self.outputs: dict | None = None   # eval_step(return_outputs=True): chunk -> graph output
        self.chunk = 0

    def forward(self, *received):
        if self.first:   # stage 0: its local inputs are the schedule's root arguments
            out = self.stage(*received)
        else:
            out = self.stage(*self.local[self.chunk], *received)
        if self.loss_of is None:
            return out
        if self.outputs is not None:
            self.outputs[self.chunk] = out
        return self.loss_of(out, self.chunk)


def make_stage_class():
    """The ``PipelineStage`` subclass the stages run (built on first use: importing torch's
    pipelining is deferred until a pipelined plan runs). One function because its methods are the
    overrides of one torch class, each a few lines around torch's own (forward, the two backward
    halves, the last-backward hook); they share the class body's state."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        """PipelineStage telling the runner which micro-batch runs, the flat buffers which backward
        is the last, and recording the forward/backward order and the saved activation bytes."""

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            if not self.split:
                return self._forward(fwd_chunk_id, args, kwargs, save_forward_output)
            for s in self.stores:   # split backward: record this micro-batch's parameter views
                s.split_views = []
            try:
                return self._forward(fwd_chunk_id, args, kwargs, save_forward_output)
            finally:
                self.views[fwd_chunk_id] = [(s, s.split_views) for s in self.stores if s.split_views]
                for s in self.stores:
                    s.split_views = None

        def _forward(self, fwd_chunk_id, args, kwargs, save_forward_output):
            stats = self.stats
            self.submod.chunk = fwd_chunk_id
            stats["order"].append(f"F{fwd_chunk_id}{self.chunk_tag}")
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
            stats["chunk_bytes"][(self.stage_index, fwd_chunk_id)] = nbytes   # NOTE: a rank's chunks share stats
            stats["live_bytes"] += nbytes
            stats["in_flight"] += 1
            stats["peak_in_flight"] = max(stats["peak_in_flight"], stats["in_flight"])
            stats["peak_saved_bytes"] = max(stats["peak_saved_bytes"], stats["live_bytes"])
            return out

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            self._mb = bwd_chunk_id
            for s in self.stores:
                s.last_micro_batch = last_backward
            self.stats["order"].append(f"{'B' if full_backward else 'I'}{bwd_chunk_id}{self.chunk_tag}")
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            grads = self.bwd_cache.get(bwd_chunk_id)
            if grads is not None:   # NOTE: p2p sends need contiguous gradients
                self.bwd_cache[bwd_chunk_id] = tuple(g.contiguous() if isinstance(g, torch.Tensor) else g
                                                     for g in grads)
            if full_backward:
                self._done(bwd_chunk_id)
            else:   # ZeRO-3: the gathered buffers stay until this micro-batch's W
                for s in self.stores:
                    s.pins += 1

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            """Zero-bubble ``W``: the weight gradients of a micro-batch whose input gradients were sent
            (its layers' ``on_grad``, so DP reduction and ZeRO reduce-scatters start here)."""
            for s in self.stores:
                s.last_micro_batch = last_backward
            self.stats["order"].append(f"W{bwd_chunk_id}{self.chunk_tag}")
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            self.views.pop(bwd_chunk_id, None)   # the first chunk's (torch runs its W as a whole backward)
            self.stats["wgrad_bytes"] -= self.held.pop(bwd_chunk_id, 0)
            for s in self.stores:
                s.pins -= 1
                s.free_full()
            self._done(bwd_chunk_id)

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            # NOTE: the split backward's weights are each parameter's view recorded in this
            # micro-batch's forward (data_parallel._entry), not the runner's nn.Parameters (it has none)
            if backward_type == "input":
                grads, groups = split_backward_input(bwd_kwargs, self.views.pop(self._mb, []), self.stage_index)
                if self.track_memory:   # the output gradients the weight pass starts from, held until W
                    held = _held_bytes(groups)
                    self.held[self._mb] = held
                    self.stats["wgrad_bytes"] += held
                    self.stats["peak_wgrad_bytes"] = max(self.stats["peak_wgrad_bytes"], self.stats["wgrad_bytes"])
                return grads, groups
            if backward_type == "weight":
                return weight_backward(bwd_kwargs["param_groups"], self.stores), None
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

        def _done(self, mb: int) -> None:
            """Micro-batch ``mb`` released its activations (after its B, or its W)."""
            self.stats["in_flight"] -= 1
            self.stats["live_bytes"] -= self.stats["chunk_bytes"].pop((self.stage_index, mb), 0)

    return _Stage


def split_backward_input(bwd_kwargs: dict, views: list, stage_index: int):
    """Zero-bubble ``I``: torch's ``stage_backward_input`` over the per-parameter views this
    micro-batch's forward recorded (``views``: ``[(store, [{part: view}, ...])]``), each param group
    told which ``(store, part)`` its weights are. A weight whose gradient does not pass through the
    chunk's inputs' gradient graph (T5's relative position bias: computed from positions alone and
    handed on as a chunk output), which torch's split would never compute, gets its gradient here
    from the chunk's outputs, in a group of its own (``ready``) that :func:`weight_backward` hands
    on."""
    from torch.distributed.pipelining._backward import stage_backward_input

    weights, owner = [], {}
    for store, records in views:
        for rec in records:
            for j, v in rec.items():
                weights.append(v)
                owner.setdefault(v.grad_fn, []).append((store, j))
    outputs = _as_tuple(bwd_kwargs["stage_output"])
    # NOTE: torch detaches the outputs it is given in place once done; an alias of each (not an
    # autograd view, which cannot be detached in place; no copy) keeps the originals' graph for
    # the weights below
    aliases = [torch.ops.aten._unsafe_view(o, o.shape) if isinstance(o, torch.Tensor) and o.requires_grad else o
               for o in outputs]
    grads, groups = stage_backward_input(aliases, bwd_kwargs["output_grads"], bwd_kwargs["input_values"],
                                         iter(weights))
    for g in groups:
        g["params"] = list(g["params"])
        g["owners"] = [owner[n] for n in g["params"]]
    reached = {n for g in groups for n in g["params"]}
    missing = [n for n in owner if n not in reached]
    if missing:
        given = bwd_kwargs["output_grads"]
        given = [torch.ones_like(o) for o in outputs] if given is None else _as_tuple(given)   # the loss: 1
        pairs = [(o, g) for o, g in zip(outputs, given)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if not pairs:
            raise ConfigError(f"internal: pipeline chunk {stage_index} has weights outside its inputs' gradient "
                              "graph and no output gradient to compute theirs from")
        # NOTE: retain_graph: the weight pass still walks this micro-batch's graph; autograd runs
        # only the nodes that lead to these weights
        ready = torch.autograd.grad([o for o, _ in pairs], [GradientEdge(n, 0) for n in missing],
                                    grad_outputs=[g for _, g in pairs], retain_graph=True, allow_unused=True)
        groups.append({"params": [], "intermediates": [], "owners": [owner[n] for n in missing], "ready": ready})
    for o in outputs:   # as torch does to its own: the output side's graph state is no longer needed
        if isinstance(o, torch.Tensor):
            o.detach_()
    return grads, groups


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _held_bytes(groups: list[dict]) -> int:
    """Bytes of the distinct storages of the gradients torch's split keeps for the weight pass."""
    seen = {}
    for g in groups:
        for node_grads in g.get("grads") or []:
            for t in node_grads or ():
                if isinstance(t, torch.Tensor):
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def weight_backward(param_groups: list[dict], stores) -> tuple:
    """Zero-bubble ``W``: torch's ``stage_backward_weight``, stopping at each parameter's view (so
    no input-gradient path is recomputed), then each layer's gradients handed to its store
    (``on_grad``: DP reduction and ZeRO reduce-scatters start here), last layer first."""
    got: dict = {}

    def add(owners_list, dws) -> None:
        for owners, dw in zip(owners_list, dws):
            for store, j in owners:
                if dw is not None:
                    parts = got.setdefault(store, {})
                    parts[j] = dw if j not in parts else parts[j] + dw

    for pg in param_groups:
        if "ready" in pg:   # computed in the input pass (split_backward_input)
            add(pg["owners"], pg.pop("ready"))
            continue
        grads, nodes = pg.pop("grads", None), pg.pop("intermediates")
        if grads is None:
            continue
        edges, outs = [], []
        for node_grads, node in zip(grads, nodes):
            for i, g in enumerate(node_grads or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    outs.append(g)
        # NOTE (torch's): clamp each intermediate's incoming gradient to the one saved in I, so a
        # gradient through a descendant intermediate is not counted twice
        handles = [node.register_prehook(lambda _g, saved=node_grads: saved)
                   for node_grads, node in zip(grads, nodes)] if len(nodes) > 1 else []
        try:
            if not edges:
                continue
            dws = torch.autograd.grad(edges, [GradientEdge(n, 0) for n in pg["params"]], grad_outputs=outs,
                                      allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        add(pg["owners"], dws)
    for store in reversed(stores):
        if store in got:
            store.on_grad(tuple(got[store].get(j) for j in range(len(store.part_sizes))))
    return ()


def schedule_stages(schedule) -> list:
    """The ``PipelineStage`` s a schedule runs on this rank."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def param_storages(stage):
    """A function listing the storages of ``stage``'s flat buffers (ZeRO-3's gathered ones are
    re-allocated per gather, so the list is re-read), without keeping ``stage`` alive."""
    ref = weakref.ref(stage)

    def storages():
        st = ref()
        return state_storages(st.stores if st is not None else [])

    return storages
