"""llm-foundry's MPT flash attention as a transformers attention function, for the llm-foundry rows
that ran it (``--attn_impl flash``, flash-attn 2.x).

llm-foundry's ``flash_attn_fn`` (``llmfoundry/models/layers/attention.py``, as of its 2024-01
benchmarks) calls flash-attn's variable-length kernel on unpadded tokens: it gathers the kept rows of
q, k and v (``flash_attn.bert_padding.index_first_axis``: ``torch.gather`` over the flattened
``[batch * seq, heads * dim]`` rows; its backward scatters the gradient into zeros), runs
``flash_attn_varlen_func`` and scatters the output back into a zero-filled padded tensor
(``pad_input``: ``index_put`` into zeros; its backward gathers the rows). Those gathers and scatters
move memory on every layer whether or not the batch has padding, so the model of such a row runs
them. The varlen kernel is ``F.scaled_dot_product_attention`` here (causal, no mask: the same work on
an unpadded batch), priced at the row's attention kernel's rate. The kept rows are all of them
(``torch.arange``: a batch without padding, what ``unpad_input`` finds for it).
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from _common import register_attention

NAME = "llmfoundry_unpadded"   # NOTE: no "flash" in it (_common.register_attention)


class _GatherRows(torch.autograd.Function):
    """``index_first_axis``: the rows ``indices`` of ``x[rows, features]``; backward scatters the
    gradient into zeros."""

    @staticmethod
    def forward(ctx, x, indices):
        ctx.save_for_backward(indices)
        ctx.rows = x.shape[0]
        return torch.gather(x, 0, indices[:, None].expand(-1, x.shape[1]))

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.rows, grad.shape[1])
        out.scatter_(0, indices[:, None].expand(-1, grad.shape[1]), grad)
        return out, None


class _ScatterRows(torch.autograd.Function):
    """``pad_input``'s ``index_put_first_axis``: ``values`` written at rows ``indices`` of a zero
    tensor of ``rows`` rows; backward gathers the gradient's rows."""

    @staticmethod
    def forward(ctx, values, indices, rows: int):
        ctx.save_for_backward(indices)
        out = values.new_zeros(rows, values.shape[1])
        out[indices] = values
        return out

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        return grad[indices], None, None


@torch.fx.wrap
def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return _GatherRows.apply(x, indices)


@torch.fx.wrap
def scatter_rows(values: torch.Tensor, indices: torch.Tensor, rows: int) -> torch.Tensor:
    return _ScatterRows.apply(values, indices, rows)


torch.compiler.allow_in_graph(gather_rows)
torch.compiler.allow_in_graph(scatter_rows)


def foundry_flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            is_causal=None, **kwargs):
    """``(output [batch, seq, heads, dim], None)`` as llm-foundry's ``flash_attn_fn`` computes it
    (module docstring)."""
    if attention_mask is not None:
        raise ValueError("the benchmark rows are causal batches without padding (no mask)")
    b, h, s, d = query.shape
    indices = torch.arange(b * s, device=query.device)

    def unpad(x: torch.Tensor) -> torch.Tensor:   # [b, h, s, d] -> [(b s), (h d)] rows
        return gather_rows(x.transpose(1, 2).reshape(b * s, h * d), indices)

    q, k, v = (unpad(t).view(b, s, h, d).transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling)
    padded = scatter_rows(out.transpose(1, 2).reshape(b * s, h * d), indices, b * s)
    return padded.view(b, s, h, d), None


def register() -> str:
    """Register :func:`foundry_flash_attention` with transformers under :data:`NAME`; returns the name."""
    return register_attention(NAME, foundry_flash_attention)
