"""Sequence-sharding analysis of one context-parallel layer: which values hold only this rank's
part of the sequence, and what must change so that the layer computes exactly its part.

Convention (the context-parallel pass and the runtime share it): a layer with ``cp > 1`` receives
every *sequence activation* (:func:`is_sequence_activation`: a floating tensor of 3 or more dims
whose dim 1 is the captured sequence ``S``: hidden states, rotary ``cos`` / ``sin``) as this rank's
``S / cp`` positions (:func:`galvatron_fx.runtime.context_parallel.seq_positions`) and hands such
values on in the same form; every other value (token ids, labels, masks, positions) is whole.

The analysis walks the layer in graph order with one state per node:

* :class:`SeqShard` ``(dim, post, chunks)``: dim ``dim`` holds this rank's positions; its full size
  is ``pre * S * post`` (``pre``: the dims merged before the sequence, e.g. the batch of a
  ``[B * S, V]`` view, read at run time; ``post``: those merged after it); ``chunks > 1`` inside
  a sequence-parallel region: this TP rank's contiguous ``1 / chunks`` of the CP shard (the
  tensor-parallel ops between regions change ``chunks``, never the CP positions);
* ``None``: whole, computed alike on every rank of the CP group from whole inputs;
* :data:`GATHERED`: whole, computed from gathered shards: usable only where it meets a shard (it is
  sliced there), since each rank's gradient for it is partial.

Where a whole operand meets a shard it is sliced (``slices``: no communication; its gradient is
partial, summed by the data-parallel reduction the CP ranks take part in); a shard reaching an op
that needs the whole sequence is all-gathered (``gathers``; backward reduce-scatters);
scaled-dot-product attention becomes a context-parallel attention (``attention``); shape
arguments written for ``S`` (or ``S / tp`` in a sequence-parallel region) are divided by ``cp``
(``shape_args``). With sequence parallelism on the layer (the tensor-parallel pass ran first:
meta shapes are TP-local), a whole value entering a sequence-parallel region (the TP scatter /
reduce-scatter along its sequence) is sliced to this rank's CP positions first, so the region's
chunks are chunks of the CP shard; a whole value meeting such chunks, or chunks an op needs whole,
is refused. A cross entropy over sharded
logits gives this rank's partial loss (the token-loss scale makes the sum over ranks exact). What
cannot be proven exact raises :class:`Unsupported` with the reason.

Size: one file, over 500 lines: ``SequenceAnalyzer`` walks a layer's ops once, tracking each
value's sequence sharding; its op handlers share that state.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from .losses import bind_cross_entropy
from .pointwise import ACTIVATIONS, POINTWISE
from .reductions import REDUCTIONS
from .state import is_param, node_arg, op_name, tensor_val
from .views import _size_args, _size_slot

GATHERED = "gathered"

_POINTWISE = POINTWISE | ACTIVATIONS | {
    "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "logical_not", "bitwise_and",
    "bitwise_or", "bitwise_not", "zeros_like", "ones_like", "full_like", "empty_like", "bool", "long", "int",
    "lift_fresh_copy", "expm1", "log1p", "maximum", "minimum", "clamp_min", "clamp_max", "gelu_tanh", "fill",
}
_VIEWS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze"}
_SIZES = {"size", "sym_size", "sym_numel", "dim", "numel"}
_FACTORIES = {"arange", "zeros", "ones", "full", "empty", "new_zeros", "new_ones", "new_full", "new_empty",
              "randn", "rand", "tril", "triu"}
_INT_ARITH = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg}


class Unsupported(Exception):
    """This layer cannot run on sequence shards exactly; the message says why."""


@dataclass(frozen=True)
class SeqShard:
    """Dim ``dim`` holds this rank's sequence positions (full size ``pre * S * post``)."""

    dim: int
    post: int = 1
    chunks: int = 1

    def at(self, dim: int) -> SeqShard:
        return SeqShard(dim, self.post, self.chunks)


