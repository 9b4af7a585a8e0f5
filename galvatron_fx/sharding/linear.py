"""Sharding rules of the ops that *start* sharded regions and end them: linears with a parameter
weight in every form of :mod:`.operands` (``linear``, ``matmul`` also on a transposed parameter,
GPT-2's ``addmm``, batched / grouped expert weights, ``einsum``), embeddings with a parameter
table (also with a padding row), and matmuls of two head-sharded activations (attention scores
written out, Bloom's ``baddbmm`` with ALiBi)."""

from __future__ import annotations

from ..errors import ConfigError
from ..ir import META_KEY
from .operands import GROUPED_MM, LinearOperands, embedding_operands, linear_operands
from .pointwise import ACTIVATIONS
from .registry import register_rule
from .state import (
    SEQ,
    TP,
    ParamShard,
    Sharded,
    Unsupported,
    divisors,
    node_arg,
    op_name,
    shape_of,
    tensor_val,
)


@register_rule("linear", "addmm", "float8_matmul", tensor_output=False)
def linear(an, node, ins, states):
    lin = linear_operands(node)
    if lin is None:
        raise Unsupported
    return parallel_linear(an, node, lin)


@register_rule("matmul", "bmm", "baddbmm", "einsum", *sorted(GROUPED_MM), tensor_output=False)
def matmul(an, node, ins, states):
    """A linear when a parameter is the weight (:func:`~.operands.linear_operands`); else a product
    of two tp-sharded activations sharded alike along a batch dim (heads; Bloom's ``batch x heads``),
    plus, for ``baddbmm``, an addend (ALiBi) copied or scattered to this rank's part."""
    lin = linear_operands(node)
    if lin is not None:
        return parallel_linear(an, node, lin)
    name = op_name(node)
    if tensor_val(node) is None or name not in ("matmul", "bmm", "baddbmm"):
        raise Unsupported
    if name == "baddbmm":
        addend, a, b = node_arg(node, 0, "input"), node_arg(node, 1, "batch1"), node_arg(node, 2, "batch2")
    else:
        addend, a, b = None, node.args[0], node_arg(node, 1, "mat2", node_arg(node, 1, "other"))
    sa, sb = an.st(a), an.st(b)
    if not all(isinstance(x, Sharded) and x.kind == TP for x in (sa, sb)):
        raise Unsupported
    na, nb, no = tensor_val(a).dim(), tensor_val(b).dim(), tensor_val(node).dim()
    da, db = sa.dim + no - na, sb.dim + no - nb
    if da != db or da >= no - 2 or (sa.outer, sa.blocks) != (sb.outer, sb.blocks):
        raise Unsupported
    out = Sharded(da, TP, sa.origins | sb.origins, sa.outer, sa.blocks, None)
    if addend is not None:
        _addend(an, node, addend, out)
    return out


def _addend(an, node, addend, out: Sharded) -> None:
    """Conversion of a tensor added to an output in state ``out`` (Unsupported where none fits)."""
    s, nd = an.st(addend), tensor_val(node).dim()
    d = out.dim - (nd - tensor_val(addend).dim())
    if isinstance(s, Sharded):
        if (s.dim, s.kind, s.outer, s.blocks) != (d, out.kind, out.outer, out.blocks):
            raise Unsupported
    elif s is not None:
        raise Unsupported
    elif d < 0 or shape_of(addend)[d] == 1:
        an.conv(node, addend, ("copy",))
    elif out.plain:
        an.conv(node, addend, ("scatter", d))
    elif out.blocks is None:
        an.conv(node, addend, ("scatter_outer", d, out.outer))
    else:
        raise Unsupported


