"""The chunks one pipeline rank runs under a multi-chunk schedule (``virtual_stages > 1``), as one stage.

Under ``interleaved-1f1b`` a rank runs ``v`` chunks of the model (:mod:`galvatron_fx.solver.schedules`),
each a :class:`~.module.DistributedModel` built by the same pass list. :class:`ChunkSet` puts
them behind the interface the rest of the runtime uses for a rank's stage (``dist_model.stage``):
one parameter registry (every parameter of the rank, each in exactly one chunk, so that
``clip_grad_norm_`` stays one reduction), the stores of every chunk in layer order, and the
state-dict, optimizer and materialisation calls run over all of them.
"""

from __future__ import annotations

import torch
from torch import nn

from .module import DistributedModel
from .params import ParamRegistry


class ChunkSet(nn.Module):
    """This rank's chunks (``chunks``, in layer order) behaving as one stage (module docstring)."""

    def __init__(self, chunks: list[DistributedModel]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        first = chunks[0].params
        self.params = ParamRegistry(first.rank, first.slots, first.pipelined, first.device, first.stage_ranks)
        for c in chunks:
            self.params.params.update(c.params.params)
            self.params.elsewhere |= c.params.elsewhere

    # ------------------------------------------------------------- the stage
    @property
    def stores(self):
        return [s for c in self.chunks for s in c.stores]

    @property
    def code(self) -> str:
        return "\n".join(f"# chunk {i}\n{c.code}" for i, c in enumerate(self.chunks))

    @property
    def grads_after_step(self) -> bool:
        return self.chunks[0].grads_after_step

    @grads_after_step.setter
    def grads_after_step(self, on: bool) -> None:
        for c in self.chunks:
            c.grads_after_step = on

    def children(self):
        """Every chunk's layer submodules (what materialisation walks)."""
        for c in self.chunks:
            yield from c.children()

    def named_children(self):
        for c in self.chunks:
            yield from c.named_children()

    def captured_model(self):
        return self.chunks[0].captured_model()

    def check_ready(self) -> None:
        for c in self.chunks:
            c.check_ready()

    def sync_params(self) -> None:
        for c in self.chunks:
            c.sync_params()

    def finish_grad_sync(self) -> None:
        for c in self.chunks:
            c.finish_grad_sync()

    # ------------------------------------------------------------- parameters
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for fqn, p in self.params.named():
            yield prefix + fqn, p

    def parameters(self, recurse: bool = True):
        for _fqn, p in self.named_parameters():
            yield p

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        return self.params.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def optimizer(self, cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
        return cls([p for p in self.parameters() if p.requires_grad], **kwargs)

    def init_weights(self, fn=None, seed: int | None = None, model=None) -> None:
        from .materialize import init_weights

        init_weights(self, self._model_or(model), fn=fn, seed=seed)

    def load_pretrained(self, directory: str, model=None) -> None:
        from .materialize import load_pretrained

        load_pretrained(self, self._model_or(model), directory)

    def _model_or(self, model):
        return self.chunks[0]._model_or(model)

    # ------------------------------------------------------------- state dicts
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        out = destination if destination is not None else {}
        for c in self.chunks:
            c.state_dict(destination=out, prefix=prefix)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        from torch.nn.modules.module import _IncompatibleKeys

        missing, unexpected = self.params.load_whole(dict(state_dict), strict=strict)
        for c in self.chunks:
            c.loaded()
        return _IncompatibleKeys(missing, unexpected)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for c in self.chunks:
            out.update(c.full_state_dict())
        return out

    def states_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """The chunks' :meth:`DistributedModel.states_bytes` summed (each counts the optimizer's
        states of its own parameters)."""
        total = {"params": 0, "masters": 0, "grads": 0, "optimizer": 0, "total": 0, "host": 0}
        for c in self.chunks:
            part = c.states_bytes(optimizer)
            for k in total:
                total[k] += part[k]
        return total
