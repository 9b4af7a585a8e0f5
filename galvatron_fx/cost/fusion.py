"""The memory traffic of a layer's element-wise ops as a fusing compiler (torch.compile) runs them.

Eagerly, every op outside the matmuls reads its inputs from device memory and writes its outputs
back (:mod:`.op_work` prices that). torch.compile's inductor fuses such ops into kernels: a norm,
a rotary embedding, an activation, a residual add or a Float8 cast then costs the bytes that enter
and leave its kernel, not the intermediate tensors in between. Runs that compile (torchtitan's
published tables) are priced by that rule, with ``fused_pointwise=True``
(:class:`galvatron_fx.cost.CostModel`).

:class:`FusionTrace` records, in program order, every op :class:`.op_work.OpWork` prices by bytes
and every op it does not (matmuls, the attention kernel), then prices a kernel per *region*: the
run of element-wise ops between two matmuls or attention calls, also cut after a reduction over a
whole tensor (a Float8 cast's largest magnitude: the values that use it need a second kernel). In
a region:

* a tensor is **read** once if it was made outside the region (a matmul's output, the layer's
  input, a parameter, a tensor saved by the forward), at the bytes its reader reads;
* a tensor it makes is **written** if anything outside the region reads it (a matmul, attention,
  a later region, the backward) or nothing in the layer does (the layer's output, a gradient);
  one that only the region's own ops read stays in registers.

An op that repeats one already run in the same pass (the same function on the same values: the
Float8 casts of one input that the query, key and value projections each make) is computed once,
as the compiler's common-subexpression elimination leaves it: its outputs are the first op's.

That is inductor's rule for vertical fusion, and kernels split at the same points: inductor does
not fuse into cuBLAS matmuls or the flash-attention kernel, and a whole-tensor reduction must
finish before its result is used. What this does not model: the partitioner may recompute an
element-wise op in the backward instead of saving its output (fewer bytes written here, more read
there), and inductor may split a region it cannot fit in one kernel. Both leave the figure within
the eager traffic above it and the matmul-bounded traffic below it.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from .storage_keys import StorageMap

KERNEL = -1
"""The region of a matmul or attention kernel: a tensor it reads must be in memory, one it makes is."""


class FusionTrace:
    """Element-wise ops and the kernels between them in program order (module docstring);
    :meth:`traffic` prices them as fused."""

    def __init__(self):
        self.region = 0
        self._version = StorageMap()   # storage key -> the version of its values now (forgotten when freed)
        self._count = 0
        self._made: dict[int, int] = {}      # version -> region that wrote it (KERNEL: a kernel)
        self._readers: dict[int, set[int]] = {}   # version -> regions that read it
        self._ops: list[tuple] = []          # (node, region, [(version, bytes) read], [(version, bytes) written])
        self._done: dict[tuple, list[int]] = {}   # an op's signature -> the versions it made (this pass)

    def _new(self) -> int:
        self._count += 1
        return self._count

    def _current(self, t: torch.Tensor | None) -> int:
        """The version of ``t``'s values (a new one for a tensor first seen here: made outside the
        trace; ``None``: a read of rows nothing else reads, a gather's)."""
        if t is None:
            return self._new()
        key = self._version.key(t)
        if key not in self._version:
            self._version[key] = self._new()
        return self._version[key]

    def _write(self, t: torch.Tensor, region: int) -> int:
        key = self._version.key(t)
        version = self._version[key] = self._new()
        self._made[version] = region
        return version

    def signature(self, func, args, kwargs) -> tuple:
        """What identifies a pure op's result: ``func`` and its arguments, each tensor as the version
        of its values and its view (shape, strides, offset, dtype); an ``out=`` buffer left out."""
        def leaf(x):
            if isinstance(x, torch.Tensor):
                return (self._current(x), tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype)
            return repr(x)
        kwargs = {k: v for k, v in (kwargs or {}).items() if k != "out"}
        return (func, tuple(leaf(x) for x in pytree.tree_leaves((args, kwargs))),
                tuple(sorted(kwargs)))

    def op(self, node: str | None, reads, writes, signature: tuple | None = None) -> None:
        """An element-wise op of fx node ``node`` reading and writing ``[(tensor, bytes)]``;
        ``signature`` (:meth:`signature`, for a pure op): a repeat of an earlier op of this pass
        moves nothing, its outputs being that op's."""
        if signature is not None and signature in self._done:
            for (t, _), version in zip(writes, self._done[signature]):
                self._version[self._version.key(t)] = version
            return
        read = [(self._current(t), b) for t, b in reads]
        for version, _ in read:
            self._readers.setdefault(version, set()).add(self.region)
        written = [(self._write(t, self.region), b) for t, b in writes]
        self._ops.append((node, self.region, read, written))
        if signature is not None:
            self._done[signature] = [v for v, _ in written]

    def kernel(self, inputs, outputs) -> None:
        """A matmul or attention kernel reading ``inputs`` and making ``outputs`` (tensors): its
        traffic is its own; it ends the region."""
        for t in inputs:
            self._readers.setdefault(self._current(t), set()).add(KERNEL)
        for t in outputs:
            self._write(t, KERNEL)
        self.cut()

    def cut(self) -> None:
        """End the region: the ops after this one run in another kernel."""
        self.region += 1

    def next_pass(self) -> None:
        """The forward ends, the backward begins: in kernels of its own, with its own repeats."""
        self.cut()
        self._done.clear()

    def traffic(self) -> dict[str | None, float]:
        """Bytes each fx node moves when every region runs as one kernel (module docstring):
        reads charged to the op that first reads a tensor in its region, writes to the op that
        makes it."""
        out: dict[str | None, float] = {}
        counted: set[tuple[int, int]] = set()
        for node, region, read, written in self._ops:
            moved = 0.0
            for version, nbytes in read:
                if self._made.get(version) == region or (region, version) in counted:
                    continue
                counted.add((region, version))
                moved += nbytes
            for version, nbytes in written:
                readers = self._readers.get(version, set())
                if not readers or readers != {region}:
                    moved += nbytes
            out[node] = out.get(node, 0.0) + moved
        return out
