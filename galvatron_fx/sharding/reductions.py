"""Sharding rules of ops that work along some dims: norms over trailing dims, reductions and
dim-wise ops (softmax, cumsum, ...) over dims other than the sharded one, and concatenation (or
stacking) of values sharded alike along another dim."""

from __future__ import annotations

from dataclasses import replace

from .registry import register_rule
from .state import Sharded, Unsupported, node_arg, op_name, tensor_val

REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod"}
DIMWISE = {"softmax", "log_softmax", "cumsum", "argmax", "argmin"}


@register_rule("layer_norm", "rms_norm", "group_norm")
def norm(an, node, ins, states):
    """A norm over trailing dims the shards do not split runs on them (its weight / bias copied)."""
    x = node.args[0]
    s = an.st(x)
    nd = tensor_val(x).dim()
    name = op_name(node)
    ns = node_arg(node, 1, "normalized_shape")
    k = len(ns) if isinstance(ns, (list, tuple)) else 1
    if name == "group_norm" or not isinstance(s, Sharded) or s.dim >= nd - k:
        raise Unsupported
    if any(i is not x and an.st(i) is not None for i in ins):
        raise Unsupported
    for i in ins:
        if i is not x:
            an.conv(node, i, ("copy",))
    return s


@register_rule(*sorted(REDUCTIONS | DIMWISE))
def reduce(an, node, ins, states):
    x = node.args[0]
    s = an.st(x)
    if len(ins) != 1 or not isinstance(s, Sharded):
        raise Unsupported
    nd = tensor_val(x).dim()
    dims = node_arg(node, 1, "dim")
    if dims is None:
        raise Unsupported
    dims = [d % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if s.dim in dims:
        raise Unsupported
    keep = op_name(node) in DIMWISE or bool(node_arg(node, 2, "keepdim", False))
    return s.moved(s.dim - (0 if keep else sum(1 for d in dims if d < s.dim)))


def _empty_1d(node) -> bool:
    v = tensor_val(node)
    return v is not None and v.dim() == 1 and v.numel() == 0


@register_rule("cat", "stack")
def cat(an, node, ins, states):
    """Values sharded alike, concatenated (or stacked: GPT-J's interleaved rotary) along another dim.
    A 1-D empty operand (transformers' empty KV cache, ``cat([tensor([]), k])``) is skipped, as
    ``torch.cat`` itself skips it."""
    nd = tensor_val(node).dim()
    dim = node_arg(node, 1, "dim", 0) % nd
    if op_name(node) == "cat":
        states = [s for i, s in zip(ins, states) if not _empty_1d(i) or s is not None]
    sh = [s for s in states if isinstance(s, Sharded)]
    if len({(s.dim, s.kind, s.outer, s.blocks) for s in sh}) != 1 or len(sh) != len(states):
        raise Unsupported
    s = sh[0]
    if op_name(node) == "stack":
        out = s.dim + 1 if dim <= s.dim else s.dim
    elif s.dim == dim:
        raise Unsupported
    else:
        out = s.dim
    return replace(s, dim=out, origins=frozenset().union(*(x.origins for x in sh)))
