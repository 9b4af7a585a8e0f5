"""torchtitan's Llama attention as a transformers attention function, for the published rows that
torchtitan ran.

torchtitan's ``Attention.forward`` (``torchtitan/models/llama/model.py``) repeats the key / value
heads up to the query heads (``repeat_kv``: an ``expand`` of the ``[batch, seq, kv_heads, dim]``
projection and a ``reshape``, which copies) and then calls
``F.scaled_dot_product_attention(q, k, v, is_causal=True)``. So its SDPA receives, saves and, under
context parallelism, exchanges the repeated heads. transformers' ``sdpa`` attention passes the
grouped heads instead (``enable_gqa``), which would price 1/groups of those bytes: this function
runs attention as torchtitan does, so the model of a torchtitan row is the one that ran.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import register_attention

NAME = "torchtitan_sdpa"


def torchtitan_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         is_causal=None, **kwargs):
    """``(output [batch, seq, heads, dim], None)`` as torchtitan computes it (module docstring)."""
    if attention_mask is not None:
        raise ValueError("torchtitan's attention is causal without a mask (no padding)")
    groups = query.shape[1] // key.shape[1]

    def repeat_kv(x: torch.Tensor) -> torch.Tensor:
        if groups == 1:
            return x
        b, h, s, d = x.shape
        x = x.transpose(1, 2)   # torchtitan's [batch, seq, kv_heads, dim] layout
        return x[:, :, :, None, :].expand(b, s, h, groups, d).reshape(b, s, h * groups, d).transpose(1, 2)

    out = F.scaled_dot_product_attention(query, repeat_kv(key), repeat_kv(value), is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`torchtitan_attention` with transformers under :data:`NAME`; returns the name."""
    return register_attention(NAME, torchtitan_attention)
