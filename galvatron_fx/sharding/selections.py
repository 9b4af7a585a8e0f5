"""Sharding rules of ops that take part of a dim: indexing (``getitem``, ``select``, ``index``),
slices (``slice``, ``narrow``) and splits (``split``, ``chunk``, ``unbind``).

Along a dim other than the sharded one they keep the shards. Along the sharded dim they take a
*fused projection apart* (q / k / v, gate / up): the column linear's output is a sequence of blocks,
found from every selection of the same value along that dim (:class:`~.state.Reblock`: the layer is
analysed again with the linear's weight sharded per block). A block whose extent divides by ``tp``
is chunked (mode ``"tp"``); one that does not (Falcon's single key / value head) is whole on every
rank (mode ``"full"``: its chunks are all-gathered right after the linear, the selection of it is
:class:`~.state.Duplicated`). The selection's bounds and sizes are rewritten in local coordinates
(negative bounds stay negative); a bound that cannot be rewritten (a tensor index) is Unsupported.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx

from .registry import register_rule
from .state import TP, Duplicated, Reblock, Sharded, Unsupported, node_arg, op_name, shape_of, tensor_val


class Part(NamedTuple):
    start: int        # global bounds along the dim
    end: int
    keep: bool        # the dim stays in the output (False: an integer index removes it)


class Selection(NamedTuple):
    parts: list[Part]
    out_dim: int      # where the dim is in the output (when kept)
    # how the local bounds are written back: (an, [(local start, local end)], local extent, global extent)
    rewrite: object


@register_rule("getitem", tensor_output=False)
def getitem(an, node, ins, states):
    """One part of a split (tuple) value, or basic indexing of a tensor."""
    if isinstance(node.args[0], torch.fx.Node) and tensor_val(node.args[0]) is None:
        parts = an.st(node.args[0])
        return parts[node.args[1]] if isinstance(parts, (tuple, list)) else None
    if tensor_val(node) is None:
        raise Unsupported
    return _select(an, node, states[0])


@register_rule("slice", "narrow", "select", "index")
def slice_(an, node, ins, states):
    if isinstance(states[0], Sharded) and any(an.st(i) is not None for i in ins[1:]):
        raise Unsupported
    return _select(an, node, states[0])


@register_rule("split", "chunk", "split_with_sizes", "unbind", tensor_output=False)
def split(an, node, ins, states):
    s = states[0]
    nd = tensor_val(node.args[0]).dim()
    parts = node.meta.get("val")
    dim = node_arg(node, 1 if op_name(node) == "unbind" else 2, "dim", 0) % nd
    if dim != s.dim:
        drop = op_name(node) == "unbind" and dim < s.dim
        return tuple(s.moved(s.dim - 1 if drop else s.dim) for _ in parts)
    return tuple(_along(an, node, node.args[0], s, selection(an, node, node.args[0], s.dim)))


def _select(an, node, s):
    x = node.args[0]
    sel = selection(an, node, x, s.dim)
    if sel is None:
        raise Unsupported
    if sel.parts is None:                 # the sharded dim is untouched
        return s.moved(sel.out_dim)
    return _along(an, node, x, s, sel)[0]


def _along(an, node, x, s, sel: Selection | None):
    """States of the parts ``sel`` takes of ``x`` (state ``s``) along its sharded dim."""
    if sel is None or sel.parts is None:
        raise Unsupported
    n = shape_of(x)[s.dim]
    if all(p.keep and (p.start, p.end) == (0, n) for p in sel.parts):
        return [s.moved(sel.out_dim)] * len(sel.parts)
    if s.kind != TP or s.outer != 1:
        raise Unsupported
    bounds = s.block_bounds(n) if s.blocks is not None else [(0, n, "tp")]
    starts = {b[0]: i for i, b in enumerate(bounds)}
    ends = {b[1]: i for i, b in enumerate(bounds)}
    if any(p.start not in starts or p.end not in ends or p.end <= p.start for p in sel.parts):
        _reblock(an, x, s, n, bounds)
    local = []
    for a, b, mode in bounds:
        local.append((b - a) // an.tp if mode == "tp" else b - a)
    offsets = [sum(local[:i]) for i in range(len(local) + 1)]
    states, ranges = [], []
    for p in sel.parts:
        i, j = starts[p.start], ends[p.end]
        modes = {bounds[k][2] for k in range(i, j + 1)}
        if modes == {"full"} and i == j:
            states.append(Duplicated(s.origins))
        elif modes == {"tp"} and p.keep:
            blocks = None if i == j else tuple(s.blocks[i:j + 1])
            states.append(Sharded(sel.out_dim, TP, s.origins, blocks=blocks, scale=None))
        else:
            raise Unsupported     # a part mixing chunked and whole blocks, or an index into chunks
        ranges.append((offsets[i], offsets[j + 1]))
    sel.rewrite(an, ranges, offsets[-1], n)
    return states


def _reblock(an, x, s, n, bounds):
    """Raise :class:`Reblock` with the blocks every selection of ``x`` along its sharded dim cuts
    (the present blocks refined), or Unsupported where they cannot map onto the linear's weight."""
    if s.scale is None or len(s.origins) != 1:
        raise Unsupported
    cuts = {a for a, _, _ in bounds} | {n}
    for u in x.users:
        sel = selection(an, u, x, s.dim)
        if sel is not None and sel.parts is not None:
            cuts |= {p.start for p in sel.parts} | {p.end for p in sel.parts}
    cuts = sorted(c for c in cuts if 0 <= c <= n)
    blocks = []
    for a, b in zip(cuts, cuts[1:]):
        old = next(m for lo, hi, m in bounds if lo <= a < hi)
        mode = "tp" if old == "tp" and (b - a) % an.tp == 0 else "full"
        size = (b - a) * s.scale
        if size % an.tp:
            raise Unsupported      # even a whole block must be evenly sharded in the weight
        blocks.append((size, mode))
    blocks = tuple(blocks)
    if blocks == (s.blocks or ((n * s.scale, "tp"),)):
        raise Unsupported
    raise Reblock(next(iter(s.origins)), blocks)


