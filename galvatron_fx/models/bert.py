"""BERT encoder family: post-LN blocks, learned positions, MLM head tied to the word embeddings.

``bert-huge-{32,48}`` are the Galvatron paper's (Miao et al., VLDB 2023) BERT-Huge workloads:
hidden 1280, 16 heads, ffn 4x, sequence 512, 32 / 48 layers, on the BERT vocabulary of 30522
(Devlin et al. 2019). The loss is a masked-LM style cross-entropy over the vocabulary at every
position (targets supplied), with no ignored positions so micro-batch means add up exactly.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ._common import TransformerConfig, random_ints
from .layers import MLP, Attention, lm_loss


@dataclasses.dataclass
class Config(TransformerConfig):
    layers: int = 32
    hidden: int = 1280
    heads: int = 16
    seq_len: int = 512
    vocab: int = 30522
    norm_eps: float = 1e-12

    def __post_init__(self):
        super().__post_init__()
        self.check_positive("seq_len", "vocab")


PRESETS = {
    "bert-huge-32": dict(layers=32),
    "bert-huge-48": dict(layers=48),
}


class BertBlock(nn.Module):
    """Post-LN encoder block: ``ln1(x + attn(x))``, ``ln2(x + mlp(x))``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.attn = Attention(cfg.hidden, cfg.heads)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.hidden, cfg.ffn_hidden, act="gelu")
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class Bert(nn.Module):
    """``forward(input_ids [B, S], labels [B, S]) -> loss`` (MLM cross-entropy, every position)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.word_embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embed = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.embed_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.blocks = nn.ModuleList(BertBlock(cfg) for _ in range(cfg.layers))
        # MLM prediction head (BertLMPredictionHead): transform, then decoder tied to word_embed.
        self.head_dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.head_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab)
        self.decoder.weight = self.word_embed.weight

    def forward(self, input_ids, labels):
        positions = torch.arange(self.config.seq_len, device=input_ids.device)
        x = self.embed_norm(self.word_embed(input_ids) + self.pos_embed(positions))
        for block in self.blocks:
            x = block(x)
        h = self.head_norm(F.gelu(self.head_dense(x)))
        return lm_loss(self.decoder(h), labels)


Model = Bert


def example_args(cfg: Config, device, generator, dtype):
    return (
        random_ints((cfg.batch, cfg.seq_len), cfg.vocab, device, generator),
        random_ints((cfg.batch, cfg.seq_len), cfg.vocab, device, generator),
    )
