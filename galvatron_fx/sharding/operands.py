"""Which ops are linears and embeddings with a parameter weight, in every form a front end writes
them, and which dims of their operands carry the input / output features.

A *linear* is ``F.linear(x, W[out, in])``, ``x @ W[in, out]`` (``matmul``, also on a transposed
parameter: Falcon's ``x @ W.T``), Float8 training's ``float8_matmul(x, W[out, in])``, GPT-2's
``addmm(b, x, W[in, out])``, a batched expert weight ``bmm(x[E, T, in], W[E, in, out])`` /
``baddbmm(b, x, W)``, a grouped expert matmul (``grouped_mm(x[T, in], W[E, in, out], offs)``:
transformers' MoE experts), or an ``einsum`` with one contracted index shared by ``x`` and ``W``
and one output index of ``W`` alone. ``W`` is a parameter, possibly through dim-permuting views
(``t``, ``transpose``, ``permute``, ``.T``, ``.mT``, casts), which run unchanged on the
parameter's shard.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx

from .state import is_param, node_arg, op_name, tensor_val

WEIGHT_VIEWS = {"t", "transpose", "permute", "numpy_T", "getattr", "contiguous", "to", "float", "half",
                "bfloat16", "type_as", "alias"}
"""Ops through which a parameter still is a linear's weight (they permute dims or cast, nothing else)."""

GROUPED_MM = {"grouped_mm_fallback", "grouped_mm", "_grouped_mm"}


class LinearOperands(NamedTuple):
    x: torch.fx.Node
    weight: torch.fx.Node            # the parameter's get_attr node
    bias: torch.fx.Node | None       # a parameter bias (sharded with the output features), else None
    w_out: int                       # dim of the parameter indexing output features
    w_in: int                        # dim of the parameter indexing input features
    y_out: int                       # dim of the output indexing output features
    x_in: int                        # dim of x indexing input features
    weight_arg: torch.fx.Node        # the weight as the op reads it (the parameter or its view)
    x_shared: tuple[int, ...] = ()   # dims of x that also index the weight (experts)
    addend: torch.fx.Node | None = None   # a tensor added to the product (bias or not): baddbmm's input


def weight_param(node) -> tuple[torch.fx.Node, list[int]] | None:
    """``(parameter node, perm)`` when ``node`` is a parameter seen through :data:`WEIGHT_VIEWS`
    (``perm[i]``: the parameter dim that dim ``i`` of ``node`` is), else None."""
    if not isinstance(node, torch.fx.Node) or tensor_val(node) is None:
        return None
    if is_param(node):
        return node, list(range(tensor_val(node).dim()))
    if node.op not in ("call_function", "call_method") or op_name(node) not in WEIGHT_VIEWS or not node.args:
        return None
    inner = weight_param(node.args[0])
    if inner is None:
        return None
    p, perm = inner
    name, nd = op_name(node), len(perm)
    if name == "t" and nd == 2 or name == "numpy_T":
        return p, perm[::-1]
    if name == "getattr":
        if node.args[1] == "T":
            return p, perm[::-1]
        if node.args[1] == "mT" and nd >= 2:
            return p, perm[:-2] + [perm[-1], perm[-2]]
        return None
    if name == "transpose":
        a, b = (d % nd for d in node.args[1:3])
        perm = list(perm)
        perm[a], perm[b] = perm[b], perm[a]
        return p, perm
    if name == "permute":
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return p, [perm[d % nd] for d in dims]
    if name in ("to", "type_as", "float", "half", "bfloat16", "contiguous", "alias"):
        v, x = tensor_val(node), tensor_val(node.args[0])
        return (p, perm) if tuple(v.shape) == tuple(x.shape) else None
    return None


