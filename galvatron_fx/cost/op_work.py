"""The work of a layer's ops as a device executes them: matrix multiplies by shape, memory traffic.

FLOPs over one compute rate prices a 1x1 matmul like a 16k x 16k one and an element-wise pass over
a billion values as free. :class:`OpWork` (a ``TorchDispatchMode`` beside the FLOP counter of
:mod:`.measure`) records every ATen op a layer runs on fake tensors:

* **matmuls** (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``convolution`` as its implicit GEMM,
  ``_scaled_mm``: an fp8 matmul, priced at the fp8 rate): their dims ``(batch, m, n, k)`` (``m x k``
  times ``k x n``), per fx node in forward (so tensor parallelism can shrink the dim it splits) and
  as one list in backward;
* **everything else that computes** (element-wise ops, reductions, norms, casts, copies, indexing):
  the bytes it reads and writes (its tensor inputs' and outputs' bytes, a broadcast input counted
  at its storage's size; a gather (``embedding``, ``index_select``) reads the rows it writes), per
  fx node in forward and as one sum in backward. Views, ``detach``, metadata queries and
  allocations without a fill move nothing.

Dropout: on the CPU, ``aten::dropout`` runs as three passes (``bernoulli_`` into a noise tensor of
the input's dtype, ``div_`` by the keep probability, ``mul``), which is what the CPU executes. On
CUDA it is one fused kernel (``native_dropout``: reads the input, writes the output and a one-byte
mask; its backward reads the gradient and the mask). With ``fused_dropout`` the passes are counted
as that kernel: the noise tensor is a one-byte mask written once, its scaling is free, and a
multiply by it reads it at one byte per element.

SDPA calls are not here: :mod:`.attention_kernels` prices them as the device's fused kernel.
Beside the eager bytes, every op is noted in a :class:`.fusion.FusionTrace` (matmuls and SDPA as
the kernels that split fused regions), which prices the same ops as torch.compile fuses them.
:meth:`galvatron_fx.cluster.Cluster.gemm_time` and :meth:`~galvatron_fx.cluster.Cluster.memory_time`
turn the records into seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.checkpointing import SecondMatmuls
from .fusion import FusionTrace
from .storage_keys import StorageMap

if TYPE_CHECKING:
    from .extract import LayerGraph
    from .measure import Point

aten = torch.ops.aten

_GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
          aten.convolution.default, aten._scaled_mm.default}
_FREE = {aten.detach.default, aten.alias.default, aten.lift_fresh.default, aten.empty.memory_format,
         aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default,
         aten.new_empty_strided.default, aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int,
         aten._local_scalar_dense.default, aten._unsafe_view.default}


_GATHERS = {aten.embedding.default, aten.index_select.default, aten.index.Tensor, aten.gather.default}
"""Ops that read only the rows they gather from their (possibly huge) source."""


def _aliases(func) -> bool:
    """Whether ``func`` returns a view of an input (no memory moved)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _pure(func) -> bool:
    """Whether ``func``'s result depends on its arguments only: it writes none but an ``out=``
    buffer and draws no random numbers (what common-subexpression elimination may merge)."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return all(a.alias_info is None or not a.alias_info.is_write or a.name == "out"
               for a in func._schema.arguments)


def tensor_bytes(t: torch.Tensor) -> float:
    """Bytes an op reads or writes of ``t``: its elements, at most its storage (a broadcast view)."""
    try:
        storage = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        storage = float("inf")
    return min(t.numel() * t.element_size(), storage)


def gemm_dims(func, args) -> tuple[int, int, int, int] | None:
    """``(batch, m, n, k)`` of a matmul op's call (``m x k`` times ``k x n``), None for another op;
    a grouped GEMM is ``groups`` GEMMs of its rows over the groups each."""
    if func in (aten.mm.default, aten.addmm.default, aten._scaled_mm.default):
        a, b = (args[1], args[2]) if func is aten.addmm.default else (args[0], args[1])
        return 1, int(a.shape[0]), int(b.shape[1]), int(a.shape[1])
    if func in (aten.bmm.default, aten.baddbmm.default):
        a, b = (args[0], args[1]) if func is aten.bmm.default else (args[1], args[2])
        return int(a.shape[0]), int(a.shape[1]), int(b.shape[2]), int(a.shape[2])
    if "grouped_mm" in str(func):   # torch's grouped GEMM (or transformers' stand-in): one GEMM per expert
        x, w = args[0], args[1]
        groups = int(w.shape[0])
        k, n = (int(w.shape[1]), int(w.shape[2])) if int(w.shape[1]) == int(x.shape[-1]) else \
            (int(w.shape[2]), int(w.shape[1]))
        # NOTE: the rows split evenly over the groups (a router balanced on average)
        return groups, int(x.shape[0]) / groups, n, k
    if func is aten.convolution.default:
        x, w = args[0], args[1]
        groups = int(args[8]) if len(args) > 8 else 1
        return None if x.dim() < 3 else _conv_dims(x, w, groups)
    return None


def _conv_dims(x, w, groups: int) -> tuple[int, int, int, int]:
    # NOTE: implicit GEMM: one row per output position, one column per output channel, the kernel
    # window times the input channels of a group as the reduction
    out_channels, per_group = int(w.shape[0]), int(w.shape[1])
    window = 1
    for s in w.shape[2:]:
        window *= int(s)
    positions = int(x.shape[0])
    for s in x.shape[2:]:
        positions *= int(s)
    return groups, positions, out_channels // groups, per_group * window


@dataclass
class Work:
    """What one pass recorded: matmul dims and bytes moved, per fx node (forward) or under
    ``None`` (backward)."""

    gemms: dict = field(default_factory=dict)     # node -> [((batch, m, n, k), every second linear, fp8), ...]
    traffic: dict = field(default_factory=dict)   # node -> bytes read + written by the other ops
    fusion: FusionTrace = field(default_factory=FusionTrace)   # the same ops, to price fused


class OpWork(TorchDispatchMode):
    """Records :class:`Work` (module docstring); ``node`` names the fx node running (None in backward)."""

    def __init__(self, fused_dropout: bool = False):
        super().__init__()
        self.node: str | None = None
        self.work = Work()
        self.fused_dropout = fused_dropout
        self._masks = StorageMap()   # storages of dropout noise tensors (fused_dropout), forgotten when freed
        self._second = SecondMatmuls()   # which linear matmuls (mm, addmm) are even-numbered

    def _mask(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self._masks

    def _add(self, nbytes: float) -> None:
        self.work.traffic[self.node] = self.work.traffic.get(self.node, 0.0) + nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FREE or _aliases(func):
            return out
        if self.fused_dropout and func is aten.bernoulli_.float:   # the fused kernel's mask write
            self._masks[self._masks.key(args[0])] = True
            self._add(args[0].numel())
            self.work.fusion.op(self.node, [], [(args[0], args[0].numel())])
            return out
        if self.fused_dropout and func is aten.div_.Scalar and self._mask(args[0]):
            return out
        dims = gemm_dims(func, args)
        if dims is not None:
            # every second linear matmul is what "selective-op" recomputes
            self.work.gemms.setdefault(self.node, []).append(
                (dims, self._second(func), func is aten._scaled_mm.default))
            self.kernel(pytree.tree_leaves((args, kwargs)), pytree.tree_leaves(out))
            return out
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:   # metadata queries (prim.device, sizes): no kernel
            return out
        writes = [(t, tensor_bytes(t)) for t in outs]
        written = sum(b for _, b in writes)
        if func in _GATHERS:   # reads the rows it writes (and the indices), not the whole table
            reads = [(None, written)] + [(t, tensor_bytes(t)) for t in pytree.tree_leaves((args, kwargs))
                                         if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        else:   # an ``out=`` tensor is written, not read
            inputs = (args, {k: v for k, v in (kwargs or {}).items() if k != "out"})
            reads = [(t, t.numel() if self._mask(t) else tensor_bytes(t))
                     for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        self._add(sum(b for _, b in reads) + written)
        self.work.fusion.op(self.node, reads, writes,
                            self.work.fusion.signature(func, args, kwargs) if _pure(func) else None)
        if any(t.numel() > 1 for t, _ in reads if t is not None) and all(t.numel() == 1 for t in outs):
            self.work.fusion.cut()   # a whole-tensor reduction: what uses it runs in the next kernel
        return out

    def kernel(self, inputs, outputs) -> None:
        """A matmul or the attention kernel read ``inputs`` and made ``outputs`` (any leaves)."""
        self.work.fusion.kernel([t for t in inputs if isinstance(t, torch.Tensor)],
                                [t for t in outputs if isinstance(t, torch.Tensor)])


def _split_dim(layer: LayerGraph, node: str) -> str:
    """The dim of a node's matmul that tensor parallelism divides (:class:`Point`)."""
    role = layer.roles.get(node)
    if role in ("column", "vocab"):
        return "n"
    if role == "row":
        return "k"
    return "b" if layer.in_sharded.get(node, False) else ""


