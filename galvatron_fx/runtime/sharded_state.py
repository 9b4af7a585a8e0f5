"""This rank's checkpoint state as chunks of global tensors, for ``torch.distributed.checkpoint``.

    state = save_state(stage, optimizer)          # {"model.<fqn>": ChunkedTensor, "optim.<fqn>.<k>": ...}
    dcp.save(state, planner=ChunkSavePlanner(), ...)
    state, finish = load_state(stage, optimizer, metadata)
    dcp.load(state, planner=ChunkLoadPlanner(), ...); finish()

A :class:`ChunkedTensor` is what DTensor is to DCP, minus the mesh: the global size and dtype of one
tensor plus the pieces this rank holds, each at its global offsets (:mod:`.chunks` computes them).
It implements the planner-helper hooks DTensor implements (``__create_write_items__``,
``__create_chunk_list__``), so DCP's default planners build the write items (one ``SHARD`` item per
piece), check that the ranks' pieces tile every tensor exactly once, store the chunk table in
``.metadata`` and, on load, intersect the pieces a rank needs with the stored chunks (resharding to
any plan). The two planner subclasses only find a piece by its offsets.

The pieces come from each :class:`~.params.ShardedParameter`'s spec (:meth:`~.params.ParamSpec.pieces`).

NOTE: why not ShardedTensor or DTensor. A ZeRO shard holds each parameter's dim-0 slice, which is
what DTensor's ``Shard(0)`` describes, but the TP-local slices of fused projections are cut per block
(a rank's part of q/k/v is several boxes of the global tensor), TP-replicated parameters are
written by TP rank 0 only, and a DTensor per parameter would need a device mesh per layer's
(tp, dp) groups; ShardedTensor would need every rank's boxes of every tensor (or one metadata
all-gather per tensor). The pieces here are views of the parameters' parts (the flat buffers) and
of the optimizer states: a synchronous save copies nothing (:meth:`ChunkedTensor.write_view` hands DCP a
tensor whose storage is exactly the piece's bytes, so its CPU writer does not clone it) and a load
writes into the buffers in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import ConfigError
from .chunked_tensor import ChunkedTensor
from .params import chunked


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over a flat state dict of tensors and :class:`ChunkedTensor`."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.write_view(index)
        return super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a flat state dict of tensors and :class:`ChunkedTensor`."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # NOTE: the default one first materialises meta tensors with a traversal that maps any
        # object it does not know (a ChunkedTensor) to None; nothing here is on the meta device
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.piece(index)
        return super().lookup_tensor(index)


class CommittingWriter(FileSystemWriter):
    """DCP's file writer whose ``finish`` (run once, by the coordinator, after it gathered every
    rank's write results and before any rank's save returns) ends with ``commit()``: the point
    where a checkpoint becomes complete (``gfx.checkpoint`` writes its marker and renames)."""

    def __init__(self, path: str, commit: Callable[[], None]):
        super().__init__(path)
        self._commit = commit

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self._commit()


# ------------------------------------------------------------------------ parameters -> pieces
def _chunked(p, pieces, part: torch.Tensor, key: str, copy: bool) -> dict[str, ChunkedTensor]:
    """``{key: ChunkedTensor}`` of ``pieces`` of ``part`` (parameter ``p``'s local part, or an
    optimizer state shaped alike); ``copy``: staged in host memory."""
    return {key: chunked(p._gfx.global_shape, part, pieces, copy)}


def _params(stage):
    """``(fqn, ShardedParameter)`` of ``stage`` (a ``DistributedModel``), in the model's order."""
    if getattr(stage, "params", None) is None:
        raise ConfigError("internal: the distributed model has no parameter registry (bind_parameters did not run)")
    return list(stage.params.named())


def save_state(stage, optimizer: torch.optim.Optimizer | None, *, copy: bool = False,
               max_numel: int | None = None) -> dict[str, object]:
    """This rank's entries of a checkpoint: ``model.<fqn>`` and ``optim.<fqn>.<key>`` (each a
    :class:`ChunkedTensor` of the pieces this rank owns, views of the parameter's part and of its
    optimizer states unless ``copy``) and 0-dim optimizer states (``step``) as plain tensors (DCP
    writes replicated plain tensors once). ``max_numel`` caps a piece's elements (default: the
    layer's bucket). Frozen parameters have no optimizer entries."""
    out: dict[str, object] = {}
    for fqn, p in _params(stage):
        store = p._gfx.store
        part = p.to_local()
        cap = max_numel or max(1, store.bucket_bytes // part.element_size())
        pieces = p._gfx.pieces(owned=True, max_numel=cap)
        out.update(_chunked(p, pieces, part, f"model.{fqn}", copy))
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        for k in sorted(st):
            v = st[k]
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() == 0 and part.dim() != 0:
                out[f"optim.{fqn}.{k}"] = v.detach().clone()
            elif v.shape == part.shape:
                out.update(_chunked(p, pieces, v.detach(), f"optim.{fqn}.{k}", copy))
    return out


def load_state(stage, optimizer: torch.optim.Optimizer | None, metadata, path: str = "the checkpoint"):
    """``(state, finish)``: the entries this rank's parameters (and their optimizer states) need,
    as :class:`ChunkedTensor` views to be filled in place by ``dcp.load``, and a function to call
    afterwards (installs the optimizer states, marks the working copies stale). Raises
    :class:`ConfigError` when ``metadata`` (the checkpoint's DCP metadata) lacks a parameter or
    holds it with another shape."""
    meta = metadata.state_dict_metadata
    state: dict[str, object] = {}
    installs = []
    for fqn, p in _params(stage):
        spec = p._gfx
        key = f"model.{fqn}"
        if key not in meta:
            raise ConfigError(f"{path!r} has no parameter {fqn!r}: it was saved for another model; "
                              "load a checkpoint of this model or start from scratch")
        if tuple(meta[key].size) != tuple(spec.global_shape):
            raise ConfigError(f"checkpoint parameter {fqn!r} has shape {tuple(meta[key].size)}, this model "
                              f"needs {tuple(spec.global_shape)}; it was saved for a different model configuration")
        part = p.data
        pieces = spec.pieces(owned=False)
        state.update(_chunked(p, pieces, part, key, False))
        if optimizer is None or not p.requires_grad:
            continue
        prefix = f"optim.{fqn}."
        st: dict[str, torch.Tensor] = {}
        for k in sorted(k[len(prefix):] for k in meta if k.startswith(prefix)):
            m = meta[prefix + k]
            if tuple(m.size) != tuple(spec.global_shape) or (not spec.global_shape and k == "step"):
                st[k] = torch.empty((), dtype=m.properties.dtype)
                state[prefix + k] = st[k]
            else:
                st[k] = torch.zeros_like(part, dtype=m.properties.dtype)
                state.update(_chunked(p, pieces, st[k], prefix + k, False))
        if st:
            installs.append((p, st))

    def finish() -> None:
        for p, st in installs:
            optimizer.state[p] = st
        for s in stage.stores:
            s.initialized = True
            s.masters_changed()
        stage.sync_params()   # ZeRO-2: every replica's whole buffer from the loaded shards

    return state, finish
