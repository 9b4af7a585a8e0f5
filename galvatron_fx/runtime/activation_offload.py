"""Activation offload: a layer's saved activations in host memory from its forward to its backward.

:func:`offload_layer` runs a layer under saved-tensor hooks (as ``torch.autograd.graph.save_on_cpu``
does, minus the parameters): each tensor the layer's ops save for backward is copied to the host
(pinned memory on CUDA, so the copy back can be asynchronous) and the device's reference dropped;
the backward copies it back when it reads it. Model states are left alone (an ``nn.Parameter``,
a view of the layer's flat buffer or of ZeRO-3's gathered one: :func:`.saved.is_state`), as
offloading them would copy weights each micro-batch. On a CPU device the copy is a fresh host
tensor (the same work, in the same memory). :func:`recording_offloaded` lists the copies live.
"""

from __future__ import annotations

import torch

from .saved import is_state, module_stores, recording

_RECORDERS: list[list] = []


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s whole storage as a 1-D uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``'s whole storage (pinned on CUDA; a fresh tensor on a CPU device)."""
    src = _storage_bytes(t)
    host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=t.device.type == "cuda")
    host.copy_(src)
    return host


def _view(storage: torch.Tensor, t_like: tuple) -> torch.Tensor:
    """The view ``t_like = (dtype, offset, size, stride)`` of a uint8 storage copy."""
    dtype, offset, size, stride = t_like
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage.untyped_storage(), offset, size, stride)


def offload_layer(layer, *args):
    """Run ``layer(*args)`` keeping what it saves for backward in host memory (module docstring).
    Each storage is copied once however many of its views the ops save (the query, key and value
    projections all save their one input), and brought back once in the backward."""
    stores = module_stores(layer)
    # NOTE: device storage pointer -> (the tensor, its host copy), for the layer's forward only: the
    # tensor is held so that no later allocation of the forward reuses the pointer
    host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    back: dict[int, torch.Tensor] = {}     # host storage pointer -> its device copy (backward)

    def pack(t: torch.Tensor):
        if is_state(t, stores):
            return None, t
        key = t.untyped_storage().data_ptr()
        if key not in host:
            host[key] = (t, _to_host(t))
            for copies in _RECORDERS:
                copies.append(host[key][1])
        return t.device, (host[key][1], (t.dtype, t.storage_offset(), t.size(), t.stride()))

    def unpack(packed):
        device, saved = packed
        if device is None:
            return saved
        copy, like = saved
        if device != copy.device:
            key = copy.data_ptr()
            if key not in back:
                back[key] = copy.to(device, non_blocking=True)
            copy = back[key]
        return _view(copy, like)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return layer(*args)
    finally:
        host.clear()   # the forward is over: its device tensors go (autograd holds the host copies)


def recording_offloaded():
    """A context that collects every host copy :func:`offload_layer` makes (the list it yields): a
    check of the memory model against the bytes the host holds."""
    return recording(_RECORDERS)
