"""Sharding rules of the ops that *start* sharded regions and end them: linears with a parameter
weight (``linear``, ``matmul(x, W)``, GPT-2's ``addmm``), embeddings with a parameter table, and
matmuls of two head-sharded activations (attention scores written out)."""

from __future__ import annotations

from ..errors import ConfigError
from ..ir import META_KEY
from .pointwise import ACTIVATIONS
from .registry import register_rule
from .state import (
    SEQ,
    TP,
    ParamShard,
    Sharded,
    Unsupported,
    divisors,
    embedding_operands,
    linear_operands,
    op_name,
    shape_of,
    tensor_val,
)


@register_rule("linear", "addmm", tensor_output=False)
def linear(an, node, ins, states):
    lin = linear_operands(node)
    if lin is None:
        raise Unsupported
    return parallel_linear(an, node, lin)


@register_rule("matmul", "bmm", tensor_output=False)
def matmul(an, node, ins, states):
    """``x @ W`` with a parameter weight is a linear; else a product of two tp-sharded activations
    sharded alike along a batch dim (heads)."""
    lin = linear_operands(node)
    if lin is not None:
        return parallel_linear(an, node, lin)
    if tensor_val(node) is None:
        raise Unsupported
    if len(ins) != 2 or not all(isinstance(s, Sharded) and s.kind == TP for s in states):
        raise Unsupported
    a, b = ins
    na, nb, no = tensor_val(a).dim(), tensor_val(b).dim(), tensor_val(node).dim()
    da, db = states[0].dim + no - na, states[1].dim + no - nb
    if da != db or da >= no - 2:
        raise Unsupported
    return Sharded(da, TP, states[0].origins | states[1].origins)


def parallel_linear(an, node, lin):
    """Column parallel on a replicated (or sequence-sharded) input, row parallel on a feature-sharded
    one, replicated where the width does not divide or the linear was demoted."""
    x, w, b, wout = lin
    s = an.st(x)
    out_w = shape_of(w)[wout]
    fqn = w.meta[META_KEY].param.fqn
    xd = tensor_val(x).dim()
    if s is None or (s.kind == SEQ and s.dim != xd - 1):
        if node.name not in an.demoted and _column_ok(an, node, out_w):
            an.conv(node, x, ("copy",) if s is None else ("all_gather_seq", s.dim))
            an.res.column.append(node.name)
            an.res.param_shards[w.name] = ParamShard(fqn, wout, an.tp, (out_w,))
            if b is not None:
                an.res.param_shards[b.name] = ParamShard(b.meta[META_KEY].param.fqn, 0, an.tp, (out_w,))
            return Sharded(tensor_val(node).dim() - 1, TP, frozenset({node.name}))
        an.res.replicated_linears.append(node.name)
        if s is None:
            return None
        _copy_params(an, node, w, b)
        return s
    if s.kind == TP and s.dim == xd - 1:      # row parallel
        an.res.row.append(node.name)
        in_w = shape_of(w)[1 - wout]
        an.res.param_shards[w.name] = ParamShard(fqn, 1 - wout, an.tp, (in_w,))
        return _reduce(an, node)
    if s.kind == TP:                           # weight applied per shard of another dim
        _copy_params(an, node, w, b)
        return s
    raise Unsupported


def _copy_params(an, node, w, b):
    for p in (w, b):
        if p is not None:
            an.conv(node, p, ("copy",))


def _column_ok(an, node, out_w) -> bool:
    if out_w % an.tp == 0:
        return True
    if an.kind == "block" and _feeds_activation(node):
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


def _reduce(an, node):
    """Sum the partial output of ``node``: all-reduce, or reduce-scatter along the sequence (sp)."""
    v = tensor_val(node)
    if an.sp and v.dim() == 3 and v.shape[1] % an.tp == 0:
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
    ids, w = emb
    rows = shape_of(w)[0]
    if an.st(ids) is not None or rows % an.tp or node.name in an.demoted:
        an.res.replicated_linears.append(node.name)
        if an.st(ids) is not None:
            raise Unsupported
        return None
    an.res.vocab_embeddings.append(node.name)
    an.res.param_shards[w.name] = ParamShard(w.meta[META_KEY].param.fqn, 0, an.tp, (rows,))
    return _reduce(an, node)
