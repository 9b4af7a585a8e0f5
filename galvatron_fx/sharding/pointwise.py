"""Sharding rules of elementwise ops: activations, arithmetic (SwiGLU's product, residuals, rotary
embeddings), casts, dropout, and custom autograd functions whose bodies are elementwise. The
sharded inputs must agree on the (right-aligned) dim and layout; replicated inputs are copied
(broadcast along that dim) or scattered to this rank's chunk; duplicated inputs must broadcast."""

from __future__ import annotations

import torch
import torch.fx

from .registry import register_rule
from .state import SEQ, TP, Duplicated, Sharded, Unsupported, op_name, shape_of, tensor_val

POINTWISE = {
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid",
    "relu", "gelu", "silu", "erf", "abs", "reciprocal", "square", "clamp", "where", "masked_fill",
    "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone", "detach",
    "alias", "dropout", "native_dropout", "softplus", "mish", "cos", "sin", "floor_divide", "mul_scalar",
}
ACTIVATIONS = {"gelu", "silu", "relu", "tanh", "sigmoid", "mish", "softplus"}


@register_rule(*sorted(POINTWISE), duplicated=True)
def pointwise(an, node, ins, states):
    return elementwise(an, node, ins, states, shape_of(node))


def elementwise(an, node, ins, states, out: tuple[int, ...]):
    """The state of an elementwise (broadcasting) op of output shape ``out`` on ``ins``."""
    nd = len(out)
    sh = [(i, s) for i, s in zip(ins, states) if isinstance(s, Sharded)]
    if not any(s.kind == TP for _, s in sh) and any(isinstance(s, Duplicated) for s in states):
        return an.duplicated(node, ins, states)
    # NOTE: a sequence-sharded operand of a tp-sharded op (HF Llama's rotary cos / sin enter the
    # block as [1, seq, head_dim], so under sp they arrive in sequence chunks) is all-gathered
    # (backward: reduce-scatter of the partial gradients) and then broadcast like a replicated one
    gathered = {i for i, s in sh if s.kind == SEQ} if any(s.kind == TP for _, s in sh) else set()
    sh = [(i, s) for i, s in sh if i not in gathered]
    dims = {s.dim + nd - tensor_val(i).dim() for i, s in sh}
    layouts = {(s.kind, s.outer, s.blocks) for _, s in sh}
    if len(dims) != 1 or len(layouts) != 1:
        raise Unsupported
    d, (kind, outer, blocks) = dims.pop(), layouts.pop()
    for i, s in sh:
        if shape_of(i)[s.dim] != out[d]:
            raise Unsupported
    for i, s in zip(ins, states):
        if isinstance(s, Sharded) and i not in gathered or tensor_val(i) is None:
            continue
        di = d - (nd - tensor_val(i).dim())
        broadcast = di < 0 or shape_of(i)[di] == 1
        if i in gathered:
            if not broadcast:
                raise Unsupported
            an.conv(node, i, ("all_gather_seq", s.dim))
        elif isinstance(s, Duplicated):
            if not broadcast:   # a whole value beside this rank's chunk
                raise Unsupported
        elif broadcast:
            an.conv(node, i, ("copy",))
        elif outer == 1 and blocks is None:
            an.conv(node, i, ("scatter", di))
        elif blocks is None:
            an.conv(node, i, ("scatter_outer", di, outer))
        else:
            raise Unsupported
    scales = {s.scale for _, s in sh}
    origins = frozenset().union(*(s.origins for i, s in zip(ins, states)
                                  if isinstance(s, (Sharded, Duplicated)) and i not in gathered))
    return Sharded(d, kind, origins, outer, blocks, scales.pop() if len(scales) == 1 else None)


@register_rule("autograd_function_apply", tensor_output=False)
def custom_function(an, node, ins, states):
    """A custom autograd function (dynamo's ``autograd_function_apply(fwd_body, bwd_body, *args)``)
    is elementwise when both bodies are (every op of :data:`POINTWISE`, no constants) and its tensor
    outputs have one shape its tensor inputs broadcast to (Bloom's GELU); otherwise it is opaque:
    it runs on whole values (the shards' column linears are demoted) and ``res.notes`` says why."""
    why = _opaque(an.gm, node)
    if why:
        an.res.notes[node.name] = why
        raise Unsupported
    outs = node.meta.get("val")
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    shapes = {tuple(v.shape) for v in outs if isinstance(v, torch.Tensor)}
    if len(shapes) != 1:
        an.res.notes[node.name] = "custom autograd function with outputs of several shapes"
        raise Unsupported
    out = shapes.pop()
    try:
        torch.broadcast_shapes(out, *(tuple(tensor_val(i).shape) for i in ins))
    except RuntimeError:
        an.res.notes[node.name] = "custom autograd function whose inputs do not broadcast to its output"
        raise Unsupported from None
    state = elementwise(an, node, ins, states, out)
    return tuple(state if isinstance(v, torch.Tensor) else None for v in outs)


def _opaque(gm, node) -> str | None:
    """Why the bodies of ``autograd_function_apply`` ``node`` are not elementwise, or None."""
    for body in node.args[:2]:
        target = getattr(body, "target", None)
        mod = gm
        try:
            for part in str(target).split("."):
                mod = getattr(mod, part)
        except AttributeError:
            return f"custom autograd function: body {target} not found"
        if not isinstance(mod, torch.fx.GraphModule):
            return f"custom autograd function: body {target} is not a graph"
        for n in mod.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            name = op_name(n)
            if n.op == "get_attr" or name not in POINTWISE and name != "set_grad_enabled":
                return f"custom autograd function {target} is not elementwise ({n.op} {name})"
    return None
