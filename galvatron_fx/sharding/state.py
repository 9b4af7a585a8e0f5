"""Sharding states, analysis results and the small node helpers every rule uses.

See :mod:`galvatron_fx.sharding` for how the states are propagated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.fx

from ..ir import META_KEY

TP, SEQ = "tp", "seq"


@dataclass(frozen=True)
class Sharded:
    """A value split over the TP group along ``dim`` (``kind`` TP: heads / features; SEQ: sequence).

    ``outer`` > 1 (TP only): ``dim`` is laid out ``[outer, inner]`` and only ``inner`` is chunked,
    e.g. Bloom's ``batch x heads`` merged into one dim. ``blocks`` (TP only): ``dim`` is a fused
    projection's output taken apart later, a sequence of ``(size, mode)`` blocks in the column
    linear's output features: mode ``"tp"`` blocks are chunked (this rank's part of each), mode
    ``"full"`` blocks are whole on every rank (all-gathered after the linear, gradients partial like
    a :class:`Duplicated` value). ``scale``: output features of the origin per unit of ``dim`` (to
    map a selection back onto the linear's weight), None where that is unknown."""

    dim: int
    kind: str                              # TP | SEQ
    origins: frozenset = frozenset()       # column linears (node names) the shards come from
    outer: int = 1
    blocks: tuple[tuple[int, str], ...] | None = None
    scale: int | None = field(default=1, compare=False)

    def moved(self, dim: int) -> Sharded:
        """The same shards along another dim (a transpose, permute, reduction elsewhere, ...)."""
        return replace(self, dim=dim)

    @property
    def plain(self) -> bool:
        """Contiguous equal chunks of ``dim`` (no outer part, no fused blocks)."""
        return self.outer == 1 and self.blocks is None

    def local_size(self, size: int, tp: int) -> int:
        """This rank's extent of ``dim`` whose global extent is ``size``."""
        if self.blocks is None:
            return size // tp
        total = sum(b for b, _ in self.blocks)
        return sum(b * size // total // (tp if mode == "tp" else 1) for b, mode in self.blocks)

    def block_bounds(self, size: int) -> list[tuple[int, int, str]]:
        """``(start, end, mode)`` of every block along ``dim`` (global extent ``size``)."""
        total, start, out = sum(b for b, _ in self.blocks), 0, []
        for b, mode in self.blocks:
            out.append((start, start + b * size // total, mode))
            start = out[-1][1]
        return out


@dataclass(frozen=True)
class Duplicated:
    """Every TP rank holds the whole value, but (as for values inside a sharded region) its gradient
    is a partial sum over the group: a ``"full"`` block of a fused projection (Falcon's single
    key/value head next to sharded query heads). It must not leave the layer."""

    origins: frozenset = frozenset()


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
    vocab_losses: dict[str, object] = field(default_factory=dict)              # cross entropy node -> losses.VocabLoss
    sharded_outputs: list[str] = field(default_factory=list)                   # graph outputs left vocab-sharded
    states: dict[str, object] = field(default_factory=dict)
    # column linear -> (dim, local block sizes, modes): its "full" blocks are all-gathered after it
    regather: dict[str, tuple[int, tuple[int, ...], tuple[str, ...]]] = field(default_factory=dict)
    # node -> {argument path: new constant} (slice bounds, indices of a fused output's blocks)
    const_args: dict[str, dict[tuple, object]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)                        # node -> why it runs whole
    # linear / embedding node that runs replicated -> why (the report: galvatron_fx/sharding/report.py)
    why_replicated: dict[str, str] = field(default_factory=dict)


def is_sharded(s) -> bool:
    """``s`` (a state or a tuple of them) is not plainly replicated."""
    if isinstance(s, (tuple, list)):
        return any(isinstance(x, (Sharded, Duplicated)) for x in s)
    return isinstance(s, (Sharded, Duplicated))


def tp_origins(states) -> set[str]:
    """The column linears behind the TP-sharded and duplicated values among ``states`` (nested)."""
    out: set[str] = set()
    for s in states:
        if isinstance(s, (tuple, list)):
            out |= tp_origins(s)
        elif isinstance(s, Duplicated) or isinstance(s, Sharded) and s.kind == TP:
            out |= set(s.origins)
    return out


class Demote(Exception):
    """These column linears (node names) must run replicated; the layers are analysed again.
    ``why`` says what forced it (kept for the TP report)."""

    def __init__(self, origins, why: str = "its output cannot be used sharded"):
        super().__init__(sorted(origins))
        self.origins = set(origins)
        self.why = why


class Unsupported(Exception):
    """The op cannot run on the given shards."""


class Reblock(Exception):
    """The output of column linear ``origin`` is taken apart into ``blocks`` (``(size, mode)`` in
    its output features): the layer is analysed again with the weight sharded per block."""

    def __init__(self, origin: str, blocks: tuple[tuple[int, str], ...]):
        super().__init__(origin, blocks)
        self.origin, self.blocks = origin, blocks


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
    return info is not None and node.op == "get_attr" and info.param is not None


def set_arg(node: torch.fx.Node, path: tuple, value) -> None:
    """Replace the constant at ``path`` in ``node``'s arguments: ``(i, j, ...)`` indexes ``node.args``
    then nested tuples / lists, a first element of type str names a keyword."""
    head, rest = path[0], path[1:]
    if isinstance(head, str):
        node.kwargs = {**node.kwargs, head: _set_in(node.kwargs[head], rest, value)}
    else:
        args = list(node.args)
        args[head] = _set_in(args[head], rest, value)
        node.args = tuple(args)


def _set_in(container, path, value):
    if not path:
        return value
    items = list(container)
    items[path[0]] = _set_in(items[path[0]], path[1:], value)
    return type(container)(items)


def divisors(n: int) -> str:
    """``{1, ..., n}``: the divisors of ``n``, for error messages (``use tp in {...}``)."""
    return "{" + ", ".join(str(k) for k in range(1, n + 1) if n % k == 0) + "}"
