"""The working set of a layer's backward: what it allocates beyond the tensors its forward saved.

A layer's backward holds, besides the activations its forward saved, the gradients it computes on
the way: the gradient of each intermediate tensor lives from the op that makes it until the ops
that read it have run. At the loss that is two ``[tokens, vocab]`` tensors in the loss's dtype (the
negative log-likelihood's gradient and the log-softmax's), next to the saved log-probabilities, and
with a large vocabulary it is the largest buffer of the step. Meanwhile autograd frees each saved
tensor once the node that saved it has run.

:class:`BackwardPeak` watches a backward run (fake tensors will do: their storages are created and
freed as real ones would be) and reports :meth:`BackwardPeak.excess`: the largest amount by which
the bytes the backward allocated exceed the saved bytes freed so far (a parameter's gradient counts
at the moment it is made: the runtime copies it into its gradient buffer, which the states count).
The cost model adds it to the layer's transient bytes on top of the saved activations it already
holds (:meth:`galvatron_fx.cost.CostModel.backward_excess_bytes`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class BackwardPeak(TorchDispatchMode):
    """Enter around ``torch.autograd.backward``; :meth:`watch_saved` first (the storages the forward
    saved, referenced by nothing but autograd), :meth:`excess` after. ``itemsize``: counts are kept
    in elements of that size (the cost model prices them at its own element size)."""

    def __init__(self, itemsize: int):
        super().__init__()
        self.itemsize = itemsize
        self._events: list[tuple[weakref.ref | None, float]] = []   # (allocated storage, +bytes) or (None, -bytes)
        self._seen: dict[int, weakref.ref] = {}

    def watch_saved(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Record the freeing of each of ``storages`` (saved for backward) as it happens."""
        for st in storages:
            weakref.finalize(st, self._events.append, (None, -float(st.nbytes())))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        written = {id(a.untyped_storage()) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            known = self._seen.get(id(st))
            if id(st) in written or (known is not None and known() is st):   # written in place
                continue
            ref = weakref.ref(st)
            self._seen[id(st)] = ref
            self._events.append((ref, float(st.nbytes())))
            weakref.finalize(st, self._events.append, (None, -float(st.nbytes())))
        return out

    def excess(self, param_grads: Iterable[torch.Tensor]) -> float:
        """Elements (of ``itemsize``) the backward held at its peak beyond the saved tensors.
        ``param_grads``: the parameters' gradients, which the runtime copies into its gradient
        buffers (the states) as each is made: each counts at the moment it is made only."""
        grads = {id(t.untyped_storage()) for t in param_grads if t is not None}
        live = peak = 0.0
        for ref, nbytes in self._events:
            live += nbytes
            peak = max(peak, live)
            if ref is not None and id(ref()) in grads:
                live -= nbytes
        return peak / self.itemsize
