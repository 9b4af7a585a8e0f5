"""LLaMA family: RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention, no biases.

Presets follow Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models"
(and the released configs): 7B 32 layers x 4096 / 32 heads / ffn 11008; 13B 40 x 5120 / 40 /
13824; 70B 80 x 8192 / 64 heads, 8 kv heads (GQA) / 28672. Vocab 32000, context 4096,
RMSNorm eps 1e-5, RoPE theta 10000, untied output head.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ._common import TransformerConfig, causal_lm_args
from .layers import Attention, GatedMLP, RMSNorm, lm_loss, rotary_cos_sin


@dataclasses.dataclass
class Config(TransformerConfig):
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int | None = None  # default: heads (plain multi-head attention)
    ffn_hidden: int = 11008
    seq_len: int = 4096
    vocab: int = 32000
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        if self.kv_heads is None:
            self.kv_heads = self.heads
        self.check_positive("kv_heads", "seq_len", "vocab")
        self.check_divides("kv_heads", "heads")
        self.check((self.hidden // self.heads) % 2 == 0, "head dim (hidden / heads) must be even for rotary embeddings")


PRESETS = {
    "llama-7b": dict(layers=32, hidden=4096, heads=32, ffn_hidden=11008),
    "llama-13b": dict(layers=40, hidden=5120, heads=40, ffn_hidden=13824),
    "llama-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672),
}


class LlamaBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg.hidden, cfg.heads, kv_heads=cfg.kv_heads, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), is_causal=True, rope=(cos, sin))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """``forward(input_ids [B, S], labels [B, S]) -> loss``; causal LM with shifted labels.
    The rotary tables are computed once here and passed to every block."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, input_ids, labels):
        cfg = self.config
        x = self.embed(input_ids)
        cos, sin = rotary_cos_sin(cfg.seq_len, cfg.hidden // cfg.heads, cfg.rope_theta, like=x)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return lm_loss(logits[:, :-1], labels[:, 1:])


Model = Llama
example_args = causal_lm_args
