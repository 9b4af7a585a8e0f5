"""The distributed module ``gfx.transform`` returns: a GraphModule with ``train_step``.

``DistributedModel`` is the top graph of :mod:`galvatron_fx.passes.split_layers` after the
runtime rewrites; ``forward(*graph_inputs)`` runs one micro-batch (every rank passes the *whole*
micro-batch; the graph keeps this rank's slice) and returns this rank's output (the loss over its
batch slice for zoo models).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx

from ..errors import ConfigError
from .data_parallel import FlatParams
from .groups import Layout
from .reshard import slice_input


class DistributedModel(torch.fx.GraphModule):
    """This rank's part of a model under a plan (pp = 1). See :meth:`train_step`."""

    def setup(self, plan, rank: int, loss_fn, output_layout: Layout, stores: list[FlatParams],
              tp_shards: dict[str, tuple[object, tuple[int, ...]]]) -> DistributedModel:
        self.plan, self.rank, self.loss_fn = plan, rank, loss_fn
        self.output_layout = output_layout
        self._stores = stores
        self._tp_shards = tp_shards
        self._n_inputs = sum(1 for n in self.graph.nodes if n.op == "placeholder")
        return self

    @property
    def stores(self) -> list[FlatParams]:
        """This rank's per-layer :class:`~.data_parallel.FlatParams` (one per layer with trainable
        parameters, in layer order): the public handle checkpoints, the backend's parameter
        binding and benchmarks use."""
        return self._stores

    # ---------------------------------------------------------------- training
    def train_step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the full global batch; returns the global-batch mean loss.

        ``inputs`` are the graph's inputs (the model's tensor arguments, e.g. ``input_ids,
        labels``), each the *whole global batch* along dim 0, on every rank; any further inputs
        are targets for ``loss_fn(output, *targets)`` (used only when the graph's output is not
        a scalar loss). The batch is cut into ``plan.micro_batches`` micro-batches (gradient
        accumulation). Gradients are reset at the start; on return each parameter of
        :meth:`parameters` (the layer buffers or this rank's shards) holds in ``.grad`` the
        gradient of the global-batch mean loss, and the returned loss (a 0-dim tensor) is the
        same on every rank.
        """
        graph_inputs, targets = inputs[:self._n_inputs], inputs[self._n_inputs:]
        if len(graph_inputs) != self._n_inputs:
            raise ConfigError(f"train_step needs the graph's {self._n_inputs} inputs, got {len(inputs)}")
        m = self.plan.micro_batches
        self.sync_params()   # ZeRO-2: the shards the user's optimizer updated -> whole buffers
        for s in self._stores:
            s.zero_grad_state()
        micro = [_split(t, m) for t in graph_inputs]
        micro_t = [_split(t, m) for t in targets]
        lay = self.output_layout
        total = None
        for k in range(m):
            for s in self._stores:
                s.last_micro_batch = k == m - 1
            out = self(*[mb[k] for mb in micro])
            loss = self._loss(out, [slice_input(t[k], lay.batch_index(self.rank), lay.dp) for t in micro_t])
            # NOTE: each rank's loss is the mean over its 1/dp of the micro-batch; scaling by
            # 1/(dp*m) makes the DP *sum* of gradients the gradient of the global mean loss.
            (loss / (lay.dp * m)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        for s in self._stores:
            s.finish_grad_sync()
        total = total.float() / m
        if dist.get_world_size() > 1:
            # every TP rank of an output DP group holds the same local mean: the world mean is
            # the mean over DP groups, and bit-identical on every rank
            dist.all_reduce(total)
            total = total / dist.get_world_size()
        return total

    def _loss(self, out, targets):
        if self.loss_fn is not None:
            return self.loss_fn(out, *targets)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise ConfigError("the model's output is not a scalar loss; pass loss_fn=... to gfx.transform "
                              "and the targets as extra train_step inputs")
        return out.reshape(())

    # --------------------------------------------------------------- optimizer
    def optimizer(self, cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
        """``cls(self.parameters(), **kwargs)`` over this rank's buffers/shards: a convenience; any
        ``torch.optim`` optimizer the user builds over :meth:`parameters` works the same.

        NOTE: parameters are flat per layer, so one hyper-parameter set applies to all of them
        (elementwise optimizers such as AdamW/SGD then match unflattened training exactly).
        """
        return cls(self.parameters(), **kwargs)

    def sync_params(self) -> None:
        """ZeRO-2: all-gather the shards an optimizer step (or a checkpoint load) changed into the
        whole buffers (collective over each DP group; a no-op when nothing changed). ``train_step``
        and :meth:`full_state_dict` run it first, so users never need to."""
        for s in self._stores:
            s.sync_after_step()

    # ------------------------------------------------------------- state dicts
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fqn -> unsharded parameter (original fully qualified names; tied weights under their
        first name), on **every rank** (collective: call it on all ranks)."""
        self.sync_params()
        out: dict[str, torch.Tensor] = {}
        for s in self._stores:
            for fqn, t in s.unsharded().items():
                if fqn in self._tp_shards:
                    info, ranks = self._tp_shards[fqn]
                    t = _unshard(t, info, ranks)
                out[fqn] = t.detach().clone()
        return out

    def states_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """This rank's measured bytes of parameters, gradients and optimizer states, counting
        each storage once (``params`` includes ZeRO-2's whole buffer; ZeRO-3's gathered buffer is
        empty at rest). Keys ``params``, ``grads``, ``optimizer``, ``total``."""
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

        params = size([s.flat_param for s in self._stores] + [s.full for s in self._stores if s.full is not None])
        grads = size([s.flat_param.grad for s in self._stores if s.flat_param.grad is not None])
        opt = 0
        if optimizer is not None:
            opt = size([v for st in optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0])
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def _split(t, m: int):
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return [t] * m
    if t.shape[0] % m:
        raise ConfigError(f"batch of {t.shape[0]} samples is not divisible by micro_batches={m}")
    return list(t.chunk(m, dim=0))


def _unshard(t: torch.Tensor, info, ranks: tuple[int, ...]) -> torch.Tensor:
    """The whole tensor from the TP shards of ``ranks`` (collective over the TP group)."""
    from ..sharding import unshard
    from .groups import all_gather_single, group

    flat = t.new_empty(len(ranks) * t.numel())
    all_gather_single(flat, t.contiguous().reshape(-1), group=group(ranks))
    return unshard([c.view(t.shape) for c in flat.chunk(len(ranks))], info)