# ---------------------------------------------------------------------------------------------
# what a node selects along one dim of its input


def selection(an, node, x, dim) -> Selection | None:
    """What ``node`` takes of ``x`` along ``dim``: ``parts=None`` when it takes all of it (and
    ``out_dim`` says where the dim goes), None when ``node`` is not a selection it understands."""
    if not isinstance(node, torch.fx.Node) or not node.args or node.args[0] is not x or tensor_val(x) is None:
        return None
    name = op_name(node)
    nd, n = tensor_val(x).dim(), shape_of(x)[dim]
    if name == "getitem":
        return _getitem(node, dim, nd, n)
    if name in ("slice", "narrow", "select"):
        d = node_arg(node, 1, "dim", 0) % nd
        if d != dim:
            return Selection(None, dim - (1 if name == "select" and d < dim else 0), None)
        if name == "select":
            i = node_arg(node, 2, "index")
            return Selection([Part(i % n, i % n + 1, False)], dim, _scalar_rewrite(node, 2, i))
        if name == "narrow":
            start, length = node_arg(node, 2, "start"), node_arg(node, 3, "length")
            if not isinstance(start, int) or not isinstance(length, int):
                return None
            start %= n
            return Selection([Part(start, start + length, True)], dim, _narrow_rewrite(node, start))
        start, end, step = node_arg(node, 2, "start"), node_arg(node, 3, "end"), node_arg(node, 4, "step", 1)
        if step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (start, end)):
            return None
        a, b, _ = slice(start, end).indices(n)
        return Selection([Part(a, max(a, b), True)], dim, _bounds_rewrite(node, (2, start), (3, end), n))
    if name == "index":
        return _index(an, node, dim, n)
    if name in ("split", "split_with_sizes", "chunk", "unbind"):
        d = node_arg(node, 1 if name == "unbind" else 2, "dim", 0) % nd
        if d != dim:
            return Selection(None, dim, None)
        parts = node.meta.get("val")
        if not isinstance(parts, (tuple, list)):
            return None
        sizes = [int(p.shape[d]) if name != "unbind" else 1 for p in parts]
        cuts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        keep = name != "unbind"
        return Selection([Part(a, b, keep) for a, b in zip(cuts, cuts[1:])], dim, _split_rewrite(node, name, sizes))
    return None


def _getitem(node, dim, nd, n):
    idx = node.args[1]
    was_tuple = isinstance(idx, tuple)
    idx = idx if was_tuple else (idx,)
    pos = list(range(len(idx)))
    if any(isinstance(i, torch.fx.Node) for i in idx) or sum(i is Ellipsis for i in idx) > 1:
        return None
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        fill = nd - sum(1 for i in idx if i is not None and i is not Ellipsis)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
        pos = pos[:k] + [None] * fill + pos[k + 1:]
    in_dim = out_dim = 0
    for i, p in zip(idx, pos):
        if i is None:
            out_dim += 1
            continue
        if in_dim == dim:
            path = None if p is None else ((1, p) if was_tuple else (1,))
            return _item(i, out_dim, n, path)
        if isinstance(i, slice) or isinstance(i, (list, tuple)):
            out_dim += 1
        elif not isinstance(i, int):
            return None
        in_dim += 1
    return Selection(None, out_dim + (dim - in_dim), None)


