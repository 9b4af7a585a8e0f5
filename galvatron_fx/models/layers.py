"""Building blocks shared by the zoo families: attention, MLPs, RMSNorm, rotary helpers, init.

Capture rules every module here follows (see ``galvatron_fx.models``):

* no Python control flow on tensor shapes -- every size comes from a config int, so
  ``torch.fx`` symbolic tracing (with no leaf modules), ``torch.compile(fullgraph=True)``
  and ``torch.export(strict=False)`` all see one straight-line graph;
* head splitting works on the last dimension only (``unflatten``/``flatten``), so the same
  ``Attention`` serves ``[B, S, C]`` sequences and Swin's ``[B, windows, N, C]`` windows;
* q, k and v are separate ``nn.Linear`` projections in every family.

NOTE: separate q/k/v (rather than one fused qkv Linear) is deliberate: a column-parallel
tensor-parallel rewrite can shard each projection on its output dimension directly, whereas a
fused qkv weight would hand each rank a slice that mixes q, k and v.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias): LLaMA's RMSNorm and T5's
    ``T5LayerNorm``. Statistics are computed in fp32 and the result cast back."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[..., N, heads*head_dim] -> [..., heads, N, head_dim]``."""
    return x.unflatten(-1, (heads, head_dim)).transpose(-3, -2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[..., heads, N, head_dim] -> [..., N, heads*head_dim]``."""
    return x.transpose(-3, -2).flatten(-2)


def rotate_half(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The rotary-embedding partner of ``x`` (GPT-NeoX / HF LLaMA layout: halves, not pairs)."""
    half = head_dim // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, like: torch.Tensor):
    """Rotary tables ``cos, sin`` of shape ``[seq_len, head_dim]`` in ``like``'s dtype/device.

    Computed from static sizes in the forward pass (no buffers), so a model built on the meta
    device and materialised later needs no buffer re-initialisation.
    """
    inv_freq = torch.exp(
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=like.device) * (-math.log(theta) / head_dim)
    )
    t = torch.arange(seq_len, dtype=torch.float32, device=like.device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(like.dtype), emb.sin().to(like.dtype)


class Attention(nn.Module):
    """Multi-head (optionally grouped-query) attention through
    ``F.scaled_dot_product_attention``.

    ``forward(x, context=None, attn_mask=None, is_causal=False, rope=None)``: ``x`` is
    ``[..., N, hidden]``; ``context`` (cross-attention keys/values) defaults to ``x``;
    ``attn_mask`` is an additive float mask broadcastable to ``[..., heads, N, M]``;
    ``rope`` is a ``(cos, sin)`` pair from :func:`rotary_cos_sin`. ``scale=None`` is the usual
    ``head_dim**-0.5``; T5 passes ``1.0``.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = True, scale: float | None = None):
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads or heads
        self.head_dim = head_dim or hidden // heads
        self.scale = scale
        inner, kv_inner = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q = nn.Linear(hidden, inner, bias=bias)
        self.k = nn.Linear(hidden, kv_inner, bias=bias)
        self.v = nn.Linear(hidden, kv_inner, bias=bias)
        self.o = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x, context=None, attn_mask=None, is_causal: bool = False, rope=None):
        kv_in = x if context is None else context
        q = split_heads(self.q(x), self.heads, self.head_dim)
        k = split_heads(self.k(kv_in), self.kv_heads, self.head_dim)
        v = split_heads(self.v(kv_in), self.kv_heads, self.head_dim)
        if rope is not None:
            cos, sin = rope
            q = q * cos + rotate_half(q, self.head_dim) * sin
            k = k * cos + rotate_half(k, self.head_dim) * sin
        if self.kv_heads != self.heads:  # grouped-query attention: share each kv head
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=-3)
            v = v.repeat_interleave(rep, dim=-3)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale)
        return self.o(merge_heads(o))


class MLP(nn.Module):
    """``fc2(act(fc1(x)))`` with ``act`` one of ``gelu``, ``gelu_tanh``, ``relu``."""

    def __init__(self, hidden: int, ffn_hidden: int, act: str = "gelu", bias: bool = True):
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x):
        h = self.fc1(x)
        if self.act == "relu":
            h = F.relu(h)
        elif self.act == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.gelu(h)
        return self.fc2(h)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward (LLaMA): ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PreLNBlock(nn.Module):
    """Pre-LayerNorm transformer block (GPT-2/3, ViT): ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int, act: str = "gelu", eps: float = 1e-5):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, ffn_hidden, act=act)

    def forward(self, x, is_causal: bool = False):
        x = x + self.attn(self.ln1(x), is_causal=is_causal)
        return x + self.mlp(self.ln2(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32. Every position counts (no ignore index), so the mean of
    equal-sized micro-batch losses equals the global-batch loss."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Deterministic (under the caller's RNG seed) GPT-style init: every weight matrix and
    embedding ~ N(0, std), biases 0, norm scales 1."""
    norm_types = (nn.LayerNorm, RMSNorm)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if isinstance(module, norm_types):
                    p.fill_(1.0 if name == "weight" else 0.0)
                elif name == "bias":
                    p.zero_()
                else:
                    p.normal_(0.0, std)
