"""Model states among the tensors autograd saves for backward.

A layer's ops save its parameters for backward as well as its activations: under the runtime those
are views of the layer's flat buffer (:class:`~.data_parallel.FlatParams`: ``flat_param``, and
``full``, the buffer ZeRO-3 gathers or mixed precision casts, re-allocated per gather). What reads
the saved tensors as activations (the pipeline's memory tracking, activation offload) leaves these
storages out; ZeRO-3's are re-read per call since each gather allocates anew.
"""

from __future__ import annotations

import contextlib

import torch

from .data_parallel import FlatParams


def state_storages(stores) -> set[int]:
    """``data_ptr`` of every storage that holds the parameters of ``stores`` (FlatParams) now."""
    ptrs = set()
    for s in stores:
        ptrs.add(s.flat_param.untyped_storage().data_ptr())
        if s.full is not None:
            ptrs.add(s.full.untyped_storage().data_ptr())
    return ptrs


def module_stores(module: torch.nn.Module) -> list[FlatParams]:
    """The flat buffers a layer module holds (its ``flat_params`` submodules)."""
    return [m for m in module.modules() if isinstance(m, FlatParams)]


def is_state(t: torch.Tensor, stores) -> bool:
    """Whether saved tensor ``t`` is a model state: an ``nn.Parameter``, or a view of one of
    ``stores``' buffers."""
    return isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in state_storages(stores)


@contextlib.contextmanager
def recording(recorders: list[list]):
    """While open, ``recorders`` holds one more list (the one yielded), which the runtime's code
    appends what it keeps to (checkpointing's kept outputs, activation offload's host copies)."""
    seen: list = []
    recorders.append(seen)
    try:
        yield seen
    finally:
        recorders.remove(seen)
