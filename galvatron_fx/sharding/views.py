"""Sharding rules of ops that move or regroup dims: views and reshapes (head splits, whose size
arguments are rewritten; Bloom's ``batch x heads`` merges, an ``outer`` layout), transposes /
permutes, GQA's ``repeat_interleave``, and reads of a sharded value's metadata. Ops that take part
of a dim (indexing, slices, splits) are in :mod:`.selections`."""

from __future__ import annotations

from ..errors import ConfigError
from .registry import register_rule
from .state import TP, Duplicated, Sharded, Unsupported, divisors, node_arg, op_name, shape_of, tensor_val

VIEWS = {"view", "reshape", "unflatten", "flatten", "view_as", "reshape_as"}


@register_rule("expand", duplicated=True)
def expand(an, node, ins, states):
    """A view's rule, and: a duplicated single key / value head expanded to the query's heads before
    attention (transformers >= 5.25 Falcon: ``k[:, :, None].expand(b, 1, heads, s, d)``) expands on
    each rank to its own chunk of the heads, sharded like the query's; its gradient stays a partial
    sum over the group, as a duplicated value's is."""
    if not isinstance(states[0], Duplicated):
        return view(an, node, ins, states)
    in_shape, out_shape = shape_of(ins[0]), shape_of(node)
    lead = len(out_shape) - len(in_shape)   # new leading dims
    grown = [d for d in range(lead, len(out_shape)) if in_shape[d - lead] == 1 and out_shape[d] > 1]
    slot = _size_slot(node, "expand", grown[0], len(out_shape)) if len(grown) == 1 else None
    if slot is None:
        return an.duplicated(node, ins, states)
    heads = out_shape[grown[0]]
    if heads % an.tp or _sdpa_role(node) not in (1, 2) or _size_args(node, "expand")[slot] != heads:
        return an.duplicated(node, ins, states)
    an.res.shape_args[node.name] = (slot, heads, heads // an.tp)
    return Sharded(grown[0], TP, states[0].origins)


@register_rule(*sorted(VIEWS))
def view(an, node, ins, states):
    x, s = ins[0], states[0]
    in_shape, out_shape = shape_of(x), shape_of(node)
    name = op_name(node)
    if name == "expand":
        new = s.moved(s.dim + len(out_shape) - len(in_shape))
        if out_shape[new.dim] != in_shape[s.dim]:
            raise Unsupported
    else:
        new = view_state(in_shape, out_shape, s, an.tp)
    if new is None:
        if s.kind == TP and an.kind == "block" and name in ("view", "reshape", "unflatten"):
            _check_heads(an, node, s, in_shape, out_shape)
        raise Unsupported
    d = new.dim
    if name in ("view", "reshape", "unflatten", "expand"):
        slot = _size_slot(node, name, d, len(out_shape))
        if slot is not None:
            old = _size_args(node, name)[slot]
            if isinstance(old, int) and old == out_shape[d]:
                local = new.local_size(old, an.tp)
                if local != old:
                    an.res.shape_args[node.name] = (slot, old, local)
            elif _computed(old) == out_shape[d]:
                # NOTE: a size the graph computes (``batch x heads`` of a symbolic batch, Bloom): divided
                # at run time by what the shards divide it by (whole for every batch: heads % tp == 0),
                # unless it reads the shard's own shape (fx: ``x.shape[-1]``): local already
                local = out_shape[d] if _reads_local_extent(an, old, new) else new.local_size(out_shape[d], an.tp)
                if local != out_shape[d]:
                    if out_shape[d] % local:
                        raise Unsupported
                    an.res.shape_args[node.name] = (slot, old.name, ("floordiv", out_shape[d] // local))
            elif not (isinstance(old, int) and old == -1):
                raise Unsupported
    elif name in ("view_as", "reshape_as"):
        raise Unsupported
    return new


def _check_heads(an, node, s, in_shape, out_shape):
    if len(out_shape) > len(in_shape) and s.dim == len(in_shape) - 1 and s.plain:
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
    return s.moved(b if d == a else a if d == b else d)


@register_rule("movedim")
def movedim(an, node, ins, states):
    s = states[0]
    nd_in = tensor_val(node.args[0]).dim()
    a, b = _two_dims(node, nd_in)
    perm = [i for i in range(nd_in) if i != a]
    perm.insert(b, a)
    return s.moved(perm.index(s.dim))


@register_rule("t")
def t(an, node, ins, states):
    s = states[0]
    return s.moved(1 - s.dim if tensor_val(node.args[0]).dim() == 2 else s.dim)


@register_rule("permute")
def permute(an, node, ins, states):
    s = states[0]
    nd_in = tensor_val(node.args[0]).dim()
    perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
    return s.moved([p % nd_in for p in perm].index(s.dim))


@register_rule("unsqueeze")
def unsqueeze(an, node, ins, states):
    s = states[0]
    u = node.args[1] % (tensor_val(node.args[0]).dim() + 1)
    return s.moved(s.dim + 1 if u <= s.dim else s.dim)


@register_rule("squeeze")
def squeeze(an, node, ins, states):
    s = states[0]
    d = s.dim
    nd_in = tensor_val(node.args[0]).dim()
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    return s.moved(d - sum(1 for i in range(d) if in_shape[i] == 1 and len(out_shape) < len(in_shape)
                           and _squeezed(node, i, nd_in)))


@register_rule("repeat_interleave")
def repeat_interleave(an, node, ins, states):
    s, d = states[0], node_arg(node, 2, "dim")
    if d is None or len(ins) > 1 or (d % tensor_val(node.args[0]).dim() == s.dim and (s.kind != TP or not s.plain)):
        raise Unsupported
    return s  # GQA: repeating local kv heads gives exactly the local query heads' kv


@register_rule("assert_tensor_metadata", "getattr", "size", "sym_size", "dim", tensor_output=False)
def metadata(an, node, ins, states):
    """Reading sizes / dtype of a sharded value: nothing to shard (a tensor result cannot run on shards)."""
    if tensor_val(node) is None:
        return None
    raise Unsupported


# ---------------------------------------------------------------------------------------------
# shape helpers


def _groups(in_shape, out_shape):
    """The runs of input dims and output dims a reshape maps onto each other, as index lists."""
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
        yield [k for k in gi if k < len(in_shape)], [k for k in gj if k < len(out_shape)]


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def view_state(in_shape, out_shape, s: Sharded, tp: int) -> Sharded | None:
    """The state after a reshape of a value in state ``s``, or None where no dim of the output is
    chunked alike.

    The group of input dims merged with ``s.dim`` reads ``[P, Q, A]`` (``P``: the dims before it
    times ``s.outer``, ``Q``: its chunked part, ``A``: the dims after). The sharded output dim is the
    first one ``k`` of the group whose prefix product ``L`` divides ``P``, with ``o_k = (P / L) * m``:
    either ``m`` splits ``Q`` (``m`` a multiple of ``tp``: the heads of a head split) or ``m`` is ``Q``
    times trailing dims (a merge of the heads with the head dim). ``P / L`` is the new ``outer``."""
    d = s.dim
    for gi, gj in _groups(in_shape, out_shape):
        if d not in gi:
            continue
        p = _prod(in_shape[k] for k in gi if k < d) * s.outer
        q = in_shape[d] // s.outer
        a = _prod(in_shape[k] for k in gi if k > d)
        lead = 1
        for k in gj:
            o = out_shape[k]
            if o != 1 and p % lead == 0 and (lead * o) % p == 0:
                m, outer = lead * o // p, p // lead
                if m <= q and q % m == 0 and (m % tp == 0 or s.blocks is not None):
                    factor, scale = q // m, s.scale and s.scale * (q // m)
                elif m > q and m % q == 0 and a % (m // q) == 0:
                    factor = m // q
                    scale = s.scale // factor if s.scale and s.scale % factor == 0 else None
                    factor = None
                else:
                    lead *= o
                    continue
                if outer > 1 and (s.kind != TP or s.blocks is not None):
                    return None
                if s.blocks is not None and factor is not None and not _blocks_divide(s.blocks, q, factor, tp):
                    return None
                return Sharded(k, s.kind, s.origins, outer, s.blocks, scale)
            lead *= o
        return None
    return None


def _blocks_divide(blocks, size: int, factor: int, tp: int) -> bool:
    """Blocks of a dim of ``size`` still whole units after the dim is split by ``factor`` (tp blocks
    also into multiples of ``tp``)."""
    total = sum(b for b, _ in blocks)
    for b, mode in blocks:
        units = b * size
        if units % total or (units // total) % factor or mode == "tp" and (units // total // factor) % tp:
            return False
    return True


def _reads_local_extent(an, size, new: Sharded) -> bool:
    """Whether ``size`` is ``x.shape[d]`` / ``x.size(d)`` / ``x.size()[d]`` of a value ``x``
    sharded the way the view's output is (same kind, along ``d``): at run time it reads the
    shard's own extent, which needs no division."""
    if op_name(size) == "getitem" and isinstance(size.args[1], int) and hasattr(size.args[0], "op"):
        src = size.args[0]
        if not ((op_name(src) == "getattr" and src.args[1:] == ("shape",)) or
                (op_name(src) == "size" and len(src.args) == 1)):
            return False
        x, d = src.args[0], size.args[1]
    elif op_name(size) in ("size", "sym_size") and len(size.args) == 2 and isinstance(size.args[1], int):
        x, d = size.args
    else:
        return False
    s, val = an.st(x), tensor_val(x)
    return (isinstance(s, Sharded) and val is not None and s.dim == d % val.dim() and s.kind == new.kind
            and s.local_size(int(val.shape[s.dim]), an.tp) == new.local_size(_computed(size), an.tp))


def _computed(arg) -> int | None:
    """The value of a size argument computed by the graph (a node with an int ``val``), else None."""
    val = getattr(arg, "meta", {}).get("val") if hasattr(arg, "op") else None
    return val if isinstance(val, int) and not isinstance(val, bool) else None


def _size_args(node, name):
    if name == "unflatten":
        sizes = node_arg(node, 2, "sizes")
        if hasattr(sizes, "op"):   # sizes the graph computes (fx: ``x.shape[:-1]``): none is rewritable
            val = sizes.meta.get("val")
            if not isinstance(val, (tuple, list)):
                raise Unsupported
            return [sizes] * len(val)
        return list(sizes)
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
