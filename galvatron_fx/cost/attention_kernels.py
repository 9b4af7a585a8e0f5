"""SDPA as the target device runs it: which fused kernel, what it saves for backward, what it computes.

``F.scaled_dot_product_attention`` is one call in a captured graph, but the work and memory behind
it depend on the kernel torch dispatches to on the device that trains, not on the CPU fake tensors
the measurement (:mod:`.measure`) runs on. :func:`attention_kernel` names that kernel from the
target's device family (:attr:`galvatron_fx.cluster.Cluster.attention_target`), the operands' dtype
and the call's arguments, following torch's dispatcher (``sdp_utils``):

==============  ===============================================================  ======================
kernel          where torch picks it                                             saved for backward
==============  ===============================================================  ======================
``flash``       CUDA sm80+ (A100, H100, H200), fp16 / bf16, no ``attn_mask``,     q, k, v, out, lse
                head dim <= 256 (grouped key / value heads natively)             (fp32, ``b h s_q``)
``efficient``   CUDA otherwise (a mask, fp32, sm70 / sm75: V100, TITAN RTX);     q, k, v, out, lse
                not with ``enable_gqa``                                          (rows padded to 32),
                                                                                 the bias
``flash_cpu``   CPU, no dropout, no mask needing a gradient                       q, k, v, out, lse, the
                (``_scaled_dot_product_flash_attention_for_cpu``)                 mask
``math``        everything else (CPU with dropout or a learned bias, ``enable_gqa``  ``q * scale``, k, v,
                where the fused kernels refuse it)                               the probabilities
                                                                                 ``[b, h, s_q, s_kv]``
                                                                                 (and dropout's mask
                                                                                 and dropped copy)
==============  ===============================================================  ======================

A boolean mask is converted to an additive one in the query's dtype before a fused kernel sees it
(a new ``[.., s_q, s_kv]`` tensor, which the kernel saves); grouped key / value heads are repeated
to the query heads (new tensors, saved) by every kernel but ``flash`` and ``flash_cpu`` (torch 2.13's
CPU kernel saves the grouped ``k`` and ``v`` as given: ``tests/test_attention_pricing.py``).

FLOPs are counted as the kernel executes them: forward ``2 e (d + d_v)`` for ``e`` score entries,
backward ``2 e (3 d + 2 d_v)`` (the fused backward recomputes the scores: 2.5 x the forward for
``d = d_v``, FlashAttention-2's convention, arXiv 2307.08691), where a causal fused kernel computes
the ``s (s + 1) / 2`` entries on and below the diagonal and ``math`` all ``s_q s_kv`` (it masks after
computing). The cost model prices them with :meth:`Cluster.attention_time`.

:class:`StandIn` replaces an SDPA call while the layer is measured on fake tensors: it produces the
output and saves exactly the kernel's tensors (so the saved-bytes hooks see what the device would
keep), and its backward returns the operands' gradients without computing (the FLOPs are counted
here, not by ``FlopCounterMode``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

TARGETS = ("cuda", "cuda-sm70", "cpu")
"""Device families the kernel choice distinguishes: CUDA sm80+ (flash available), CUDA before sm80
(memory-efficient attention only), the CPU."""

LSE_ROWS_EFFICIENT = 32
"""The memory-efficient kernel pads its log-sum-exp rows to a multiple of 32."""


@dataclass(frozen=True)
class SdpaCall:
    """One SDPA call's operands and arguments as the kernel choice reads them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    dropout: float
    causal: bool
    gqa: bool

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def entries(self, kernel: str) -> float:
        """Score entries the kernel computes per (batch, head): causal fused kernels skip the
        blocks above the diagonal."""
        sq, skv = self.q.shape[-2], self.k.shape[-2]
        if self.causal and kernel != "math" and sq == skv:
            return sq * (sq + 1) / 2
        return float(sq * skv)


def attention_kernel(target: str, call: SdpaCall) -> str:
    """The kernel torch dispatches ``call`` to on ``target`` (:data:`TARGETS`; module docstring)."""
    if target not in TARGETS:
        raise ValueError(f"unknown attention target {target!r}; one of {TARGETS}")
    if target == "cpu":
        floating = call.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        learned_mask = call.mask is not None and call.mask.requires_grad   # a bias it has no gradient for
        return "flash_cpu" if call.dropout == 0 and floating and not learned_mask else "math"
    d = call.q.shape[-1]
    if (target == "cuda" and call.mask is None and call.dtype in (torch.float16, torch.bfloat16)
            and d <= 256 and call.v.shape[-1] <= 256):
        return "flash"
    return "math" if call.gqa else "efficient"


def attention_flops(call: SdpaCall, kernel: str) -> tuple[float, float]:
    """``(forward, backward)`` FLOPs the kernel executes for ``call`` (module docstring)."""
    q, v = call.q, call.v
    rows = math.prod(q.shape[:-2])            # batch x query heads
    d, dv = q.shape[-1], v.shape[-1]
    e = rows * call.entries(kernel)
    return 2 * e * (d + dv), 2 * e * (3 * d + 2 * dv)