@dataclass
class LayerSequence:
    """What the context-parallel pass must do to one layer (see the module docstring). Node keys."""

    seq: int
    states: dict = field(default_factory=dict)
    slices: dict = field(default_factory=dict)     # (user, operand) -> (dim, post): slice a whole operand
    gathers: dict = field(default_factory=dict)    # (user, operand) -> (dim, post): gather a shard
    shape_args: list = field(default_factory=list)  # (node, path, new int)
    attention: list = field(default_factory=list)   # sdpa nodes on shards
    out_slices: list = field(default_factory=list)  # whole sequence activations leaving: slice them
    out_gathers: list = field(default_factory=list)  # (node, dim) shards leaving whole
    why_gathered: dict = field(default_factory=dict)  # node name -> why its shards were gathered


def sequence_length(gm: torch.fx.GraphModule) -> int | None:
    """The captured sequence: dim 1 of the first graph input with two or more dims."""
    for n in gm.graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            return int(v.shape[1])
    return None


def is_sequence_activation(val, seq: int | None) -> bool:
    """Whether a layer-boundary value travels in sequence shards under cp > 1 (module docstring)."""
    return (seq is not None and seq > 1 and isinstance(val, torch.Tensor) and val.is_floating_point()
            and val.dim() >= 3 and int(val.shape[1]) == seq)


def _shape(n) -> tuple[int, ...]:
    return tuple(int(s) for s in tensor_val(n).shape)


def _full(s) -> bool:
    return s is None or s == GATHERED


