"""A table keyed by tensors' storages whose entries go when their storage is freed.

The measurement (:mod:`.measure`, :mod:`.op_work`, :mod:`.fusion`) runs each layer on fake tensors,
whose allocator hands a freed storage's address to the next storage at once. A table keyed by
``untyped_storage()._cdata`` alone would read a new tensor at that address as the freed one (its
producing node, its values' version, a dropout mask); :class:`StorageMap` forgets the entry when
the storage is freed, so the new tensor is first seen as itself.
"""

from __future__ import annotations

import weakref

import torch


class StorageMap(dict):
    """storage key -> value (a ``dict``); each entry dropped when its storage is freed."""

    def key(self, t: torch.Tensor) -> int:
        """``t``'s storage key; the entry made under it is dropped when the storage is freed."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self:
            weakref.finalize(storage, self.pop, key, None)
        return key
