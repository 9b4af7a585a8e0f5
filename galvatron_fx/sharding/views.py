"""Sharding rules of ops that move, regroup or select dims: views and reshapes (head splits, whose
size arguments are rewritten), transposes / permutes, indexing, splits of fused projections (q/k/v
blocks), slices, GQA's ``repeat_interleave``, and reads of a sharded value's metadata."""

from __future__ import annotations

import torch
import torch.fx

from ..errors import ConfigError
from .registry import register_rule
from .state import (
    TP,
    Demote,
    ParamShard,
    Sharded,
    Unsupported,
    divisors,
    linear_operands,
    node_arg,
    op_name,
    shape_of,
    tensor_val,
)

VIEWS = {"view", "reshape", "unflatten", "flatten", "view_as", "reshape_as"}


@register_rule(*sorted(VIEWS), "expand")
def view(an, node, ins, states):
    x, s = ins[0], states[0]
    in_shape, out_shape = shape_of(x), shape_of(node)
    name = op_name(node)
    if name == "expand":
        d = s.dim + len(out_shape) - len(in_shape)
    else:
        d = _view_dim(in_shape, out_shape, s.dim, an.tp)
    if d is None:
        if s.kind == TP and an.kind == "block" and name in ("view", "reshape", "unflatten"):
            _check_heads(an, node, s, in_shape, out_shape)
        raise Unsupported
    if name in ("view", "reshape", "unflatten", "expand"):
        slot = _size_slot(node, name, d, len(out_shape))
        if slot is not None:
            old = _size_args(node, name)[slot]
            if isinstance(old, int) and old == out_shape[d]:
                an.res.shape_args[node.name] = (slot, old, old // an.tp)
            elif not (isinstance(old, int) and old == -1):
                raise Unsupported
    elif name in ("view_as", "reshape_as"):
        raise Unsupported
    return Sharded(d, s.kind, s.origins)


def _check_heads(an, node, s, in_shape, out_shape):
    if len(out_shape) > len(in_shape) and s.dim == len(in_shape) - 1:
        heads = out_shape[s.dim]
        role = _sdpa_role(node)
        what = "key/value heads" if role in (1, 2) else "attention heads"
        raise ConfigError(f"layer {an.record.name}: {heads} {what} are not divisible by tp={an.tp}; "
                          f"use tp in {divisors(heads)}")


def _sdpa_role(node, depth: int = 12):
    """Which argument (0 = query, 1 = key, 2 = value) of an attention op ``node`` flows into, or None."""
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if op_name(u) == "sdpa":
                    return next((k for k, a in enumerate(u.args[:3]) if a is n), None)
                if u not in seen:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return None


# --- dims


def _two_dims(node, nd_in):
    return (x % nd_in for x in (node.args[1], node.args[2]))


@register_rule("transpose")
def transpose(an, node, ins, states):
    s = states[0]
    d = s.dim
    a, b = _two_dims(node, tensor_val(node.args[0]).dim())
    return Sharded(b if d == a else a if d == b else d, s.kind, s.origins)


@register_rule("movedim")
def movedim(an, node, ins, states):
    s = states[0]
    nd_in = tensor_val(node.args[0]).dim()
    a, b = _two_dims(node, nd_in)
    perm = [i for i in range(nd_in) if i != a]
    perm.insert(b, a)
    return Sharded(perm.index(s.dim), s.kind, s.origins)


@register_rule("t")
def t(an, node, ins, states):
    s = states[0]
    return Sharded(1 - s.dim if tensor_val(node.args[0]).dim() == 2 else s.dim, s.kind, s.origins)


@register_rule("permute")
def permute(an, node, ins, states):
    s = states[0]
    nd_in = tensor_val(node.args[0]).dim()
    perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
    return Sharded([p % nd_in for p in perm].index(s.dim), s.kind, s.origins)


@register_rule("unsqueeze")
def unsqueeze(an, node, ins, states):
    s = states[0]
    u = node.args[1] % (tensor_val(node.args[0]).dim() + 1)
    return Sharded(s.dim + 1 if u <= s.dim else s.dim, s.kind, s.origins)


@register_rule("select")
def select(an, node, ins, states):
    s = states[0]
    k = node.args[1] % tensor_val(node.args[0]).dim()
    if k == s.dim:
        raise Unsupported
    return Sharded(s.dim - 1 if k < s.dim else s.dim, s.kind, s.origins)


@register_rule("squeeze")
def squeeze(an, node, ins, states):
    s = states[0]
    d = s.dim
    nd_in = tensor_val(node.args[0]).dim()
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    return Sharded(d - sum(1 for i in range(d) if in_shape[i] == 1 and len(out_shape) < len(in_shape)
                           and _squeezed(node, i, nd_in)), s.kind, s.origins)


# --- indexing, splits, slices


@register_rule("getitem", tensor_output=False)
def getitem(an, node, ins, states):
    """One part of a split (tuple) value, or basic indexing of a tensor."""
    if isinstance(node.args[0], torch.fx.Node) and tensor_val(node.args[0]) is None:
        parts = an.st(node.args[0])
        return parts[node.args[1]] if isinstance(parts, (tuple, list)) else None
    if tensor_val(node) is None:
        raise Unsupported
    s = states[0]
    idx = node.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    nd_in = tensor_val(node.args[0]).dim()
    if any(isinstance(i, torch.fx.Node) for i in idx):
        raise Unsupported
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        fill = nd_in - sum(1 for i in idx if i is not None and i is not Ellipsis)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    in_dim, out_dim = 0, 0
    for i in idx:
        if i is None:
            out_dim += 1
            continue
        if in_dim == s.dim:
            if isinstance(i, slice) and i == slice(None):
                return Sharded(out_dim, s.kind, s.origins)
            raise Unsupported
        if isinstance(i, slice):
            out_dim += 1
        in_dim += 1
    return Sharded(out_dim + (s.dim - in_dim), s.kind, s.origins)


@register_rule("split", "chunk", "split_with_sizes", "unbind", tensor_output=False)
def split(an, node, ins, states):
    """Parts of a sharded dim: each part's size must divide by tp and the value must come from one
    column linear, whose weight (and bias) are then sharded per block."""
    s = states[0]
    name = op_name(node)
    nd = tensor_val(node.args[0]).dim()
    parts = node.meta.get("val")
    dim = node_arg(node, 2 if name != "unbind" else 1, "dim", 0) % nd
    if name == "unbind":
        if dim == s.dim:
            raise Unsupported
        return tuple(Sharded(s.dim - (1 if dim < s.dim else 0), s.kind, s.origins) for _ in parts)
    out = tuple(Sharded(s.dim, s.kind, s.origins) for _ in parts)
    if dim != s.dim:
        return out
    sizes = tuple(int(p.shape[dim]) for p in parts)
    if s.kind != TP or len(s.origins) != 1 or any(z % an.tp for z in sizes):
        raise Unsupported
    origin = next(iter(s.origins))
    _set_blocks(an, origin, sizes)
    if name in ("split", "split_with_sizes"):
        an.res.split_sizes[node.name] = (sizes, tuple(z // an.tp for z in sizes))
    return out


def _set_blocks(an, origin, sizes):
    node = next(n for n in an.gm.graph.nodes if n.name == origin)
    _, w, b, _ = linear_operands(node)
    for p in (w, b):
        if p is not None:
            old = an.res.param_shards[p.name]
            if old.blocks not in ((sum(sizes),), sizes):
                raise Demote({origin})
            an.res.param_shards[p.name] = ParamShard(old.fqn, old.dim, old.tp, sizes)


@register_rule("repeat_interleave")
def repeat_interleave(an, node, ins, states):
    s, d = states[0], node_arg(node, 2, "dim")
    if d is None or len(ins) > 1 or (d % tensor_val(node.args[0]).dim() == s.dim and s.kind != TP):
        raise Unsupported
    return s  # GQA: repeating local kv heads gives exactly the local query heads' kv


@register_rule("slice", "narrow")
def slice_(an, node, ins, states):
    s, d = states[0], node_arg(node, 1, "dim", 0) % tensor_val(node.args[0]).dim()
    if len(ins) > 1 or d == s.dim:
        raise Unsupported
    return s


@register_rule("assert_tensor_metadata", "getattr", "size", "dim", tensor_output=False)
def metadata(an, node, ins, states):
    """Reading sizes / dtype of a sharded value: nothing to shard (a tensor result cannot run on shards)."""
    if tensor_val(node) is None:
        return None
    raise Unsupported


# ---------------------------------------------------------------------------------------------
# shape helpers


def _view_dim(in_shape, out_shape, d, tp):
    """Output dim that carries contiguous chunking of input dim ``d`` through a reshape, or None."""
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        pi = in_shape[i] if i < len(in_shape) else 1
        pj = out_shape[j] if j < len(out_shape) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        if d in gi:
            if any(in_shape[k] != 1 for k in gi if k < d):
                return None
            for k in gj:
                if k < len(out_shape) and out_shape[k] != 1:
                    return k if out_shape[k] % tp == 0 else None
            return None
    return None


def _size_args(node, name):
    if name == "unflatten":
        return list(node_arg(node, 2, "sizes"))
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    if not rest:
        return list(node.kwargs.get("size") or node.kwargs.get("shape") or [])
    return list(rest)


def _size_slot(node, name, d, nd_out):
    if name == "unflatten":
        start = node_arg(node, 1, "dim") % (nd_out - len(_size_args(node, name)) + 1)
        k = d - start
        return k if 0 <= k < len(_size_args(node, name)) else None
    if name == "flatten":
        return None
    return d if len(_size_args(node, name)) == nd_out else None


def _squeezed(node, i, nd_in):
    dims = node_arg(node, 1, "dim")
    if dims is None:
        return True
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return i in [x % nd_in for x in dims]
