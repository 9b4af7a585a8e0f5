"""Small hand-written models for capture and grouping tests (the zoo has the real workloads)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ToyLM(nn.Module):
    """Embedding, ``n`` identical blocks, a tied head and a loss; a buffer at model level."""

    def __init__(self, n: int = 3, d: int = 16, vocab: int = 32, tied: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, ids, targets):
        x = self.emb(ids) * self.scale
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class CrossBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.self_proj = nn.Linear(d, d)
        self.cross_proj = nn.Linear(d, d)

    def forward(self, x, memory):
        x = x + torch.tanh(self.self_proj(x))
        return x + self.cross_proj(memory) * 0.1


class ToyEncDec(nn.Module):
    """Two block lists; the encoder output is read by every decoder block (T5-like)."""

    def __init__(self, n_enc: int = 2, n_dec: int = 2, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.encoder = nn.ModuleList([Block(d) for _ in range(n_enc)])
        self.enc_norm = nn.LayerNorm(d)
        self.decoder = nn.ModuleList([CrossBlock(d) for _ in range(n_dec)])
        self.head = nn.Linear(d, vocab)

    def forward(self, src, tgt, targets):
        h = self.emb(src)
        for blk in self.encoder:
            h = blk(h)
        memory = self.enc_norm(h)
        y = self.emb(tgt)
        for blk in self.decoder:
            y = blk(y, memory)
        return F.cross_entropy(self.head(y).flatten(0, 1), targets.flatten())


def toy_inputs(batch: int = 2, seq: int = 5, vocab: int = 32, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    tgt = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids.to(device), tgt.to(device)
