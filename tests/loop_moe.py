"""A tiny decoder whose mixture-of-experts layers loop over an ``nn.ModuleList`` of experts (the
form transformers 4.x Mixtral and most research code write), for the loop-form MoE tests."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tests import loops

H, FF, E, K = 16, 32, 4, 2   # hidden, expert width, experts, top-k


class Output(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class Expert(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` (Mixtral's expert MLP)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, FF, bias=False), nn.Linear(H, FF, bias=False)
        self.w2 = nn.Linear(FF, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """Top-``K`` routing over ``E`` experts, one iteration per expert (``torch.where`` on its mask)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(E)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        w, selected = torch.topk(w, K, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            idx, top_x = torch.where(mask[e])
            y = self.experts[e](x[top_x]) * w[top_x, idx, None]
            out.index_add_(0, top_x, y.to(x.dtype))
        return out.view(b, s, h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.moe = LoopMoE()

    def forward(self, x):
        return x + self.moe(self.norm(x))


class LoopMoEModel(nn.Module):
    """Embedding, ``layers`` residual loop-MoE blocks, a norm and a head; ``.loss`` from ``labels``
    (-100: ignored), keyword inputs as a causal LM's."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(loops.V, H)
        self.layers = nn.ModuleList([Block() for _ in range(layers)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, loops.V)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return Output(loss, logits)


def build(seed: int = 0) -> LoopMoEModel:
    torch.manual_seed(seed)
    return LoopMoEModel()
