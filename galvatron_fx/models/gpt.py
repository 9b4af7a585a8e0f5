"""GPT-3 family: pre-LN decoder, learned positions, GELU MLP, tied LM head, causal LM loss.

Presets follow Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
(n_layers, d_model, n_heads; n_ctx = 2048; GPT-2 BPE vocabulary of 50257; d_ff = 4 d_model).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ._common import TransformerConfig, causal_lm_args
from .layers import PreLNBlock, lm_loss


@dataclasses.dataclass
class Config(TransformerConfig):
    seq_len: int = 2048
    vocab: int = 50257
    tie_embeddings: bool = True  # GPT-2/3 share the token embedding with the LM head

    def __post_init__(self):
        super().__post_init__()
        self.check_positive("seq_len", "vocab")


PRESETS = {
    # Table 2.1 of the GPT-3 paper: (n_layers, d_model, n_heads).
    "gpt3-125m": dict(layers=12, hidden=768, heads=12),
    "gpt3-350m": dict(layers=24, hidden=1024, heads=16),
    # NOTE: the table lists 24 heads x d_head 128 for 1.3B, which does not multiply to
    # d_model = 2048; we keep d_head = 128 and use 16 heads (as Megatron-LM's 1.3B config does).
    "gpt3-1.3b": dict(layers=24, hidden=2048, heads=16),
    "gpt3-2.7b": dict(layers=32, hidden=2560, heads=32),
    "gpt3-6.7b": dict(layers=32, hidden=4096, heads=32),
    # NOTE: the table lists d_model = 5140 for 13B, not divisible by its 40 heads; 5120 = 40 x 128
    # is the value every reimplementation uses.
    "gpt3-13b": dict(layers=40, hidden=5120, heads=40),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96),
    # Small enough for a forward+backward in well under a second on one CPU core. Untied head so
    # that every weight lives in exactly one layer (simplest case for pipeline tests).
    "gpt-tiny": dict(layers=4, hidden=64, heads=4, seq_len=32, vocab=128, tie_embeddings=False),
}


class GPT(nn.Module):
    """``forward(input_ids [B, S], labels [B, S]) -> loss``; position ``t`` predicts ``labels[t+1]``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(
            PreLNBlock(cfg.hidden, cfg.heads, cfg.ffn_hidden, act="gelu_tanh") for _ in range(cfg.layers)
        )
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, labels):
        positions = torch.arange(self.config.seq_len, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x, is_causal=True)
        logits = self.lm_head(self.ln_f(x))
        return lm_loss(logits[:, :-1], labels[:, 1:])


Model = GPT
example_args = causal_lm_args
