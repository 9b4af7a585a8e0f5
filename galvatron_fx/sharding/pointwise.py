"""Sharding rules of elementwise ops: activations, arithmetic (SwiGLU's product, residuals, rotary
embeddings), casts, dropout. The sharded inputs must agree on the (right-aligned) dim and kind;
replicated inputs are copied (broadcast along that dim) or scattered to this rank's chunk."""

from __future__ import annotations

from .registry import register_rule
from .state import Sharded, Unsupported, shape_of, tensor_val

POINTWISE = {
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid",
    "relu", "gelu", "silu", "erf", "abs", "reciprocal", "square", "clamp", "where", "masked_fill",
    "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone", "detach",
    "alias", "dropout", "native_dropout", "softplus", "mish", "cos", "sin", "floor_divide", "mul_scalar",
}
ACTIVATIONS = {"gelu", "silu", "relu", "tanh", "sigmoid", "mish", "softplus"}


@register_rule(*sorted(POINTWISE))
def pointwise(an, node, ins, states):
    out = shape_of(node)
    nd = len(out)
    sh = [(i, s) for i, s in zip(ins, states) if isinstance(s, Sharded)]
    dims = {s.dim + nd - tensor_val(i).dim() for i, s in sh}
    kinds = {s.kind for _, s in sh}
    if len(dims) != 1 or len(kinds) != 1:
        raise Unsupported
    d = dims.pop()
    for i, s in sh:
        if shape_of(i)[s.dim] != out[d]:
            raise Unsupported
    for i, s in zip(ins, states):
        if isinstance(s, Sharded) or tensor_val(i) is None:
            continue
        di = d - (nd - tensor_val(i).dim())
        if di < 0 or shape_of(i)[di] == 1:
            an.conv(node, i, ("copy",))
        else:
            an.conv(node, i, ("scatter", di))
    return Sharded(d, kinds.pop(), frozenset().union(*(s.origins for _, s in sh)))
