"""Shard math of tensor-parallel parameters: one rank's shard of a full tensor and back."""

from __future__ import annotations

import torch

from ..ir import ShardInfo
from .state import ParamShard


def shard_tensor(full: torch.Tensor, shard: ParamShard | ShardInfo, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``: chunk ``rank`` of every block along ``shard.dim``."""
    pieces, offset = [], 0
    for size in shard.blocks:
        n = size // shard.tp
        pieces.append(full.narrow(shard.dim, offset + rank * n, n))
        offset += size
    return torch.cat(pieces, dim=shard.dim) if len(pieces) > 1 else pieces[0]


def unshard(shards: list[torch.Tensor], info: ShardInfo) -> torch.Tensor:
    """The full tensor from every rank's shard (in TP-group rank order), inverse of :func:`shard_tensor`."""
    per_block = [[] for _ in info.blocks]
    for s in shards:
        offset = 0
        for b, size in enumerate(info.blocks):
            n = size // info.tp
            per_block[b].append(s.narrow(info.dim, offset, n))
            offset += n
    return torch.cat([t for block in per_block for t in block], dim=info.dim)
