"""Sharding rule of scaled-dot-product attention: query, key and value sharded along their heads
dim give the output sharded along it (the mask is copied, or scattered when it has a heads dim); a
single key / value head may be whole on every rank (multi-query attention)."""

from __future__ import annotations

import torch.fx

from .registry import register_rule
from .state import TP, Duplicated, Sharded, Unsupported, node_arg, shape_of, tensor_val


@register_rule("sdpa", duplicated=True)
def sdpa(an, node, ins, states):
    """Query heads sharded; key / value heads sharded alike, or a single key / value head whole on
    every rank (multi-query attention: duplicated, or replicated and then copied)."""
    q, k, v = node.args[:3]
    sq = an.st(q)
    nd = tensor_val(q).dim()
    if not (isinstance(sq, Sharded) and sq.kind == TP and sq.dim == nd - 3 and sq.plain):
        raise Unsupported
    origins = set(sq.origins)
    for x in (k, v):
        sx = an.st(x)
        if isinstance(sx, Sharded) and sx.kind == TP and sx.dim == nd - 3 and sx.plain:
            origins |= sx.origins
        elif not isinstance(sx, Sharded) and shape_of(x)[nd - 3] == 1:   # one head, broadcast
            if isinstance(sx, Duplicated):
                origins |= sx.origins
            else:
                an.conv(node, x, ("copy",))
        else:
            raise Unsupported
    mask = node_arg(node, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node):
        ms = an.st(mask)
        if ms is not None:
            raise Unsupported
        dm = nd - 3 - (nd - tensor_val(mask).dim())
        an.conv(node, mask, ("copy",) if dm < 0 or shape_of(mask)[dm] == 1 else ("scatter", dm))
    return Sharded(nd - 3, TP, frozenset(origins))
