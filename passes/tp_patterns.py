"""Tensor-parallel pattern detection: which ops of a layer can run sharded, found from the graph.

No module names are read. Inside each layer with ``tp > 1`` a *sharding state* is propagated
through the ops in graph order (on the global shapes of ``node.meta["val"]``):

* ``None``: replicated in the TP group (every rank holds the same full value);
* :class:`Sharded` ``(dim, "tp")``: split into ``tp`` contiguous chunks along ``dim`` (heads / features);
* :class:`Sharded` ``(dim, "seq")``: sequence parallel, split along the sequence (dim 1 of a layer's
  ``[batch, seq, hidden]`` boundary activations).

A linear op (``linear`` of any capture flavour, or ``matmul``) with a parameter weight and a
replicated (or sequence-sharded) input is *column parallel*: its output is ``Sharded(-1, "tp")``.
That state flows through head splits (view / reshape / unflatten, whose size arguments are then
rewritten), transposes, elementwise ops (activations, SwiGLU's product, rotary embeddings),
``repeat_interleave`` of GQA key/value heads and scaled-dot-product attention, up to the linear that
consumes a feature-sharded input: the *row-parallel* linear, whose partial output is summed
(all-reduce, or reduce-scatter along the sequence with ``sp``). An embedding whose table rows divide
by ``tp`` is vocab parallel. A fused q/k/v output that is ``split`` along its sharded dim records the
block sizes, so the weight is sharded per block.

Where a tp-sharded value reaches an op that cannot work on shards (a norm over the sharded dim,
the layer boundary, ...), the column linears it came from are *demoted* (run replicated) and the
layer is analysed again; before a loss (cross entropy of vocab-parallel logits) the value is
all-gathered instead. A sequence-sharded value reaching such an op is all-gathered.

The result, :class:`LayerTP`, is plain data: roles of nodes, per-edge conversions, new shape
arguments, parameter shards. :mod:`galvatron_fx.passes.tensor_parallel` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import ConfigError
from ..ir import META_KEY, graph_info

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


def _is_sharded(s) -> bool:
    if isinstance(s, (tuple, list)):
        return any(isinstance(x, Sharded) for x in s)
    return isinstance(s, Sharded)


class _Demote(Exception):
    def __init__(self, origins):
        super().__init__(sorted(origins))
        self.origins = set(origins)


class _Unsupported(Exception):
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


POINTWISE = {
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid",
    "relu", "gelu", "silu", "erf", "abs", "reciprocal", "square", "clamp", "where", "masked_fill",
    "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone", "detach",
    "alias", "dropout", "native_dropout", "softplus", "mish", "cos", "sin", "floor_divide", "mul_scalar",
}
ACTIVATIONS = {"gelu", "silu", "relu", "tanh", "sigmoid", "mish", "softplus"}
LINEAR = {"linear", "matmul"}
LOSSES = {"cross_entropy", "cross_entropy_loss", "nll_loss", "log_softmax", "binary_cross_entropy_with_logits", "mse_loss"}
VIEWS = {"view", "reshape", "unflatten", "flatten", "view_as", "reshape_as"}
REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod"}
DIMWISE = {"softmax", "log_softmax", "cumsum", "argmax", "argmin"}


def _arg(node: torch.fx.Node, pos: int, name: str, default=None):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _shape(node) -> tuple[int, ...]:
    return tuple(int(s) for s in _val(node).shape)


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    seen: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: seen.append(n) if n not in seen else None)
    return [n for n in seen if _val(n) is not None or isinstance(n.meta.get("val"), (tuple, list))]


def is_param(node) -> bool:
    info = node.meta.get(META_KEY) if isinstance(node, torch.fx.Node) else None
    return node.op == "get_attr" and info is not None and info.param is not None


def linear_operands(node: torch.fx.Node):
    """``(x, weight, bias, weight_out_dim)`` of a linear op with a parameter weight, else None.

    ``weight_out_dim`` is the dim of the weight parameter that indexes output features
    (0 for ``linear``'s ``[out, in]``, 1 for ``matmul(x, W[in, out])`` and ``addmm(b, x, W[in, out])``)."""
    name = op_name(node)
    if name == "linear":
        x, w, b = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
        return (x, w, b, 0) if is_param(w) and _val(w).dim() == 2 else None
    if name == "matmul" and len(node.args) == 2 and is_param(node.args[1]) and _val(node.args[1]).dim() == 2:
        return node.args[0], node.args[1], None, 1
    if (name == "addmm" and len(node.args) == 3 and not node.kwargs and is_param(node.args[2])
            and _val(node.args[2]).dim() == 2):
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
    pad = _arg(node, 2, "padding_idx")
    if not is_param(w) or (pad is not None and pad != -1):
        return None
    return ids, w


# ---------------------------------------------------------------------------------------------
# the propagation


class LayerAnalyzer:
    """Propagate sharding states through one layer; see the module docstring."""

    def __init__(self, gm: torch.fx.GraphModule, layer: int, tp: int, sp: bool, demoted: set[str],
                 input_layout):
        self.gm, self.layer, self.tp, self.sp, self.demoted = gm, layer, tp, sp, demoted
        info = graph_info(gm)
        self.record = info.layers[layer]
        self.kind = self.record.kind
        self.input_layout = input_layout   # (node, layer) -> Sharded | None for boundary inputs
        self.res = LayerTP(layer, self.record.name, tp, sp)
        self.state: dict[torch.fx.Node, object] = {}

    # --- helpers
    def in_layer(self, n: torch.fx.Node) -> bool:
        return n.meta[META_KEY].layer == self.layer and n.op not in ("placeholder", "get_attr")

    def st(self, n):
        if not isinstance(n, torch.fx.Node):
            return None
        if n in self.state:
            return self.state[n]
        if n.op in ("placeholder", "get_attr") or not self.in_layer(n):
            return self.input_layout(n, self.layer)
        return None

    def conv(self, node, inp, op):
        key = (node.name, inp.name)
        if isinstance(inp, torch.fx.Node) and key not in self.res.conversions:
            self.res.conversions[key] = op

    def fail(self, node, states):
        """``node`` cannot run on these shards: gather sequence shards, demote tp origins."""
        tp_origins = set()
        flat = [x for s in states for x in (s if isinstance(s, (tuple, list)) else (s,))]
        for s in flat:
            if isinstance(s, Sharded) and s.kind == TP:
                tp_origins |= set(s.origins)
        if tp_origins:
            raise _Demote(tp_origins)
        raise _Unsupported

    def run(self) -> LayerTP:
        order = [n for n in self.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")
                 and n.meta[META_KEY].layer == self.layer]
        for node in order:
            self.visit(node)
        # what leaves the layer must be replicated or sequence-sharded along dim 1
        for node in order:
            external = [u for u in node.users if u.op == "output" or u.meta[META_KEY].layer != self.layer]
            if not external:
                continue
            s = self.state.get(node)
            if _is_sharded(s) and not isinstance(s, Sharded):   # a tuple (split) leaving the layer
                origins = {o for x in s if isinstance(x, Sharded) for o in x.origins}
                if origins:
                    raise _Demote(origins)
                s = None
            if isinstance(s, Sharded) and s.kind == TP:
                raise _Demote(s.origins)
            self.res.outputs[node.name] = s   # replicated or sequence-sharded; the pass converts
        self.res.states = {n.name: s for n, s in self.state.items()}
        return self.res

    def visit(self, node):
        ins = _tensor_inputs(node)
        states = [self.st(i) for i in ins]
        if node in self.state:
            return
        sources = linear_operands(node) is not None or embedding_operands(node) is not None
        if not any(_is_sharded(s) for s in states) and not sources:
            self.state[node] = None
            return
        try:
            self.state[node] = self.rule(node, ins, states)
        except _Unsupported:
            for key in [k for k in self.res.conversions if k[0] == node.name]:
                del self.res.conversions[key]
            if any(isinstance(s, Sharded) and s.kind == TP for s in states):
                if op_name(node) in LOSSES:      # vocab-parallel logits: all-gather before the loss
                    for i, s in zip(ins, states):
                        if isinstance(s, Sharded):
                            self.conv(node, i, ("gather", s.dim))
                    self.state[node] = None
                    return
                self.fail(node, states)
            for i, s in zip(ins, states):   # sequence shards: gather them, run replicated
                if isinstance(s, Sharded):
                    self.conv(node, i, ("gather", s.dim))
            self.state[node] = None
            if sources:
                self.res.replicated_linears.append(node.name)

    # --- rules
    def rule(self, node, ins, states):
        name = op_name(node)
        lin = linear_operands(node)
        if lin is not None:
            return self.rule_linear(node, lin)
        emb = embedding_operands(node)
        if emb is not None:
            return self.rule_embedding(node, *emb)
        if name == "getitem" and isinstance(node.args[0], torch.fx.Node) and _val(node.args[0]) is None:
            parts = self.st(node.args[0])
            return parts[node.args[1]] if isinstance(parts, (tuple, list)) else None
        if _val(node) is None and name not in ("split", "chunk", "unbind", "split_with_sizes"):
            if name in ("assert_tensor_metadata", "getattr", "size", "dim"):
                return None
            raise _Unsupported
        if name in POINTWISE:
            return self.rule_pointwise(node, ins, states)
        if name in VIEWS or name == "expand":
            return self.rule_view(node, ins[0], states[0])
        if name in ("transpose", "t", "permute", "unsqueeze", "squeeze", "select", "movedim"):
            return self.rule_dims(node, name, states[0])
        if name == "getitem":
            return self.rule_index(node, states[0])
        if name in ("split", "chunk", "split_with_sizes", "unbind"):
            return self.rule_split(node, name, states[0])
        if name == "repeat_interleave":
            s, d = states[0], _arg(node, 2, "dim")
            if d is None or len(ins) > 1 or (d % _val(node.args[0]).dim() == s.dim and s.kind != TP):
                raise _Unsupported
            return s  # GQA: repeating local kv heads gives exactly the local query heads' kv
        if name in ("slice", "narrow"):
            s, d = states[0], _arg(node, 1, "dim", 0) % _val(node.args[0]).dim()
            if len(ins) > 1 or d == s.dim:
                raise _Unsupported
            return s
        if name == "sdpa":
            return self.rule_sdpa(node, ins, states)
        if name in ("layer_norm", "rms_norm", "group_norm"):
            return self.rule_norm(node, ins, states)
        if name in REDUCTIONS or name in DIMWISE:
            return self.rule_reduce(node, name, ins, states)
        if name == "cat":
            return self.rule_cat(node, ins, states)
        if name in ("matmul", "bmm"):
            return self.rule_matmul(node, ins, states)
        raise _Unsupported

    def rule_pointwise(self, node, ins, states):
        out = _shape(node)
        nd = len(out)
        sh = [(i, s) for i, s in zip(ins, states) if isinstance(s, Sharded)]
        dims = {s.dim + nd - _val(i).dim() for i, s in sh}
        kinds = {s.kind for _, s in sh}
        if len(dims) != 1 or len(kinds) != 1:
            raise _Unsupported
        d = dims.pop()
        for i, s in sh:
            if _shape(i)[s.dim] != out[d]:
                raise _Unsupported
        for i, s in zip(ins, states):
            if isinstance(s, Sharded) or _val(i) is None:
                continue
            di = d - (nd - _val(i).dim())
            if di < 0 or _shape(i)[di] == 1:
                self.conv(node, i, ("copy",))
            else:
                self.conv(node, i, ("scatter", di))
        return Sharded(d, kinds.pop(), frozenset().union(*(s.origins for _, s in sh)))

    def rule_linear(self, node, lin):
        x, w, b, wout = lin
        s = self.st(x)
        out_w = _shape(w)[wout]
        fqn = w.meta[META_KEY].param.fqn
        xd = _val(x).dim()
        if s is None or (s.kind == SEQ and s.dim != xd - 1):
            if node.name not in self.demoted and self._column_ok(node, out_w):
                self.conv(node, x, ("copy",) if s is None else ("all_gather_seq", s.dim))
                self.res.column.append(node.name)
                self.res.param_shards[w.name] = ParamShard(fqn, wout, self.tp, (out_w,))
                if b is not None:
                    self.res.param_shards[b.name] = ParamShard(b.meta[META_KEY].param.fqn, 0, self.tp, (out_w,))
                return Sharded(_val(node).dim() - 1, TP, frozenset({node.name}))
            self.res.replicated_linears.append(node.name)
            if s is None:
                return None
            for p in (w, b):
                if p is not None:
                    self.conv(node, p, ("copy",))
            return s
        if s.kind == TP and s.dim == xd - 1:      # row parallel
            self.res.row.append(node.name)
            in_w = _shape(w)[1 - wout]
            self.res.param_shards[w.name] = ParamShard(fqn, 1 - wout, self.tp, (in_w,))
            return self._reduce(node)
        if s.kind == TP:                           # weight applied per shard of another dim
            for p in (w, b):
                if p is not None:
                    self.conv(node, p, ("copy",))
            return s
        raise _Unsupported

    def _column_ok(self, node, out_w) -> bool:
        if out_w % self.tp == 0:
            return True
        if self.kind == "block" and _feeds_activation(node):
            raise ConfigError(f"layer {self.record.name}: ffn width {out_w} (output of {node.name}) is not "
                              f"divisible by tp={self.tp}; use tp in {_divisors(out_w)}")
        return False

    def _reduce(self, node):
        v = _val(node)
        if self.sp and v.dim() == 3 and v.shape[1] % self.tp == 0:
            self.res.reduce_after[node.name] = ("reduce_scatter", 1)
            return Sharded(1, SEQ)
        self.res.reduce_after[node.name] = ("all_reduce",)
        return None

    def rule_embedding(self, node, ids, w):
        rows = _shape(w)[0]
        if self.st(ids) is not None or rows % self.tp or node.name in self.demoted:
            self.res.replicated_linears.append(node.name)
            if self.st(ids) is not None:
                raise _Unsupported
            return None
        self.res.vocab_embeddings.append(node.name)
        self.res.param_shards[w.name] = ParamShard(w.meta[META_KEY].param.fqn, 0, self.tp, (rows,))
        return self._reduce(node)

    def rule_view(self, node, x, s):
        in_shape, out_shape = _shape(x), _shape(node)
        name = op_name(node)
        if name == "expand":
            d = s.dim + len(out_shape) - len(in_shape)
        else:
            d = _view_dim(in_shape, out_shape, s.dim, self.tp)
        if d is None:
            if s.kind == TP and self.kind == "block" and name in ("view", "reshape", "unflatten"):
                self._check_heads(node, x, s, in_shape, out_shape)
            raise _Unsupported
        if name in ("view", "reshape", "unflatten", "expand"):
            slot = _size_slot(node, name, d, len(out_shape))
            if slot is not None:
                old = _size_args(node, name)[slot]
                if isinstance(old, int) and old == out_shape[d]:
                    self.res.shape_args[node.name] = (slot, old, old // self.tp)
                elif not (isinstance(old, int) and old == -1):
                    raise _Unsupported
        elif name in ("view_as", "reshape_as"):
            raise _Unsupported
        return Sharded(d, s.kind, s.origins)

    def _check_heads(self, node, x, s, in_shape, out_shape):
        if len(out_shape) > len(in_shape) and s.dim == len(in_shape) - 1:
            heads = out_shape[s.dim]
            role = _sdpa_role(node)
            what = "key/value heads" if role in (1, 2) else "attention heads"
            raise ConfigError(f"layer {self.record.name}: {heads} {what} are not divisible by tp={self.tp}; "
                              f"use tp in {_divisors(heads)}")

    def rule_dims(self, node, name, s):
        nd_in = _val(node.args[0]).dim()
        d = s.dim
        if name in ("transpose", "movedim"):
            a, b = (x % nd_in for x in (node.args[1], node.args[2]))
            if name == "movedim":
                perm = [i for i in range(nd_in) if i != a]
                perm.insert(b, a)
                return Sharded(perm.index(d), s.kind, s.origins)
            return Sharded(b if d == a else a if d == b else d, s.kind, s.origins)
        if name == "t":
            return Sharded(1 - d if nd_in == 2 else d, s.kind, s.origins)
        if name == "permute":
            perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
            return Sharded([p % nd_in for p in perm].index(d), s.kind, s.origins)
        if name == "unsqueeze":
            u = node.args[1] % (nd_in + 1)
            return Sharded(d + 1 if u <= d else d, s.kind, s.origins)
        if name == "select":
            k = node.args[1] % nd_in
            if k == d:
                raise _Unsupported
            return Sharded(d - 1 if k < d else d, s.kind, s.origins)
        if name == "squeeze":
            in_shape, out_shape = _shape(node.args[0]), _shape(node)
            return Sharded(d - sum(1 for i in range(d) if in_shape[i] == 1 and len(out_shape) < len(in_shape)
                                   and _squeezed(node, i, nd_in)), s.kind, s.origins)
        raise _Unsupported

    def rule_index(self, node, s):
        idx = node.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        nd_in = _val(node.args[0]).dim()
        if any(isinstance(i, torch.fx.Node) for i in idx):
            raise _Unsupported
        if Ellipsis in idx:
            k = idx.index(Ellipsis)
            fill = nd_in - sum(1 for i in idx if i is not None and i is not Ellipsis)
            idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
        in_dim, out_dim = 0, 0
        for i in idx:
            if i is None:
                out_dim += 1
                continue
            if in_dim == s.dim:
                if isinstance(i, slice) and i == slice(None):
                    return Sharded(out_dim, s.kind, s.origins)
                raise _Unsupported
            if isinstance(i, slice):
                out_dim += 1
            in_dim += 1
        return Sharded(out_dim + (s.dim - in_dim), s.kind, s.origins)

    def rule_split(self, node, name, s):
        nd = _val(node.args[0]).dim()
        parts = node.meta.get("val")
        dim = _arg(node, 2 if name != "unbind" else 1, "dim", 0) % nd
        if name == "unbind":
            if dim == s.dim:
                raise _Unsupported
            return tuple(Sharded(s.dim - (1 if dim < s.dim else 0), s.kind, s.origins) for _ in parts)
        out = tuple(Sharded(s.dim, s.kind, s.origins) for _ in parts)
        if dim != s.dim:
            return out
        sizes = tuple(int(p.shape[dim]) for p in parts)
        if s.kind != TP or len(s.origins) != 1 or any(z % self.tp for z in sizes):
            raise _Unsupported
        origin = next(iter(s.origins))
        self._set_blocks(origin, sizes)
        if name in ("split", "split_with_sizes"):
            self.res.split_sizes[node.name] = (sizes, tuple(z // self.tp for z in sizes))
        return out

    def _set_blocks(self, origin, sizes):
        node = next(n for n in self.gm.graph.nodes if n.name == origin)
        _, w, b, _ = linear_operands(node)
        for p in (w, b):
            if p is not None:
                old = self.res.param_shards[p.name]
                if old.blocks not in ((sum(sizes),), sizes):
                    raise _Demote({origin})
                self.res.param_shards[p.name] = ParamShard(old.fqn, old.dim, old.tp, sizes)

    def rule_sdpa(self, node, ins, states):
        q, k, v = node.args[:3]
        sq, sk, sv = self.st(q), self.st(k), self.st(v)
        nd = _val(q).dim()
        ok = all(isinstance(x, Sharded) and x.kind == TP and x.dim == nd - 3 for x in (sq, sk, sv))
        if not ok:
            raise _Unsupported
        mask = _arg(node, 3, "attn_mask")
        if isinstance(mask, torch.fx.Node):
            ms = self.st(mask)
            if ms is not None:
                raise _Unsupported
            dm = nd - 3 - (nd - _val(mask).dim())
            self.conv(node, mask, ("copy",) if dm < 0 or _shape(mask)[dm] == 1 else ("scatter", dm))
        return Sharded(nd - 3, TP, sq.origins | sk.origins | sv.origins)

    def rule_norm(self, node, ins, states):
        x = node.args[0]
        s = self.st(x)
        nd = _val(x).dim()
        name = op_name(node)
        ns = _arg(node, 1, "normalized_shape")
        k = len(ns) if isinstance(ns, (list, tuple)) else 1
        if name == "group_norm" or not isinstance(s, Sharded) or s.dim >= nd - k:
            raise _Unsupported
        if any(i is not x and self.st(i) is not None for i in ins):
            raise _Unsupported
        for i in ins:
            if i is not x:
                self.conv(node, i, ("copy",))
        return s

    def rule_reduce(self, node, name, ins, states):
        x = node.args[0]
        s = self.st(x)
        if len(ins) != 1 or not isinstance(s, Sharded):
            raise _Unsupported
        nd = _val(x).dim()
        dims = _arg(node, 1, "dim")
        if dims is None:
            raise _Unsupported
        dims = [d % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        if s.dim in dims:
            raise _Unsupported
        keep = name in DIMWISE or bool(_arg(node, 2, "keepdim", False))
        return Sharded(s.dim - (0 if keep else sum(1 for d in dims if d < s.dim)), s.kind, s.origins)

    def rule_cat(self, node, ins, states):
        dim = _arg(node, 1, "dim", 0) % _val(node).dim()
        sh = [s for s in states if isinstance(s, Sharded)]
        if len({(s.dim, s.kind) for s in sh}) != 1 or sh[0].dim == dim or len(sh) != len(states):
            raise _Unsupported
        return Sharded(sh[0].dim, sh[0].kind, frozenset().union(*(s.origins for s in sh)))

    def rule_matmul(self, node, ins, states):
        if len(ins) != 2 or not all(isinstance(s, Sharded) and s.kind == TP for s in states):
            raise _Unsupported
        a, b = ins
        na, nb, no = _val(a).dim(), _val(b).dim(), _val(node).dim()
        da, db = states[0].dim + no - na, states[1].dim + no - nb
        if da != db or da >= no - 2:
            raise _Unsupported
        return Sharded(da, TP, states[0].origins | states[1].origins)


# ---------------------------------------------------------------------------------------------
# shape helpers


def _view_dim(in_shape, out_shape, d, tp):
    """Output dim that carries contiguous chunking of input dim ``d`` through a reshape, or None."""
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
        if d in gi:
            if any(in_shape[k] != 1 for k in gi if k < d):
                return None
            for k in gj:
                if k < len(out_shape) and out_shape[k] != 1:
                    return k if out_shape[k] % tp == 0 else None
            return None
    return None


def _size_args(node, name):
    if name == "unflatten":
        return list(_arg(node, 2, "sizes"))
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    if not rest:
        return list(node.kwargs.get("size") or node.kwargs.get("shape") or [])
    return list(rest)


def _size_slot(node, name, d, nd_out):
    if name == "unflatten":
        start = _arg(node, 1, "dim") % (nd_out - len(_size_args(node, name)) + 1)
        k = d - start
        return k if 0 <= k < len(_size_args(node, name)) else None
    if name == "flatten":
        return None
    return d if len(_size_args(node, name)) == nd_out else None


def _squeezed(node, i, nd_in):
    dims = _arg(node, 1, "dim")
    if dims is None:
        return True
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return i in [x % nd_in for x in dims]


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(k) for k in range(1, n + 1) if n % k == 0) + "}"


def _feeds_activation(node, depth: int = 3) -> bool:
    frontier = [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users]
        if any(op_name(u) in ACTIVATIONS for u in frontier):
            return True
    return False


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


def boundary_layout(gm, node: torch.fx.Node, layer: int | None, layer_tp) -> Sharded | None:
    """Layout in which ``layer`` receives ``node``, a value made outside it: sequence-sharded along
    dim 1 when the layer has sp and the value is a 3-D floating tensor ([batch, seq, hidden]), else
    replicated. Parameters and constants are always replicated."""
    if node.op == "get_attr" or layer is None:
        return None
    tp, sp = layer_tp.get(layer, (1, False))
    v = _val(node)
    if sp and int(tp) > 1 and v is not None and v.dim() == 3 and v.is_floating_point():
        if v.shape[1] % int(tp):
            name = graph_info(gm).layers[layer].name
            raise ConfigError(f"layer {name}: sequence length {v.shape[1]} is not divisible by tp={tp} "
                              f"(sequence parallelism); use tp in {_divisors(int(v.shape[1]))}")
        return Sharded(1, SEQ)
    return None


def analyze(gm: torch.fx.GraphModule, layer_tp: dict[int, tuple[int, bool]]) -> dict[int, LayerTP]:
    """Analyse every layer of ``layer_tp`` (layer index -> (tp, sp)); see the module docstring.

    Raises ConfigError when a block's heads / key-value heads / ffn width do not divide by its tp or
    sequence parallelism meets a sequence length not divisible by tp."""
    info = graph_info(gm)
    if info is None or not info.layers:
        raise ConfigError("apply_tensor_parallel needs a captured, layer-grouped GraphModule (gfx.capture)")
    for idx, (tp, _sp) in layer_tp.items():
        if not 0 <= idx < len(info.layers):
            raise ConfigError(f"layer index {idx} out of range (the graph has {len(info.layers)} layers)")
        if int(tp) < 1:
            raise ConfigError(f"layer {info.layers[idx].name}: tp must be >= 1, got {tp}")

    def expected_layout(node, layer):
        return boundary_layout(gm, node, layer, layer_tp)

    demoted: set[str] = set()
    for _ in range(len(gm.graph.nodes) + 1):
        try:
            out = {}
            for idx in sorted(layer_tp):
                tp, sp = int(layer_tp[idx][0]), bool(layer_tp[idx][1])
                if tp > 1:
                    out[idx] = LayerAnalyzer(gm, idx, tp, sp, demoted, expected_layout).run()
            _check_param_consistency(gm, out)
            break
        except _Demote as d:
            if d.origins <= demoted:
                raise RuntimeError(f"internal: tensor-parallel analysis did not converge at {sorted(d.origins)}") from None
            demoted |= d.origins
    for res in out.values():
        _summarise(gm, res)
    return out


def _check_param_consistency(gm, results: dict[int, LayerTP]) -> None:
    """A parameter used in several places (tied weights) is sharded only if every use agrees."""
    wants: dict[str, set] = {}
    users_of: dict[str, set] = {}
    for res in results.values():
        for name, shard in res.param_shards.items():
            wants.setdefault(name, set()).add((shard.dim, shard.tp, shard.blocks))
    for node in gm.graph.nodes:
        if not is_param(node) or node.name not in wants:
            continue
        for u in node.users:
            users_of.setdefault(node.name, set()).add(u.name)
        for u in node.users:
            res = results.get(u.meta[META_KEY].layer)
            shard_users = set(res.column + res.row + res.vocab_embeddings) if res else set()
            if u.name not in shard_users:
                wants[node.name].add(None)
    for name, specs in wants.items():
        if len(specs) > 1:
            raise _Demote(users_of[name])


def _summarise(gm, res: LayerTP) -> None:
    record = graph_info(gm).layers[res.layer]
    sharded = {s.fqn for s in res.param_shards.values()}
    res.sharded_params = sorted(sharded)
    names = set(record.params)
    for n in gm.graph.nodes:
        if is_param(n) and any(u.meta[META_KEY].layer == res.layer for u in n.users):
            names.add(n.meta[META_KEY].param.fqn)
    res.replicated_params = sorted(names - sharded)
    res.replicated_linears = list(dict.fromkeys(res.replicated_linears))
