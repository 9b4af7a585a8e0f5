"""Activation checkpointing of whole layer submodules: full (every activation recomputed),
selective (the outputs of matmuls and attention kernels saved, the rest recomputed) or selective-op
(torchtitan's op policy: as selective, every second linear matmul recomputed too)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    create_selective_checkpoint_contexts,
)

from .saved import recording

aten = torch.ops.aten

SAVED_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default})
"""The ops whose outputs selective checkpointing keeps (torchtitan's "op" policy without its
every-other-matmul rule): the matmuls (fp8 ones too: torchtitan's policy sees a Float8 linear's
matmul as ``aten.mm`` on its float8 tensors), which hold most of a layer's FLOPs, and the fused attention
kernels (their output and log-sum-exp). Everything else (norms, activations, dropout, residual adds,
casts, collectives) is recomputed in backward."""


LINEAR_MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten._scaled_mm.default})
"""The matmuls of linear layers, which ``"selective-op"`` counts (torchtitan's op policy counts
``aten.mm``, its models' bias-free linears; a linear with a bias runs ``addmm``; a Float8 linear
:mod:`galvatron_fx.models.float8` runs ``_scaled_mm``)."""


def save_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy: keep the outputs of :data:`SAVED_OPS`, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class SecondMatmuls:
    """Counts a region's linear matmuls in call order: ``second(func)`` says whether this call is
    an even-numbered one (the 2nd, 4th, ...), which ``"selective-op"`` recomputes. The runtime's
    policy and the cost model's measurement (:mod:`galvatron_fx.cost.selective`,
    :mod:`galvatron_fx.cost.op_work`) count with it, so they pick the same matmuls."""

    def __init__(self):
        self.count = 0

    def __call__(self, func) -> bool:
        if func not in LINEAR_MATMULS:
            return False
        self.count += 1
        return self.count % 2 == 0


def alternate_policy():
    """``"selective-op"``'s policy for one region (torchtitan's ``selective_ac_option = "op"``): as
    :func:`save_policy`, but every second linear matmul of the region (:class:`SecondMatmuls`) is
    recomputed too. Called in the forward only (torch records each call's choice by invocation)."""
    second = SecondMatmuls()

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if second(func):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return save_policy(ctx, func, *args, **kwargs)

    return policy


def checkpoint_layer(layer, *args):
    """Run ``layer(*args)`` keeping only its inputs; its activations are recomputed in backward.

    NOTE: non-reentrant checkpointing (``use_reentrant=False``) is the one that supports inputs
    which do not require grad, keyword-free calls from fx code and nested autograd Functions.
    Without early stop: torch stops a recomputation early by raising an exception through the
    layer, and a ``GraphModule`` layer turns every such exception into a traceback extraction
    (torch.fx's ``_WrappedCall``), ~80 us per layer call here; recomputing the layer's last ops
    instead costs less (measured: docs/measurements.md, "Figures behind the design").
    """
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, early_stop=False)


class _Replayable(_CachedTorchDispatchMode):
    """torch's recompute-side mode of selective checkpointing with two changes.

    It serves every recomputation of its region, handing out each saved output once per
    recomputation instead of once in all. NOTE: a split (zero-bubble) backward recomputes a
    checkpointed layer twice, once for the input gradients and once for the weight gradients
    (torch's non-reentrant checkpoint drops what it recomputed as it is unpacked), and torch's own
    mode refuses the second ("Trying to backward an extra time"). Each recomputation here starts
    from the saved outputs as the forward left them; they are freed with the region's autograd
    graph, as the other saved tensors are.

    It matches only the saved ops against the forward's. NOTE: the runtime's own bookkeeping inside
    a layer runs different ops in the recomputation: a ZeRO-3 layer's parameters were gathered (or
    prefetched) before its forward but are gathered inside its recomputation. torch's mode requires
    every op to repeat the forward's and refuses that; ops outside :data:`SAVED_OPS` simply run.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAVED_OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __init__(self, cached: _CachedTorchDispatchMode):
        super().__init__(None, cached.storage, cached.allow_cache_entry_mutation)
        self._saved: dict | None = None

    def __enter__(self):
        if self._saved is None:
            self._saved = {k: dict(v) for k, v in self.storage.items()}
        else:
            for k, v in self._saved.items():
                self.storage[k].update(v)
        return super().__enter__()


_RECORDERS: list[list] = []


def _selective_contexts(policy=save_policy):
    caching, cached = create_selective_checkpoint_contexts(policy)
    for regions in _RECORDERS:
        regions.append(caching.storage)
    return caching, _Replayable(cached)


def _alternate_contexts():
    return _selective_contexts(alternate_policy())


def recording_kept():
    """A context that collects the storage of every selective region opened meanwhile;
    :func:`kept_tensors` lists what they keep. Used to check the memory model against live tensors:
    what a selective region keeps sits outside autograd's saved tensors."""
    return recording(_RECORDERS)


def kept_tensors(regions: list) -> list[torch.Tensor]:
    """The saved ops' outputs the recorded regions (:func:`recording_kept`) hold now."""
    out = []
    for storage in regions:
        for entries in storage.values():
            for entry in entries.values():
                out += [w.val for w in pytree.tree_leaves(entry) if isinstance(getattr(w, "val", None), torch.Tensor)]
    return out


def selective_checkpoint_layer(layer, *args):
    """Run ``layer(*args)`` keeping its inputs and the outputs of :data:`SAVED_OPS`; backward
    recomputes the other ops (torch's selective checkpoint contexts, non-reentrant as
    :func:`checkpoint_layer`; :class:`_Replayable` lets a split backward recompute twice)."""
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, early_stop=False,
                                             context_fn=_selective_contexts)


def selective_op_checkpoint_layer(layer, *args):
    """:func:`selective_checkpoint_layer` under :func:`alternate_policy`: every second linear
    matmul's output is recomputed too (``ckpt: "selective-op"``)."""
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, early_stop=False,
                                             context_fn=_alternate_contexts)


RUNNERS = {True: checkpoint_layer, "selective": selective_checkpoint_layer,
           "selective-op": selective_op_checkpoint_layer}
"""The function a layer's call runs under, by its ``ckpt`` value."""


def runs_checkpointed(target) -> bool:
    """Whether an fx ``call_function`` target is one of :data:`RUNNERS`."""
    return target in RUNNERS.values()
