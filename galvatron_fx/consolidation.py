"""A checkpoint's global tensors -> one ``safetensors`` file, streamed (``gfx.checkpoint.consolidate``).

The safetensors layout is an 8-byte little-endian header length, a JSON header (``name ->
{dtype, shape, data_offsets}`` plus ``__metadata__``) and the tensors' bytes back to back. Every
shape and dtype is known from DCP's metadata before any data is read, so the header is written
first and the tensors follow in header order, read from the checkpoint a group at a time (each
group at most the largest tensor's bytes): memory stays about one tensor, whatever the model size.
The file is what ``safetensors.torch.save_file`` writes for the same dict (checked in the tests),
so ``transformers``' ``from_pretrained`` reads it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

import torch

# safetensors' dtype names
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}


def tensor_entries(path: str, *, optimizer: bool = False) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``key -> (global shape, dtype)`` of the tensors of checkpoint ``path`` (``model.*`` only
    unless ``optimizer``), in key order."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: (torch.Size(m.size), m.properties.dtype) for k, m in sorted(meta.items())
            if hasattr(m, "size") and (optimizer or k.startswith("model."))}


def stream_safetensors(file: str, entries: dict[str, tuple[torch.Size, torch.dtype]], names: dict[str, str],
                       read: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> int:
    """Write ``entries`` (key -> (shape, dtype)) as safetensors ``file`` under ``names[key]``;
    ``read(want)`` fills a dict of empty tensors from the checkpoint. Returns the largest number of
    bytes held at once (the biggest group read)."""
    order = sorted(entries, key=lambda k: names[k])
    sizes = {k: math.prod(entries[k][0]) * _itemsize(entries[k][1]) for k in order}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for k in order:
        shape, dtype = entries[k]
        if dtype not in DTYPES:
            raise ValueError(f"checkpoint tensor {k!r} has dtype {dtype}, which safetensors cannot hold")
        header[names[k]] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + sizes[k]]}
        pos += sizes[k]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)     # safetensors pads the header to 8 bytes
    limit = max(sizes.values(), default=0)
    held = 0
    tmp = file + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        group: list[str] = []
        for i, k in enumerate(order):
            group.append(k)
            nxt = order[i + 1] if i + 1 < len(order) else None
            if nxt is not None and sum(sizes[g] for g in group) + sizes[nxt] <= limit:
                continue
            got = read({g: torch.empty(entries[g][0], dtype=entries[g][1]) for g in group})
            held = max(held, sum(sizes[g] for g in group))
            for g in group:
                t = got[g].contiguous()
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)   # no copy
            group = []
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    return held


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
