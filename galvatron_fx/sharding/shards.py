"""Shard math of tensor-parallel parameters: one rank's shard of a full tensor and back."""

from __future__ import annotations

import torch

from ..ir import ShardInfo
from .state import ParamShard


def shard_tensor(full: torch.Tensor, shard: ParamShard | ShardInfo, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``: chunk ``rank`` of every block along ``shard.dim`` (a nested
    :class:`ShardInfo`: ``rank`` among its :attr:`~ShardInfo.parts`, outer-major)."""
    inner = getattr(shard, "inner", None)
    outer = rank // inner.parts if inner is not None else rank
    pieces, offset = [], 0
    for size in shard.blocks:
        n = size // shard.tp
        pieces.append(full.narrow(shard.dim, offset + outer * n, n))
        offset += size
    out = torch.cat(pieces, dim=shard.dim) if len(pieces) > 1 else pieces[0]
    return out if inner is None else shard_tensor(out, inner, rank % inner.parts)


def unshard(shards: list[torch.Tensor], info: ShardInfo) -> torch.Tensor:
    """The full tensor from every rank's shard (in TP-group rank order; a nested :class:`ShardInfo`:
    its :attr:`~ShardInfo.parts` ranks, outer-major), inverse of :func:`shard_tensor`."""
    if info.inner is not None:
        k = info.inner.parts
        shards = [unshard(shards[i:i + k], info.inner) for i in range(0, len(shards), k)]
    per_block = [[] for _ in info.blocks]
    for s in shards:
        offset = 0
        for b, size in enumerate(info.blocks):
            n = size // info.tp
            per_block[b].append(s.narrow(info.dim, offset, n))
            offset += n
    return torch.cat([t for block in per_block for t in block], dim=info.dim)


def full_shape(shape, info: ShardInfo | None) -> tuple[int, ...]:
    """The whole tensor's shape from a shard's ``shape`` (``info`` None: the same)."""
    out = list(shape)
    while info is not None:
        out[info.dim] = sum(info.blocks)
        info = info.inner
    return tuple(out)
