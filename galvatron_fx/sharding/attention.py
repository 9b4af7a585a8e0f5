"""Sharding rule of scaled-dot-product attention: query, key and value sharded along their heads
dim give the output sharded along it (the mask is copied, or scattered when it has a heads dim)."""

from __future__ import annotations

import torch.fx

from .registry import register_rule
from .state import TP, Sharded, Unsupported, node_arg, shape_of, tensor_val


@register_rule("sdpa")
def sdpa(an, node, ins, states):
    q, k, v = node.args[:3]
    sq, sk, sv = an.st(q), an.st(k), an.st(v)
    nd = tensor_val(q).dim()
    ok = all(isinstance(x, Sharded) and x.kind == TP and x.dim == nd - 3 for x in (sq, sk, sv))
    if not ok:
        raise Unsupported
    mask = node_arg(node, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node):
        ms = an.st(mask)
        if ms is not None:
            raise Unsupported
        dm = nd - 3 - (nd - tensor_val(mask).dim())
        an.conv(node, mask, ("copy",) if dm < 0 or shape_of(mask)[dm] == 1 else ("scatter", dm))
    return Sharded(nd - 3, TP, sq.origins | sk.origins | sv.origins)
