"""One global tensor as the pieces this rank holds, for ``torch.distributed.checkpoint`` (DCP): what
DTensor is to DCP, minus the mesh (:mod:`.sharded_state` says why not DTensor or ShardedTensor).

It implements the planner-helper hooks DTensor implements (``__create_write_items__``,
``__create_chunk_list__``): DCP's default planners build one ``SHARD`` write item per piece, check
that the ranks' pieces tile the tensor exactly once and, on load, intersect the pieces a rank needs
with the stored chunks. Built by :func:`.params.chunked` (a parameter's part or an optimizer state
shaped alike), read by the planners of :mod:`.sharded_state`.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


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