def _item(i, out_dim, n, path):
    """Selection of index element ``i`` (at ``path`` in the node's arguments) along a dim of ``n``."""
    if isinstance(i, slice):
        if i == slice(None):
            return Selection(None, out_dim, None)
        if i.step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (i.start, i.stop)):
            return None
        a, b, _ = i.indices(n)

        def rewrite(an, ranges, local_n, global_n, i=i):
            (la, lb), = ranges
            new = slice(_bound(i.start, a, la, local_n, global_n, True),
                        _bound(i.stop, b, lb, local_n, global_n, False), i.step)
            _record(an, path, i, new)
        return Selection([Part(a, max(a, b), True)], out_dim, rewrite)
    if isinstance(i, int) and not isinstance(i, bool):
        def rewrite(an, ranges, local_n, global_n, i=i):
            (la, _), = ranges
            _record(an, path, i, la - local_n if i < 0 else la)
        return Selection([Part(i % n, i % n + 1, False)], out_dim, rewrite)
    if isinstance(i, (list, tuple)) and i and all(isinstance(v, int) for v in i):
        vals = [v % n for v in i]
        if vals != list(range(vals[0], vals[0] + len(vals))):
            return None

        def rewrite(an, ranges, local_n, global_n, i=i):
            (la, _), = ranges
            new = [(la + k - local_n if v < 0 else la + k) for k, v in enumerate(i)]
            _record(an, path, i, type(i)(new))
        return Selection([Part(vals[0], vals[-1] + 1, True)], out_dim, rewrite)
    return None


def _index(an, node, dim, n):
    """``aten.index(x, [None, ..., idx])`` with a one-element constant index along ``dim``."""
    indices = node_arg(node, 1, "indices")
    if not isinstance(indices, (list, tuple)):
        return None
    if dim >= len(indices) or indices[dim] is None:
        # one tensor index after the dim leaves the dims before it where they are
        tensors = [k for k, i in enumerate(indices) if i is not None]
        return Selection(None, dim, None) if len(tensors) <= 1 and all(k > dim for k in tensors) else None
    if any(i is not None for k, i in enumerate(indices) if k != dim):
        return None
    value = _constant_index(an, indices[dim])
    if value is None:
        return None

    def rewrite(an, ranges, local_n, global_n, value=value):
        (la, _), = ranges
        if (la - local_n if value < 0 else la) != value:
            raise Unsupported      # a constant tensor index is not rewritten
    return Selection([Part(value % n, value % n + 1, True)], dim, rewrite)


def _constant_index(an, node) -> int | None:
    """The value of a one-element integer constant (a lifted tensor, maybe copied), else None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and op_name(node) in ("lift_fresh_copy", "clone"):
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    obj = an.gm
    try:
        for part in node.target.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return None
    if not isinstance(obj, torch.Tensor) or obj.numel() != 1 or obj.is_floating_point() or obj.device.type == "meta" \
            or isinstance(obj, torch._subclasses.FakeTensor):
        return None
    return int(obj.item())


# ---------------------------------------------------------------------------------------------
# writing local bounds back


def _bound(orig, glob: int, loc: int, local_n: int, global_n: int, start: bool):
    """A slice bound in local coordinates, written as the original was (None, negative, past the end)."""
    if orig is None:
        if loc != (0 if start else local_n):
            raise Unsupported
        return None
    if orig >= global_n:
        if loc != local_n:
            raise Unsupported
        return orig
    return loc - local_n if orig < 0 else loc


def _record(an, path, old, new):
    if old == new:
        return
    if path is None:
        raise Unsupported
    an.res.const_args.setdefault(an.current.name, {})[path] = new


def _bounds_rewrite(node, start, end, n):
    def rewrite(an, ranges, local_n, global_n):
        (la, lb), = ranges
        a, b, _ = slice(start[1], end[1]).indices(global_n)
        _record(an, (start[0],) if len(node.args) > start[0] else ("start",), start[1],
                _bound(start[1], a, la, local_n, global_n, True))
        _record(an, (end[0],) if len(node.args) > end[0] else ("end",), end[1],
                _bound(end[1], b, lb, local_n, global_n, False))
    return rewrite


def _narrow_rewrite(node, start):
    def rewrite(an, ranges, local_n, global_n):
        (la, lb), = ranges
        _record(an, (2,), node.args[2], la - local_n if node.args[2] < 0 else la)
        _record(an, (3,), node.args[3], lb - la)
    return rewrite


def _scalar_rewrite(node, pos, value):
    def rewrite(an, ranges, local_n, global_n):
        (la, _), = ranges
        _record(an, (pos,) if len(node.args) > pos else ("index",), value, la - local_n if value < 0 else la)
    return rewrite


def _split_rewrite(node, name, sizes):
    def rewrite(an, ranges, local_n, global_n):
        local = tuple(b - a for a, b in ranges)
        if name == "unbind":
            raise Unsupported
        arg = node_arg(node, 1, "split_size_or_sections", node_arg(node, 1, "split_size"))
        if name == "chunk" or isinstance(arg, int):
            # chunk(n) / split(size) of the local value must cut the same parts
            if len(set(local)) != 1 or (name == "chunk" and local_n % len(local)):
                raise Unsupported
            if name == "chunk":
                return
        an.res.split_sizes[node.name] = (tuple(sizes), local)
    return rewrite