class SequenceAnalyzer:
    """Propagate :class:`SeqShard` states through one layer graph (the module docstring)."""

    def __init__(self, layer: torch.fx.GraphModule, seq: int, cp: int, name: str = "layer", sp_tp: int = 1):
        self.gm, self.cp, self.name, self.sp_tp = layer, cp, name, sp_tp
        self.res = LayerSequence(seq)
        self.local_sizes: set = set()     # int nodes holding a local (per-shard) sequence length

    # --- driver
    def run(self) -> LayerSequence:
        st = self.res.states
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                st[n] = self._input(n.meta.get("val"))
            elif n.op == "get_attr":
                st[n] = None
            elif n.op == "output":
                self._outputs(n)
            else:
                st[n] = self.visit(n)
        return self.res

    def _input(self, val):
        """A layer input's state: a sequence activation arrives in shards, in sequence-parallel
        chunks of them when the layer has sp (the TP boundary convention: 3-D floating values)."""
        if is_sequence_activation(val, self.res.seq):
            return SeqShard(1)
        t, seq = self.sp_tp, self.res.seq
        c = -(-seq // t)     # TP chunks of ceil(S / tp) positions, the last ones shorter (tp_ops.chunk_bounds)
        if (t > 1 and isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() == 3
                and int(val.shape[1]) in {min(c, max(seq - r * c, 0)) for r in range(t)} and val.shape[1] < seq):
            return SeqShard(1, chunks=t)
        return None

    def _outputs(self, out: torch.fx.Node) -> None:
        for v in dict.fromkeys(out.all_input_nodes):
            s, val = self.res.states.get(v), v.meta.get("val")
            seq_act = is_sequence_activation(val, self.res.seq)
            if s is None and self._input(val) is not None and not seq_act:
                raise Unsupported(f"{v.name} leaves the layer as sequence-parallel chunks of the whole sequence")
            if isinstance(s, SeqShard):
                if not (s.dim == 1 and s.post == 1 and (seq_act or s.chunks > 1)):
                    if s.post != 1:
                        raise Unsupported(f"{v.name} leaves the layer with its sequence merged into dim {s.dim}")
                    self.res.out_gathers.append((v, s.dim))
            elif seq_act:
                self.res.out_slices.append(v)
            elif s == GATHERED and isinstance(val, torch.Tensor):
                raise Unsupported(f"{v.name} leaves the layer computed from the whole sequence "
                                  f"({self._gather_reason()}): each rank would count it again")

    def _gather_reason(self) -> str:
        return "; ".join(f"{k}: {w}" for k, w in list(self.res.why_gathered.items())[:2]) or "gathered"

    def st(self, n):
        return self.res.states.get(n) if isinstance(n, torch.fx.Node) else None

    # --- one node
    def visit(self, n: torch.fx.Node):
        name = op_name(n)
        if n.op == "call_function" and n.target in _INT_ARITH and tensor_val(n) is None:
            if any(a in self.local_sizes for a in n.all_input_nodes):
                self.local_sizes.add(n)
            return None
        ins = [a for a in n.all_input_nodes if a.op != "get_attr" or not is_param(a)]
        shards = [a for a in ins if isinstance(self.st(a), SeqShard) or _split_state(self.st(a))]
        if name in _SIZES or (name == "getattr" and n.args[1:] == ("shape",)):
            return self._size(n, name)
        if name == "getattr":       # .dtype, .device, ...: no data
            return None
        if name == "getitem" and isinstance(n.args[0], torch.fx.Node) and n.args[0] in self.local_sizes:
            self._local_shape_item(n)
            return None
        if name in _FACTORIES and any(a in self.local_sizes for a in n.all_input_nodes):
            raise Unsupported(f"{n.name} ({name}) is built from the local sequence length: positions or masks "
                              "computed inside this layer would be those of the first shard")
        if not shards and _is_tp_op(n) and self._enters_sp(n):
            return self._sp_entry(n)
        if not shards:
            return GATHERED if any(self.st(a) == GATHERED for a in ins) else None
        try:
            return self._rule(n, name, shards)
        except _Fallback as why:
            return self._gather_all(n, shards, str(why))

    def _rule(self, n, name, shards):
        if name == "sdpa":
            return self._attention(n)
        if name in ("cross_entropy", "cross_entropy_loss", "vocab_parallel_cross_entropy"):
            return self._loss(n)
        if name in _VIEWS or name == "expand":
            return self._view(n, name)
        if name in ("transpose", "swapaxes", "permute", "t"):
            return self._permute(n, name)
        if name in ("linear", "addmm", "matmul", "bmm", "mm"):
            return self._matmul(n, name)
        if name == "embedding":
            ids = next(a for a in n.args[:2] if isinstance(a, torch.fx.Node) and not tensor_val(a).is_floating_point())
            s = self.st(ids)
            if not isinstance(s, SeqShard):
                raise _Fallback("embedding of a sharded table")
            return s
        if name in REDUCTIONS or name in ("softmax", "log_softmax", "cumsum"):
            return self._reduce(n, name)
        if name in ("layer_norm", "rms_norm"):
            return self._norm(n)
        if name in ("getitem", "slice", "select", "narrow"):
            return self._select(n, name)
        if name in ("split", "chunk", "split_with_sizes", "unbind"):
            return self._split(n, name)
        if name in ("cat", "stack"):
            return self._cat(n, name)
        if _is_tp_op(n):
            return self._tp_op(n)
        if name in _POINTWISE or name == "vocab_shard_output":
            return self._pointwise(n)
        raise _Fallback(f"{name} has no sequence-sharding rule")

    # --- rules
    def _size(self, n, name):
        x = n.args[0]
        s = self.st(x)
        if isinstance(s, SeqShard):
            if name in ("size", "sym_size") and len(n.args) > 1:
                if n.args[1] % tensor_val(x).dim() == s.dim:
                    self.local_sizes.add(n)
            elif name in ("size", "getattr"):
                self.local_sizes.add(n)      # the whole shape: items picked later (_local_shape_item)
                return ("shape", s.dim)
            elif name in ("numel", "sym_numel"):
                self.local_sizes.add(n)
        return None

    def _local_shape_item(self, n):
        src = n.args[0]
        shape = self.res.states.get(src)
        if isinstance(shape, tuple) and shape[0] == "shape":
            idx = n.args[1]
            if isinstance(idx, int) and idx % tensor_val(src.args[0]).dim() != shape[1]:
                return
        self.local_sizes.add(n)

    def _enters_sp(self, n) -> bool:
        """A TP scatter / reduce-scatter of a whole value along a sequence dim (into an SP region)."""
        x = n.args[0]
        return (op_name(n) in ("tp_scatter_to_region", "tp_reduce_scatter_sequence") and isinstance(x, torch.fx.Node)
                and self.st(x) is None and _shape(x)[n.args[1] % tensor_val(x).dim()] == self.res.seq)

    def _sp_entry(self, n):
        """Slice the whole value to this rank's CP positions before the TP op chunks it."""
        x, dim = n.args[0], n.args[1] % tensor_val(n.args[0]).dim()
        self._slice_whole(n, x, dim, 1)
        return SeqShard(dim, 1, _shape(x)[dim] // _shape(n)[dim])

    def _gather_all(self, n, shards, why: str):
        for a in shards:
            s = self.st(a)
            if isinstance(s, SeqShard) and s.chunks > 1:
                raise Unsupported(f"{n.name}: {why}, inside a sequence-parallel region (use sp=False with cp)")
            if not isinstance(s, SeqShard):
                raise Unsupported(f"{n.name}: {why}")
            self.res.gathers[(n, a)] = (s.dim, s.post)
        self.res.why_gathered[n.name] = why
        return GATHERED

    def _slice_whole(self, n, a, dim: int, post: int, chunks: int = 1) -> None:
        if chunks > 1:
            raise Unsupported(f"{n.name}: the whole value {a.name} meets sequence-parallel chunks (use sp=False "
                              "with cp)")
        self.res.slices[(n, a)] = (dim, post)

    def _pointwise(self, n):
        out = _shape(n)
        nd = len(out)
        state = None
        for a in n.all_input_nodes:
            s = self.st(a)
            if isinstance(s, SeqShard):
                here = s.at(s.dim + nd - tensor_val(a).dim())
                if state is not None and here != state:
                    raise _Fallback("operands sharded along different dims")
                state = here
        for a in n.all_input_nodes:
            s, val = self.st(a), tensor_val(a)
            if not _full(s) or val is None or (a.op == "get_attr" and is_param(a) and val.dim() < 2):
                continue
            ax = state.dim - (nd - val.dim())
            if ax < 0 or int(val.shape[ax]) == 1:
                continue
            if int(val.shape[ax]) != out[state.dim]:
                raise _Fallback(f"{a.name} broadcasts against the sequence dim")
            self._slice_whole(n, a, ax, state.post, state.chunks)
        return state

    def _tp_op(self, n):
        """A tensor-parallel collective: along the sequence dim it changes the sequence-parallel
        chunks (scatter / reduce-scatter: more, gathers: fewer), never the CP positions."""
        s = self._pointwise(n)
        x = n.args[0]
        if isinstance(s, SeqShard) and isinstance(x, torch.fx.Node) and self.st(x) == s:
            before, after = _shape(x)[s.dim], _shape(n)[s.dim]
            if before != after:
                # NOTE: a gather's whole length (its ``full`` argument) becomes this rank's shard's:
                # the TP chunks of S / cp may be uneven where those of S were not
                if after > before:
                    if after % self.cp:
                        raise Unsupported(f"{n.name}: its whole length {after} does not split into cp={self.cp}")
                    self.res.shape_args.append((n, (3,), after // self.cp))
                return SeqShard(s.dim, s.post, s.chunks * before // after)
        return s

    def _view(self, n, name):
        x = n.args[0]
        s = self.st(x)
        din, dout = _shape(x), _shape(n)
        if name == "expand":
            new = s.at(s.dim + len(dout) - len(din))
        else:
            new = _view_state(din, dout, s, self.res.seq // s.chunks)
            if new is None:
                raise _Fallback(f"{name} {list(din)} -> {list(dout)} splits the sequence dim")
        if name in ("view", "reshape", "unflatten", "expand"):
            self._local_size_arg(n, name, new.dim, dout)
        return new

    def _local_size_arg(self, n, name, d, dout):
        args = _size_args(n, name)
        slot = _size_slot(n, name, d, len(dout))
        if slot is None:
            return
        old = args[slot]
        if isinstance(old, int) and not isinstance(old, bool):
            if old == -1:
                return
            if old != dout[d] or old % self.cp:
                raise Unsupported(f"{n.name}: size {old} of its sequence dim does not split into cp={self.cp}")
            self.res.shape_args.append((n, _size_path(n, name, slot), old // self.cp))
        elif isinstance(old, torch.fx.Node) and old not in self.local_sizes:
            raise Unsupported(f"{n.name}: its sequence size comes from {old.name}, not from a sharded value")

    def _permute(self, n, name):
        s = self.st(n.args[0])
        nd = tensor_val(n.args[0]).dim()
        if name == "permute":
            dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else n.args[1:]
            return s.at([d % nd for d in dims].index(s.dim))
        a, b = (0, 1) if name == "t" else (n.args[1] % nd, n.args[2] % nd)
        return s.at(b if s.dim == a else a if s.dim == b else s.dim)

    def _matmul(self, n, name):
        if name in ("linear",):
            x = n.args[0]
            s = self.st(x)
            if not isinstance(s, SeqShard) or s.dim == tensor_val(x).dim() - 1:
                raise _Fallback("linear over the sequence dim")
            return s
        if name == "addmm":
            s = self.st(n.args[1])
            if not isinstance(s, SeqShard) or s.dim != 0 or isinstance(self.st(n.args[2]), SeqShard):
                raise _Fallback("addmm on shards")
            return s
        a, b = n.args[:2]
        sa, sb = self.st(a), self.st(b)
        nd = len(_shape(n))
        if isinstance(sb, SeqShard):     # keys / values of an eager attention: gathered (all-gather CP)
            self.res.gathers[(n, b)] = (sb.dim, sb.post)
            self.res.why_gathered.setdefault(n.name, "the keys / values of an eager attention")
        if isinstance(sa, SeqShard):
            da = tensor_val(a).dim()
            if sa.dim == da - 1:
                raise _Fallback("matmul over the sequence dim")
            if sa.dim < da - 2 and _full(sb):
                raise _Fallback("batched matmul sharded along a batch dim")
            return sa.at(sa.dim + nd - da)
        return GATHERED

    def _reduce(self, n, name):
        x = n.args[0]
        s = self.st(x)
        nd = tensor_val(x).dim()
        dims = node_arg(n, 1, "dim")
        if dims is None:
            raise _Fallback(f"{name} over every dim")
        dims = [d % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        if s.dim in dims:
            raise _Fallback(f"{name} over the sequence dim")
        if name in ("softmax", "log_softmax", "cumsum"):
            return s
        if name in ("max", "min") or isinstance(n.meta.get("val"), (tuple, list)):
            raise _Fallback(f"{name} with indices")
        keep = node_arg(n, 2, "keepdim", False)
        return s if keep else s.at(s.dim - sum(d < s.dim for d in dims))

    def _norm(self, n):
        x = n.args[0]
        s = self.st(x)
        shape = node_arg(n, 1, "normalized_shape")
        k = len(shape) if isinstance(shape, (list, tuple)) else 1
        if s.dim >= tensor_val(x).dim() - k:
            raise _Fallback("normalised over the sequence dim")
        return s

    def _select(self, n, name):
        x = n.args[0]
        s = self.st(x)
        if _split_state(s):
            return s[1]
        if not isinstance(s, SeqShard):
            raise _Fallback("selection from a sharded value")
        nd = tensor_val(x).dim()
        size = _shape(x)[s.dim]
        if name == "getitem":
            return self._index(n, s, nd, size)
        dim = node_arg(n, 1, "dim", 0) % nd
        if dim != s.dim:
            return s.at(s.dim - 1) if name == "select" and dim < s.dim else s
        if name == "slice":
            start, end = node_arg(n, 2, "start"), node_arg(n, 3, "end")
            if start in (None, 0) and (end is None or end >= size) and node_arg(n, 4, "step", 1) == 1:
                return s
        raise _Fallback(f"{name} along the sequence dim")

    def _index(self, n, s, nd, size):
        idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        if any(isinstance(i, torch.fx.Node) for i in idx):
            raise _Fallback("tensor indexing of a sharded value")
        if Ellipsis in idx:
            k = idx.index(Ellipsis)
            fill = nd - sum(1 for i in idx if i is not None and i is not Ellipsis)
            idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
        dim_in, dim_out = 0, 0
        for i in idx:
            if i is None:
                dim_out += 1
                continue
            if dim_in == s.dim:
                if not (isinstance(i, slice) and i.start in (None, 0) and (i.stop is None or i.stop >= size)
                        and i.step in (None, 1)):
                    raise _Fallback("indexing along the sequence dim")
                return s.at(dim_out)
            dim_out += 0 if isinstance(i, int) else 1
            dim_in += 1
        return s.at(dim_out + s.dim - dim_in)

    def _split(self, n, name):
        x = n.args[0]
        s = self.st(x)
        nd = tensor_val(x).dim()
        dim = node_arg(n, 2 if name != "unbind" else 1, "dim", 0) % nd
        if dim == s.dim:
            raise _Fallback(f"{name} along the sequence dim")
        return ("tuple", s.at(s.dim - 1) if name == "unbind" and dim < s.dim else s)

    def _cat(self, n, name):
        parts = n.args[0]
        nd = len(_shape(n))
        dim = node_arg(n, 1, "dim", 0) % nd
        state = None
        for p in parts:
            s = self.st(p)
            if isinstance(s, SeqShard):
                here = s.at(s.dim + (1 if name == "stack" and dim <= s.dim else 0))
                if state is not None and here != state:
                    raise _Fallback("cat of values sharded along different dims")
                state = here
        for p in parts:
            if _full(self.st(p)):
                if tensor_val(p).numel() == 0:
                    continue                  # an empty KV cache: nothing to join
                if name == "stack" or dim == state.dim:
                    raise _Fallback(f"{name} of shards and whole values")
                self._slice_whole(n, p, state.dim, state.post, state.chunks)
        if name == "cat" and dim == state.dim and any(_full(self.st(p)) and tensor_val(p).numel() for p in parts):
            raise _Fallback("cat along the sequence dim")
        return state

    def _attention(self, n):
        q, k, v = n.args[:3]
        nd = tensor_val(q).dim()
        for x in (q, k, v):
            s = self.st(x)
            if not isinstance(s, SeqShard) or s.dim != nd - 2 or s.post != 1 or s.chunks != 1:
                raise Unsupported(f"{n.name}: attention whose query, key and value are not all split along "
                                  "the sequence")
        mask = node_arg(n, 3, "attn_mask")
        if isinstance(mask, torch.fx.Node) and not _full(self.st(mask)):
            raise Unsupported(f"{n.name}: its mask is computed from sequence shards")
        if node_arg(n, 4, "dropout_p", 0.0):
            raise Unsupported(f"{n.name}: attention dropout cannot be reproduced on sequence shards; set the "
                              "attention dropout to 0 or use cp=1")
        self.res.attention.append(n)
        return SeqShard(nd - 2)

    def _loss(self, n):
        """A cross entropy (torch's, or the vocabulary-parallel one of the TP pass) over sharded rows."""
        ce = bind_cross_entropy(n)
        x, target = (ce.input, ce.target) if ce is not None else n.args[:2]
        reduction = ce.reduction if ce is not None else node_arg(n, 6, "reduction", "mean")
        s = self.st(x)
        if not isinstance(s, SeqShard) or s.dim != 0 or (ce is not None and ce.legacy):
            raise _Fallback("a loss over logits not sharded along their rows")
        if isinstance(target, torch.fx.Node):
            ts = self.st(target)
            if _full(ts):
                self._slice_whole(n, target, 0, s.post, s.chunks)
            elif ts != s:
                raise _Fallback("targets sharded unlike the logits")
        return s if reduction == "none" else None


class _Fallback(Exception):
    """No rule keeps ``node`` on shards: gather them (the message is the reason)."""


def _split_state(s) -> bool:
    """A tuple of shards (split / chunk / unbind output), as opposed to a whole shape ``("shape", dim)``."""
    return isinstance(s, tuple) and s[0] == "tuple"


def _is_tp_op(n) -> bool:
    return n.op == "call_function" and getattr(n.target, "__module__", "").endswith("runtime.tp_ops")


def _size_path(n, name, slot) -> tuple:
    if name == "unflatten":
        return (2, slot)
    rest = n.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return (1, slot)
    if not rest:
        return ("size" if "size" in n.kwargs else "shape", slot)
    return (1 + slot,)


def _view_state(din, dout, s: SeqShard, seq: int) -> SeqShard | None:
    """Where the sequence of dim ``s.dim`` of ``din`` lands in ``dout`` (a reshape of the same
    elements): the output dim ``k`` whose element stride divides the sequence's and whose extent
    covers it. None when the sequence is split across output dims."""
    stride = s.post * _prod(din[s.dim + 1:])       # elements between consecutive positions
    extent = seq * stride
    for k in range(len(dout)):
        r = _prod(dout[k + 1:])
        if r <= stride and stride % r == 0 and (dout[k] * r) % extent == 0:
            return SeqShard(k, stride // r, s.chunks)
    return None


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def analyze_layer(layer: torch.fx.GraphModule, seq: int, cp: int, name: str = "layer",
                  sp_tp: int = 1) -> LayerSequence:
    """The :class:`LayerSequence` of ``layer`` under ``cp`` (raises :class:`Unsupported`);
    ``sp_tp``: the layer's TP degree when it has sequence parallelism (its graph already TP-local)."""
    return SequenceAnalyzer(layer, seq, cp, name, sp_tp).run()