def _expanded(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[-3] == heads else t.new_empty((*t.shape[:-3], heads, *t.shape[-2:]))


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias a fused kernel receives: a boolean mask converted into a new tensor of ``dtype``."""
    return mask.new_empty(mask.shape, dtype=dtype) if mask.dtype == torch.bool else mask


def _lse(kernel: str, q: torch.Tensor) -> torch.Tensor:
    """A fused kernel's log-sum-exp (fp32, ``[.., heads, s_q]``, rows padded by ``efficient``)."""
    sq = q.shape[-2]
    pad = LSE_ROWS_EFFICIENT * math.ceil(sq / LSE_ROWS_EFFICIENT) if kernel == "efficient" else sq
    return q.new_empty((*q.shape[:-2], pad), dtype=torch.float32)


def kernel_outputs(kernel: str, call: SdpaCall, out: torch.Tensor) -> list[torch.Tensor]:
    """What the kernel's ATen op returns, which selective checkpointing keeps: a fused kernel's
    output and log-sum-exp; on the math path, its two batched matmuls' outputs (the scores
    ``[.., s_q, s_kv]`` and the output). New ones are empty stand-ins."""
    if kernel == "math":
        return [call.q.new_empty((*call.q.shape[:-1], call.k.shape[-2])), out]
    return [out, _lse(kernel, call.q)]


def saved_for_backward(kernel: str, call: SdpaCall, out: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the kernel keeps for backward (module docstring); new ones are empty stand-ins."""
    q, k, v, mask = call.q, call.k, call.v, call.mask
    hq, sq = q.shape[-3], q.shape[-2]
    rows = tuple(q.shape[:-2])
    if kernel == "flash":
        return [q, k, v, out, _lse(kernel, q)]
    if kernel != "flash_cpu":   # NOTE: torch's CPU flash kernel takes grouped key / value heads natively
        k, v = _expanded(k, hq), _expanded(v, hq)
    if kernel in ("efficient", "flash_cpu"):
        saved = [q, k, v, out, _lse(kernel, q)]
        return saved + ([_additive(mask, q.dtype)] if mask is not None else [])
    probs = q.new_empty((*rows, sq, k.shape[-2]))
    saved = [q.new_empty(q.shape), k, v, probs]
    if call.dropout:
        saved += [probs.new_empty(probs.shape, dtype=torch.bool), probs.new_empty(probs.shape)]
    return saved


class StandIn(torch.autograd.Function):
    """SDPA on fake tensors as ``kernel`` would run it (module docstring): the output, the kernel's
    saved tensors, gradients of the operands' shapes."""

    @staticmethod
    def forward(ctx, q, k, v, mask, kernel, dropout, causal, gqa):
        call = SdpaCall(q, k, v, mask, dropout, causal, gqa)
        batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
        shape = (*batch, q.shape[-3], q.shape[-2], v.shape[-1])
        if kernel == "math":
            out = q.new_empty(shape)
        else:   # NOTE: the fused kernels write [..., s, heads, dv] and return its transpose (a view)
            out = q.new_empty((*shape[:-3], shape[-2], shape[-3], shape[-1])).transpose(-2, -3)
        ctx.save_for_backward(*saved_for_backward(kernel, call, out))
        ctx.shapes = [(t.shape, t.dtype) for t in (q, k, v)]
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = [grad.new_empty(shape, dtype=dtype) for shape, dtype in ctx.shapes]
        return (*grads, None, None, None, None, None)


def sdpa_call(args: tuple, kwargs: dict) -> SdpaCall:
    """The :class:`SdpaCall` of ``F.scaled_dot_product_attention(*args, **kwargs)``."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    return SdpaCall(bound["query"], bound["key"], bound["value"], bound.get("attn_mask"),
                    float(bound.get("dropout_p", 0.0) or 0.0), bool(bound.get("is_causal", False)),
                    bool(kwargs.get("enable_gqa", False)))


def run_stand_in(target: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, str, tuple[float, float], list]:
    """``(output, kernel, (forward, backward) FLOPs, the kernel op's outputs)`` of an SDPA call
    measured for ``target`` (:func:`kernel_outputs`)."""
    call = sdpa_call(args, kwargs)
    if target != "cpu" and torch.is_autocast_enabled("cpu"):
        # CUDA's autocast runs SDPA in its low precision whatever the operands' dtype (an fp32 q from
        # an op outside autocast's lists, e.g. a Float8 linear's output); the measurement's CPU
        # autocast stands in for the device's
        low = torch.get_autocast_dtype("cpu")
        cast = lambda t: t.to(low) if t is not None and t.is_floating_point() else t   # noqa: E731
        call = dataclasses.replace(call, q=cast(call.q), k=cast(call.k), v=cast(call.v), mask=cast(call.mask))
    kernel = attention_kernel(target, call)
    out = StandIn.apply(call.q, call.k, call.v, call.mask, kernel, call.dropout, call.causal, call.gqa)
    return out, kernel, attention_flops(call, kernel), kernel_outputs(kernel, call, out)