def parallel_linear(an, node, lin: LinearOperands):
    """Column parallel on a replicated (or sequence-sharded) input, row parallel on an input sharded
    along its input features, replicated where the width does not divide or the linear was demoted."""
    x, w, b = lin.x, lin.weight, lin.bias
    s = an.st(x)
    out_w = shape_of(w)[lin.w_out]
    fqn = w.meta[META_KEY].param.fqn
    if s is None or (s.kind == SEQ and s.dim != lin.x_in and s.dim not in lin.x_shared):
        blocks = an.blocks.get(node.name)
        out = Sharded(lin.y_out, TP, frozenset({node.name}), blocks=blocks)
        adapter = adapter_down(node, lin)
        if node.name not in an.demoted and not adapter and _column_ok(an, node, out_w, shape_of(w)[lin.w_in]) \
                and _addend_ok(an, node, lin, out):
            an.conv(node, x, ("copy",) if s is None else ("all_gather_seq", s.dim))
            if lin.addend is not None:
                _addend(an, node, lin.addend, out)
            an.res.column.append(node.name)
            sizes = tuple(size for size, _ in blocks) if blocks else (out_w,)
            an.res.param_shards[w.name] = ParamShard(fqn, lin.w_out, an.tp, sizes)
            if b is not None:
                an.res.param_shards[b.name] = ParamShard(b.meta[META_KEY].param.fqn, tensor_val(b).dim() - 1,
                                                         an.tp, sizes)
            if blocks and any(mode == "full" for _, mode in blocks):
                # NOTE: a "full" block's chunks are all-gathered right after the linear (backward:
                # reduce-scatter), so the weight stays evenly sharded and the block whole on each rank
                an.res.regather[node.name] = (lin.y_out, tuple(size // an.tp for size in sizes),
                                              tuple(mode for _, mode in blocks))
            return out
        an.replicated(node, ADAPTER_WHY.format(r=out_w) if adapter else _column_why(an, out_w))
        if s is None:
            return None
        if lin.addend is not None:
            raise Unsupported       # a whole addend beside sequence chunks: gathered instead
        _copy_params(an, node, lin)
        return s
    if s.kind == TP and s.dim == lin.x_in and s.plain and lin.addend is None:      # row parallel
        an.res.row.append(node.name)
        in_w = shape_of(w)[lin.w_in]
        an.res.param_shards[w.name] = ParamShard(fqn, lin.w_in, an.tp, (in_w,))
        return _reduce(an, node)
    if s.kind == TP and op_name(node) in ("linear", "matmul", "addmm") and s.dim < tensor_val(x).dim() - 1 \
            and tensor_val(w).dim() == 2:
        _copy_params(an, node, lin)          # weight applied per shard of another dim
        return s
    raise Unsupported


ADAPTER_WHY = ("low-rank adapter A (rank {r}): runs replicated so that its B shards like the base layer "
               "(no collective of its own)")
_PASS_THROUGH = {"dropout", "mul", "to", "contiguous", "clone", "type_as", "float", "alias", "identity"}


def _through(node, hops: int = 2):
    """``node``, or the last of up to ``hops`` single-user pass-through ops after it (dropout, a
    scaling ``mul``, a cast)."""
    for _ in range(hops):
        if len(node.users) != 1:
            break
        user = next(iter(node.users))
        if op_name(user) not in _PASS_THROUGH:
            break
        node = user
    return node


def adapter_down(node, lin: LinearOperands) -> bool:
    """Whether ``node`` is the down-projection ``A`` of a low-rank adapter (LoRA as peft writes it:
    ``base(x) + B(A(dropout(x))) * scaling``): a linear to ``r <= in / 4`` features whose only user
    (through pass-through ops) is a linear ``B`` from those ``r`` features, whose output is added to
    something. Run replicated on a replicated input, it lets ``B`` shard like the base layer
    (column-parallel, the sum sharded alike); a column-parallel ``A`` would make ``B`` row-parallel
    and its output a whole-width all-reduce per adapter."""
    w = shape_of(lin.weight)
    r, n_in = w[lin.w_out], w[lin.w_in]
    if r * 4 > n_in:
        return False
    end = _through(node)
    if len(end.users) != 1:
        return False
    b = next(iter(end.users))
    blin = linear_operands(b)
    if blin is None or blin.x is not end or shape_of(blin.weight)[blin.w_in] != r:
        return False
    return any(op_name(u) == "add" for u in _through(b).users)


def _addend_ok(an, node, lin, out) -> bool:
    if lin.addend is None:
        return True
    try:
        _addend(an, node, lin.addend, out)
    except Unsupported:
        return False
    an.res.conversions.pop((node.name, lin.addend.name), None)
    return True


def _copy_params(an, node, lin):
    for p in (lin.weight_arg, lin.bias):
        if p is not None:
            an.conv(node, p, ("copy",))


def _column_why(an, out_w) -> str:
    if out_w % an.tp:
        return f"output width {out_w} does not divide by tp={an.tp}"
    return "its bias / addend cannot take the output's shards"


def _column_ok(an, node, out_w: int, in_w: int) -> bool:
    """Whether the linear may go column-parallel; raises for an FFN up-projection (at least as wide
    as its input, feeding an activation) whose width does not divide by tp. A narrower one (a gate:
    Qwen2-MoE's 1-wide shared-expert gate before its sigmoid; an MoE router) stays whole."""
    if out_w % an.tp == 0:
        return True
    if an.kind == "block" and out_w >= in_w and _feeds_activation(node):
        raise ConfigError(f"layer {an.record.name}: ffn width {out_w} (output of {node.name}) is not "
                          f"divisible by tp={an.tp}; use tp in {divisors(out_w)}")
    return False


def _feeds_activation(node, depth: int = 3) -> bool:
    frontier = [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users]
        if any(op_name(u) in ACTIVATIONS for u in frontier):
            return True
    return False


def _reduce(an, node, scatter: bool = True):
    """Sum the partial output of ``node``: all-reduce, or (``scatter``) reduce-scatter along the sequence (sp)."""
    v = tensor_val(node)
    if scatter and an.sp and v.dim() == 3 and v.shape[1] > 1:   # uneven chunks where tp does not divide
        an.res.reduce_after[node.name] = ("reduce_scatter", 1)
        return Sharded(1, SEQ)
    an.res.reduce_after[node.name] = ("all_reduce",)
    return None


@register_rule("embedding", tensor_output=False)
def embedding(an, node, ins, states):
    """Vocab parallel when the table's rows divide by tp (the partial lookups are summed)."""
    emb = embedding_operands(node)
    if emb is None:
        raise Unsupported
    ids, w, _pad = emb
    rows = shape_of(w)[0]
    if an.st(ids) is not None or rows % an.tp or node.name in an.demoted:
        an.replicated(node, f"{rows} rows do not divide by tp={an.tp}" if rows % an.tp
                      else "its indices are sharded")
        if an.st(ids) is not None:
            raise Unsupported
        return None
    an.res.vocab_embeddings.append(node.name)
    an.res.param_shards[w.name] = ParamShard(w.meta[META_KEY].param.fqn, 0, an.tp, (rows,))
    # NOTE: a lookup inside a block (T5's relative attention bias, [q, k, heads]) is no sequence
    # activation: it is all-reduced, so that it reaches attention whole
    return _reduce(an, node, scatter=an.kind != "block")