def weight_consumers(param: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops reading parameter ``param``, through :data:`WEIGHT_VIEWS` nodes (which are skipped)."""
    out, frontier = [], [param]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.op != "output" and op_name(u) in WEIGHT_VIEWS and weight_param(u) is not None:
                frontier.append(u)
            else:
                out.append(u)
    return out


def linear_operands(node: torch.fx.Node) -> LinearOperands | None:
    """The operands of a linear op with a parameter weight (see the module docstring), else None."""
    name = op_name(node)
    if node.op not in ("call_function", "call_method"):
        return None
    if name == "linear":
        x, w, b = node_arg(node, 0, "input"), node_arg(node, 1, "weight"), node_arg(node, 2, "bias")
        return _two_d(node, x, w, b, out_dim=0)
    if name == "float8_matmul" and len(node.args) == 2:
        # Float8 training's linear (galvatron_fx.models.float8): x @ W[out, in].T on fp8 operands
        return _two_d(node, node.args[0], node.args[1], None, out_dim=0)
    if name == "matmul" and len(node.args) == 2 and not node.kwargs:
        lin = _two_d(node, node.args[0], node.args[1], None, out_dim=1)
        return lin or _batched(node, node.args[0], node.args[1], None)
    if name == "addmm" and len(node.args) == 3 and not node.kwargs:
        # addmm(bias, x, W[in, out]): transformers' Conv1D (GPT-2) after flattening x to 2-D
        return _two_d(node, node.args[1], node.args[2], node.args[0], out_dim=1)
    if name == "bmm" and len(node.args) == 2:
        return _batched(node, node.args[0], node.args[1], None)
    if name == "baddbmm":
        return _batched(node, node_arg(node, 1, "batch1"), node_arg(node, 2, "batch2"), node_arg(node, 0, "input"))
    if name in GROUPED_MM:
        x, w = node_arg(node, 0, "input"), node_arg(node, 1, "weight")
        wp = weight_param(w)
        if wp is None or tensor_val(w).dim() != 3 or tensor_val(x) is None or tensor_val(x).dim() != 2:
            return None
        p, perm = wp
        return LinearOperands(x, p, None, perm[2], perm[1], 1, 1, w)
    if name == "einsum":
        return _einsum(node)
    return None


def _two_d(node, x, w, b, out_dim: int) -> LinearOperands | None:
    wp = weight_param(w)
    if wp is None or len(wp[1]) != 2 or tensor_val(x) is None or tensor_val(node) is None:
        return None
    p, perm = wp
    bias = b if is_param(b) and tensor_val(b).dim() == 1 else None
    if isinstance(b, torch.fx.Node) and bias is None:
        return None   # a non-parameter bias: not a plain linear
    return LinearOperands(x, p, bias, perm[out_dim], perm[1 - out_dim], tensor_val(node).dim() - 1,
                          tensor_val(x).dim() - 1, w)


def _batched(node, x, w, addend) -> LinearOperands | None:
    """``x[E, T, in] @ W[E, in, out]`` with a 3-D parameter ``W`` (batched expert weights)."""
    wp = weight_param(w)
    if wp is None or len(wp[1]) != 3 or tensor_val(x) is None or tensor_val(x).dim() != 3:
        return None
    p, perm = wp
    out = int(tensor_val(p).shape[perm[2]])
    if is_param(addend) and tensor_val(addend).shape[-1] == out and out > 1:
        return LinearOperands(x, p, addend, perm[2], perm[1], 2, 2, w, (0,))   # a bias sharded with the output
    return LinearOperands(x, p, None, perm[2], perm[1], 2, 2, w, (0,), addend)


def _einsum(node) -> LinearOperands | None:
    """``einsum(eq, x, W)`` (or ``(eq, W, x)``) that is a linear: ``W``'s subscripts are distinct
    letters, one (``o``) only in ``W`` and the output, one (``i``) only in ``W`` and ``x``, the rest
    in all three; every subscript of ``x`` but ``i`` is in the output."""
    eq = node.args[0] if node.args else None
    ops = list(node.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or "->" not in eq or len(ops) != 2:
        return None
    lhs, rhs = eq.replace(" ", "").split("->")
    subs = lhs.split(",")
    if len(subs) != 2:
        return None
    k = next((j for j in (1, 0) if weight_param(ops[j]) is not None), None)
    if k is None or weight_param(ops[1 - k]) is not None:
        return None
    sw, sx, x, w = subs[k], subs[1 - k], ops[1 - k], ops[k]
    if "." in sw or len(set(sw)) != len(sw) or len(set(sx.replace("...", ""))) != len(sx.replace("...", "")) \
            or len(set(rhs.replace("...", ""))) != len(rhs.replace("...", "")):
        return None
    if sx.count("...") > 1 or rhs.count("...") != sx.count("..."):
        return None
    outs = [c for c in sw if c in rhs and c not in sx]
    ins = [c for c in sw if c in sx and c not in rhs]
    if len(outs) != 1 or len(ins) != 1 or any(c not in sx and c not in rhs for c in sw):
        return None
    if any(c not in rhs for c in sx.replace("...", "") if c != ins[0]):
        return None
    nx = tensor_val(x).dim()
    ell = nx - len(sx.replace("...", ""))

    def expand(s):
        return s.replace("...", "." * ell)

    ex, er = expand(sx), expand(rhs)
    p, perm = weight_param(w)
    shared = tuple(ex.index(c) for c in sw if c in sx and c in rhs)
    return LinearOperands(x, p, None, perm[sw.index(outs[0])], perm[sw.index(ins[0])], er.index(outs[0]),
                          ex.index(ins[0]), w, shared)


def embedding_operands(node: torch.fx.Node):
    """``(ids, weight, padding_idx)`` of an embedding lookup with a parameter table, else None
    (``padding_idx`` None when the table has no padding row; max-norm lookups are not embeddings here)."""
    if op_name(node) != "embedding" or len(node.args) < 2:
        return None
    a, b = node.args[0], node.args[1]
    aten = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    if aten:
        w, ids = a, b          # aten.embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    else:
        ids, w = a, b          # F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    pad = node_arg(node, 2, "padding_idx")
    if not is_param(w) or not aten and node_arg(node, 3, "max_norm") is not None:
        return None
    if node_arg(node, 3 if aten else 5, "scale_grad_by_freq", False) or node_arg(node, 4 if aten else 6, "sparse", False):
        return None
    if pad is None or aten and pad == -1:   # aten's -1: no padding row (F.embedding's -1: the last row)
        return ids, w, None
    return ids, w, int(pad) % int(tensor_val(w).shape[0])
