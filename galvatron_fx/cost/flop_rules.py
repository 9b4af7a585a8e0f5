"""FLOP formulas torch's ``FlopCounterMode`` lacks: the CPU SDPA kernels (flash and memory-efficient
on CPU) and the grouped expert matmuls; :func:`flop_counter` is the counter the cost model's
measurement runs under."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten

def _sdpa_fwd(query, key, value, *args, out_shape=None, **kwargs) -> int:
    b, h, s_q, d = query
    s_kv, d_v = key[-2], value[-1]
    return 2 * b * h * s_q * s_kv * d + 2 * b * h * s_q * s_kv * d_v


def _sdpa_bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return 2 * _sdpa_fwd(query, key, value)


def _sdpa_ops() -> dict:
    table = {}
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_fwd),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_bwd),
                     ("_scaled_dot_product_fused_attention_overrideable", _sdpa_fwd),
                     ("_scaled_dot_product_fused_attention_overrideable_backward", _sdpa_bwd)):
        op = getattr(aten, name, None)
        if op is not None:
            table[op] = fn
    return table


SDPA_FORMULAS = _sdpa_ops()
"""Extra ``FlopCounterMode(custom_mapping=...)`` entries for SDPA kernels torch has no formula for."""


def _grouped_mm_fwd(x, w, *args, out_shape=None, **kwargs) -> int:
    """``x[rows, in]`` times each group's ``w[g][in, out]``: every row once (the top-k share of
    the experts' FLOPs: ``rows`` = tokens x k)."""
    return 2 * x[0] * x[-1] * w[-1]


def _grouped_mm_bwd(x, w, offs, grad_out, *args, out_shape=None, **kwargs) -> int:
    return 2 * _grouped_mm_fwd(x, w)


def _grouped_mm_ops() -> dict:
    """Grouped expert matmuls (torch's ``_grouped_mm``, transformers' CPU fallback op and its
    backward), looked up when counting: transformers registers its ops on import."""
    table = {}
    for ns, name, fn in (("aten", "_grouped_mm", _grouped_mm_fwd),
                         ("transformers", "grouped_mm_fallback", _grouped_mm_fwd),
                         ("transformers", "grouped_mm_fallback_backward", _grouped_mm_bwd)):
        try:
            table[getattr(getattr(torch.ops, ns), name)] = fn
        except (AttributeError, RuntimeError):
            continue
    return table


def flop_counter() -> FlopCounterMode:
    """A silent FlopCounterMode that also counts the CPU SDPA kernels and grouped expert matmuls."""
    return FlopCounterMode(display=False, custom_mapping={**SDPA_FORMULAS, **_grouped_mm_ops()})
