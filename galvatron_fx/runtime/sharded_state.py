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

NOTE: why not ShardedTensor or DTensor. A ZeRO shard holds each parameter's dim-0 slice, which is
what DTensor's ``Shard(0)`` describes, but the TP-local slices of fused projections are cut per block
(a rank's part of q/k/v is several boxes of the global tensor), TP-replicated parameters are
written by TP rank 0 only, and a DTensor per parameter would need a device mesh per layer's
(tp, dp) groups; ShardedTensor would need every rank's boxes of every tensor (or one metadata
all-gather per tensor). The pieces here are views of the flat buffers and the
optimizer states: a synchronous save copies nothing (:meth:`ChunkedTensor.write_view` hands DCP a
tensor whose storage is exactly the piece's bytes, so its CPU writer does not clone it) and a load
writes into the buffers in place.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..errors import ConfigError
from ..ir import layer_module_name
from .chunks import Piece, layer_pieces, piece_view


class ChunkedTensor:
    """Pieces of one global tensor held by this rank: ``pieces`` is ``[(global offsets, tensor)]``
    (possibly empty), ``size`` the global shape."""

    def __init__(self, size, dtype: torch.dtype, pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        self._size = torch.Size(size)
        self.dtype = dtype
        self.pieces = pieces
        self._by_offsets = {tuple(o): i for i, (o, _t) in enumerate(pieces)}

    def size(self) -> torch.Size:
        return self._size

    def __repr__(self) -> str:
        return f"ChunkedTensor(size={tuple(self._size)}, dtype={self.dtype}, pieces={len(self.pieces)})"

    # DCP's planner-helper hooks (torch.distributed.checkpoint.planner_helpers)
    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), t.size()),
                                                      properties=TensorProperties(dtype=self.dtype),
                                                      size=self._size))
                for i, (off, t) in enumerate(self.pieces)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), t.size()) for off, t in self.pieces]

    def piece(self, index: MetadataIndex) -> torch.Tensor:
        i = index.index
        if i is None or i >= len(self.pieces) or tuple(self.pieces[i][0]) != tuple(index.offset):
            i = self._by_offsets[tuple(index.offset)]
        return self.pieces[i][1]

    def write_view(self, index: MetadataIndex) -> torch.Tensor:
        """The piece for DCP's writer: on CPU a contiguous piece becomes a tensor on a storage of
        exactly its bytes (a slice of the buffer's storage, no copy: DCP's CPU loader clones any
        tensor whose storage is larger); otherwise the piece itself (DCP copies it)."""
        t = self.piece(index)
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return t
        st = t.untyped_storage()
        lo = t.storage_offset() * t.element_size()
        tight = st[lo:lo + t.nbytes]
        return torch.empty(0, dtype=t.dtype).set_(tight, 0, t.size(), t.stride())


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


# ------------------------------------------------------------------------ stores -> pieces
class StoreGeometry:
    """Where one layer's :class:`~.data_parallel.FlatParams` sits in the global tensors.

    ``tp_index`` is this rank's position in the layer's TP group; ``shards`` maps the TP-sharded
    fqns to their ``ShardInfo``; ``global_shapes`` every fqn to its whole (original) shape.
    """

    def __init__(self, store, tp: int, rank: int, tp_shards: dict):
        self.store = store
        self.tp_index = rank % tp   # TP groups are consecutive ranks from a multiple of tp (groups.py)
        self.shards = {f: tp_shards[f][0] for f in store.fqns if f in tp_shards}
        self.global_shapes = {}
        for fqn, shape in zip(store.fqns, store.shapes):
            shape = list(shape)
            if fqn in self.shards:
                info = self.shards[fqn]
                shape[info.dim] = sum(info.blocks)
            self.global_shapes[fqn] = tuple(shape)

    def _spans(self, whole: bool) -> list[tuple[int, int, int]]:
        """Per parameter ``(lo, hi, origin)`` in ``flat_param``'s coordinates (:func:`.chunks.layer_pieces`):
        the whole parameter (``whole``, only under ``sdp="none"``) or this rank's dim-0 slice."""
        s, lay = self.store, self.store.layout
        out = []
        for i, shape in enumerate(s.shapes):
            w = lay.row[i]
            if whole:
                out.append((0, math.prod(shape), s.offsets[i]))
                continue
            a, b = lay.held_rows(i, s.dp_index)
            # the slice starts at shard_offsets[i] of a ZeRO shard, at offsets[i] + a * w of a whole buffer
            origin = s.offsets[i] if s.mode == "none" else lay.shard_offsets[i] - a * w
            out.append((a * w, b * w, origin))
        return out

    def owned(self, max_numel: int | None) -> dict[str, list[Piece]]:
        """The pieces this rank writes: its dim-0 slice of every parameter (what its ZeRO shard
        holds, whatever ``sdp`` is), TP-replicated parameters on TP rank 0 only."""
        s = self.store
        return layer_pieces(s.fqns, s.shapes, self._spans(False), self.shards,
                            replicated=self.tp_index == 0, max_numel=max_numel)

    def held(self) -> dict[str, list[Piece]]:
        """The pieces this rank's masters hold (what a load fills)."""
        s = self.store
        return layer_pieces(s.fqns, s.shapes, self._spans(s.mode == "none"), self.shards)


_LAYER = re.compile(layer_module_name(0).replace("0", r"(\d+)"))


