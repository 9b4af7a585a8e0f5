"""Sharding states, analysis results and the small node helpers every rule uses.

See :mod:`galvatron_fx.sharding` for how the states are propagated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..ir import META_KEY

TP, SEQ = "tp", "seq"


@dataclass(frozen=True)
class Sharded:
    dim: int
    kind: str                              # TP | SEQ
    origins: frozenset = frozenset()       # column linears (node names) the shards come from


@dataclass(frozen=True)
class ParamShard:
    """How one parameter is sharded: along ``dim`` in ``tp`` chunks, per block of ``blocks`` (global
    sizes along ``dim``; one block unless a fused projection, e.g. q/k/v, is split per block)."""

    fqn: str
    dim: int
    tp: int
    blocks: tuple[int, ...]


@dataclass
class LayerTP:
    """Tensor-parallel analysis of one layer (node names throughout)."""

    layer: int
    name: str
    tp: int
    sp: bool
    column: list[str] = field(default_factory=list)          # column-parallel linear nodes
    row: list[str] = field(default_factory=list)             # row-parallel linear nodes
    vocab_embeddings: list[str] = field(default_factory=list)
    replicated_linears: list[str] = field(default_factory=list)
    shape_args: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # node -> (arg slot, old, new)
    split_sizes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    conversions: dict[tuple[str, str], tuple] = field(default_factory=dict)    # (consumer, input) -> op
    reduce_after: dict[str, tuple] = field(default_factory=dict)               # node -> ("all_reduce",) | ("reduce_scatter", dim)
    param_shards: dict[str, ParamShard] = field(default_factory=dict)          # get_attr node -> shard
    sharded_params: list[str] = field(default_factory=list)                    # fqns
    replicated_params: list[str] = field(default_factory=list)                 # fqns
    outputs: dict[str, Sharded | None] = field(default_factory=dict)           # escaping node -> layout
    states: dict[str, object] = field(default_factory=dict)


def is_sharded(s) -> bool:
    if isinstance(s, (tuple, list)):
        return any(isinstance(x, Sharded) for x in s)
    return isinstance(s, Sharded)


class Demote(Exception):
    """These column linears (node names) must run replicated; the layers are analysed again."""

    def __init__(self, origins):
        super().__init__(sorted(origins))
        self.origins = set(origins)


class Unsupported(Exception):
    """The op cannot run on the given shards."""


# ---------------------------------------------------------------------------------------------
# op vocabulary (torch functions, tensor methods, aten overloads, operator builtins)

def op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        t = node.target
        name = t.overloadpacket.__name__ if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
    else:
        return node.op
    name = name.lstrip("_") if name not in ("__getitem__",) else "getitem"
    if name.endswith("_") and name not in ("t_",):
        name = name.rstrip("_")  # in-place variants
    return {"truediv": "div", "unsafe_view": "view", "to_copy": "to", "scaled_dot_product_attention": "sdpa",
            "iadd": "add", "imul": "mul"}.get(name, name)


def node_arg(node: torch.fx.Node, pos: int, name: str, default=None):
    """Argument ``pos`` of ``node``, or its keyword ``name``."""
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def tensor_val(node) -> torch.Tensor | None:
    """The (fake) tensor ``node`` computes, or None (not a node, or a tuple / size / ... value)."""
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def shape_of(node) -> tuple[int, ...]:
    return tuple(int(s) for s in tensor_val(node).shape)


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The distinct input nodes of ``node`` that carry a tensor (or a tuple of them)."""
    seen: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: seen.append(n) if n not in seen else None)
    return [n for n in seen if tensor_val(n) is not None or isinstance(n.meta.get("val"), (tuple, list))]


def is_param(node) -> bool:
    info = node.meta.get(META_KEY) if isinstance(node, torch.fx.Node) else None
    return node.op == "get_attr" and info is not None and info.param is not None


def linear_operands(node: torch.fx.Node):
    """``(x, weight, bias, weight_out_dim)`` of a linear op with a parameter weight, else None.

    ``weight_out_dim`` is the dim of the weight parameter that indexes output features
    (0 for ``linear``'s ``[out, in]``, 1 for ``matmul(x, W[in, out])`` and ``addmm(b, x, W[in, out])``)."""
    name = op_name(node)
    if name == "linear":
        x, w, b = node_arg(node, 0, "input"), node_arg(node, 1, "weight"), node_arg(node, 2, "bias")
        return (x, w, b, 0) if is_param(w) and tensor_val(w).dim() == 2 else None
    if name == "matmul" and len(node.args) == 2 and is_param(node.args[1]) and tensor_val(node.args[1]).dim() == 2:
        return node.args[0], node.args[1], None, 1
    if (name == "addmm" and len(node.args) == 3 and not node.kwargs and is_param(node.args[2])
            and tensor_val(node.args[2]).dim() == 2):
        # addmm(bias, x, W[in, out]): transformers' Conv1D (GPT-2) after flattening x to 2-D
        b = node.args[0]
        return node.args[1], node.args[2], b if is_param(b) else None, 1
    return None


def embedding_operands(node: torch.fx.Node):
    """``(ids, weight)`` of an embedding lookup with a parameter table, else None."""
    if op_name(node) != "embedding":
        return None
    a, b = node.args[0], node.args[1]
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        w, ids = a, b          # aten.embedding(weight, indices, ...)
    else:
        ids, w = a, b          # F.embedding(input, weight, ...)
    pad = node_arg(node, 2, "padding_idx")
    if not is_param(w) or (pad is not None and pad != -1):
        return None
    return ids, w


def divisors(n: int) -> str:
    """``{1, ..., n}``: the divisors of ``n``, for error messages (``use tp in {...}``)."""
    return "{" + ", ".join(str(k) for k in range(1, n + 1) if n % k == 0) + "}"