class GemmLabel(NamedTuple):
    """What the label of a forward matmul in ``fwd_gemms`` says (:func:`record_op_work` writes it)."""

    fp8: bool      # ``8``: a ``torch._scaled_mm`` (the fp8 rate)
    second: bool   # ``2``: every second linear matmul, which ``selective-op`` recomputes
    expert: bool   # ``e``: an experts block's matmul, which expert parallelism regroups
    split: str     # the dim tensor parallelism splits (``b`` / ``n`` / ``k``), "" where replicated


def gemm_label(label: str) -> GemmLabel:
    """:class:`GemmLabel` of a ``fwd_gemms`` label: its flags in order, then the split dim."""
    fp8 = label.startswith("8")
    label = label[fp8:]
    second = label.startswith("2")
    label = label[second:]
    expert = label.startswith("e")
    return GemmLabel(fp8, second, expert, label[expert:])


def record_op_work(layer: LayerGraph, work: Work, p: Point) -> None:
    """The forward's matmuls and traffic (:class:`OpWork`) into ``p``, classified as the FLOPs are."""
    for node, dims in work.gemms.items():
        # NOTE: "e" marks an experts block's matmul: expert parallelism regroups it (time_terms)
        # "2" marks every second linear matmul, which "selective-op" recomputes, "8" an fp8 one (time_terms)
        expert = "e" if node in layer.expert_nodes else ""
        p.fwd_gemms += [(("8" if fp8 else "") + ("2" if second else "") + expert + _split_dim(layer, node), d)
                        for d, second, fp8 in dims]
    p.fwd_traffic_sharded, p.fwd_traffic_rep = by_split(layer, work.traffic)


def by_split(layer: LayerGraph, traffic: dict) -> tuple[float, float]:
    """``(TP-sharded, replicated)`` forward bytes of ``traffic`` (node -> bytes; None: the backward)."""
    sharded = rep = 0.0
    for node, moved in traffic.items():
        if node is None:
            continue
        if layer.roles.get(node) in ("column", "row") or layer.in_sharded.get(node, False):
            sharded += moved
        else:
            rep += moved
    return sharded, rep