def geometries(stage) -> list[StoreGeometry]:
    """One :class:`StoreGeometry` per store of ``stage`` (a ``DistributedModel``), in layer order."""
    # NOTE: a pipeline stage's layer submodules keep their global indices (layers_5, ...) while
    # its plan lists only its own layers, in the same order
    layers = sorted((int(m.group(1)), mod) for name, mod in stage.named_children()
                    if (m := _LAYER.fullmatch(name)))
    if len(layers) != len(stage.plan.layers):
        raise ConfigError(f"internal: {len(layers)} layer submodules for {len(stage.plan.layers)} planned layers")
    by_id = {}
    for (_i, layer), lp in zip(layers, stage.plan.layers):
        store = getattr(layer, "flat_params", None)
        if store is not None:
            by_id[id(store)] = lp.tp
    missing = [s for s in stage.stores if id(s) not in by_id]
    if missing:
        raise ConfigError("internal: a parameter store is not the flat_params of a layer submodule")
    return [StoreGeometry(s, by_id[id(s)], stage.rank, stage._tp_shards) for s in stage.stores]


def _chunked(geo: StoreGeometry, pieces: dict[str, list[Piece]], flat: torch.Tensor, prefix: str,
             suffix: str, copy: bool) -> dict[str, ChunkedTensor]:
    out = {}
    for fqn, ps in pieces.items():
        views = []
        for p in ps:
            v = piece_view(flat, p)
            views.append((p.global_offsets, v.to("cpu", copy=True) if copy else v))   # staging: host memory
        out[f"{prefix}{fqn}{suffix}"] = ChunkedTensor(geo.global_shapes[fqn], flat.dtype, views)
    return out


def save_state(stage, optimizer: torch.optim.Optimizer | None, *, copy: bool = False,
               max_numel: int | None = None) -> dict[str, object]:
    """This rank's entries of a checkpoint: ``model.<fqn>`` and ``optim.<fqn>.<key>`` (each a
    :class:`ChunkedTensor` of the pieces this rank owns, views of the masters and optimizer states
    unless ``copy``) and 0-dim optimizer states (``step``) as plain tensors (DCP writes replicated
    plain tensors once). ``max_numel`` caps a piece's elements (default: the layer's bucket)."""
    out: dict[str, object] = {}
    for geo in geometries(stage):
        s = geo.store
        cap = max_numel or max(1, s.bucket_bytes // s.flat_param.element_size())
        pieces = geo.owned(cap)
        out.update(_chunked(geo, pieces, s.flat_param.detach(), "model.", "", copy))
        st = optimizer.state.get(s.flat_param, {}) if optimizer is not None else {}
        for k in sorted(st):
            v = st[k]
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() == 0:
                for fqn in s.fqns:
                    out[f"optim.{fqn}.{k}"] = v.detach().clone()
            elif v.shape == s.flat_param.shape:
                out.update(_chunked(geo, pieces, v.detach(), "optim.", f".{k}", copy))
    return out


def load_state(stage, optimizer: torch.optim.Optimizer | None, metadata, path: str = "the checkpoint"):
    """``(state, finish)``: the entries this rank's masters (and optimizer states) need, as
    :class:`ChunkedTensor` views to be filled in place by ``dcp.load``, and a function to call
    afterwards (installs the optimizer states, marks the working copies stale). Raises
    :class:`ConfigError` when ``metadata`` (the checkpoint's DCP metadata) lacks a parameter or
    holds it with another shape."""
    meta = metadata.state_dict_metadata
    state: dict[str, object] = {}
    installs = []
    for geo in geometries(stage):
        s = geo.store
        pieces = geo.held()
        for fqn in s.fqns:
            key = f"model.{fqn}"
            if key not in meta:
                raise ConfigError(f"{path!r} has no parameter {fqn!r}: it was saved for another model; "
                                  "load a checkpoint of this model or start from scratch")
            if tuple(meta[key].size) != geo.global_shapes[fqn]:
                raise ConfigError(f"checkpoint parameter {fqn!r} has shape {tuple(meta[key].size)}, this model "
                                  f"needs {geo.global_shapes[fqn]}; it was saved for a different model configuration")
        state.update(_chunked(geo, pieces, s.flat_param.data, "model.", "", False))
        if optimizer is None:
            continue
        prefix = f"optim.{s.fqns[0]}."
        keys = sorted(k[len(prefix):] for k in meta if k.startswith(prefix))
        st: dict[str, torch.Tensor] = {}
        for k in keys:
            m = meta[prefix + k]
            if _is_scalar_state(meta, s.fqns, k):
                st[k] = torch.empty((), dtype=m.properties.dtype)
                state[prefix + k] = st[k]
            else:
                st[k] = torch.zeros_like(s.flat_param.data, dtype=m.properties.dtype)
                state.update(_chunked(geo, pieces, st[k], "optim.", f".{k}", False))
        installs.append((s, st))

    def finish() -> None:
        for s, st in installs:
            optimizer.state[s.flat_param] = st
        for s in stage.stores:
            s.masters_changed()
        stage.sync_params()   # ZeRO-2: every replica's whole buffer from the loaded shards

    return state, finish


def _is_scalar_state(meta, fqns, key: str) -> bool:
    """Whether optimizer state ``key`` of a layer is one 0-dim value (``step``) rather than
    elementwise: judged on a parameter of the layer with at least one dim (an elementwise state
    has its shape); a layer of 0-dim parameters only is judged by the name (``step``)."""
    for fqn in fqns:
        size = tuple(meta[f"model.{fqn}"].size)
        if size:
            return tuple(meta[f"optim.{fqn}.{key}"].size) != size
    return key == "step"

