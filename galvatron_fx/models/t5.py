"""T5 encoder-decoder family (T5 v1.0 layout).

``t5-large-{32,48}`` use T5-Large's widths from Raffel et al. 2020 ("Exploring the Limits of
Transfer Learning", Sec. 3.7: d_model 1024, d_ff 4096, d_kv 64, 16 heads, vocab 32128) with the
Galvatron paper's total depths, split evenly: 16+16 / 24+24 layers. RMS-style T5 layer norm, no
biases, ReLU feed-forward, unscaled attention logits, bucketed relative position bias (32
buckets, max distance 128) computed ONCE per stack and passed to every block, decoder
cross-attention to the encoder output, LM head tied to the shared embedding (scaled by
d_model**-0.5).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ._common import TransformerConfig, random_ints
from .layers import MLP, Attention, RMSNorm, lm_loss


@dataclasses.dataclass
class Config(TransformerConfig):
    layers: int = 32  # total: half encoder, half decoder
    hidden: int = 1024
    heads: int = 16
    ffn_hidden: int = 4096
    seq_len: int = 512  # encoder length
    tgt_len: int | None = None  # decoder length; default seq_len
    vocab: int = 32128
    num_buckets: int = 32
    max_distance: int = 128

    def __post_init__(self):
        super().__post_init__()
        if self.tgt_len is None:
            self.tgt_len = self.seq_len
        self.check_positive("seq_len", "tgt_len", "vocab")
        self.check(self.layers % 2 == 0, f"layers (encoder + decoder total) must be even, got {self.layers}")


PRESETS = {
    "t5-large-32": dict(layers=32),
    "t5-large-48": dict(layers=48),
}


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucketing of ``key - query`` offsets (Mesh TensorFlow ``_relative_position_bucket``)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class T5EncoderBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads, bias=False, scale=1.0)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn_hidden, act="relu", bias=False)

    def forward(self, x, position_bias):
        x = x + self.attn(self.attn_norm(x), attn_mask=position_bias)
        return x + self.mlp(self.mlp_norm(x))


class T5DecoderBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads, bias=False, scale=1.0)
        self.cross_norm = RMSNorm(cfg.hidden)
        self.cross_attn = Attention(cfg.hidden, cfg.heads, bias=False, scale=1.0)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn_hidden, act="relu", bias=False)

    def forward(self, x, position_bias, encoder_out):
        x = x + self.attn(self.attn_norm(x), attn_mask=position_bias)
        x = x + self.cross_attn(self.cross_norm(x), context=encoder_out)
        return x + self.mlp(self.mlp_norm(x))


class T5Stack(nn.Module):
    """Encoder (``causal=False``) or decoder stack. Owns the relative-attention-bias table,
    computes the ``[1, heads, S, S]`` bias (plus the causal mask for the decoder) once and hands
    it to every block."""

    def __init__(self, cfg: Config, causal: bool):
        super().__init__()
        self.config = cfg
        self.causal = causal
        self.length = cfg.tgt_len if causal else cfg.seq_len
        self.rel_bias = nn.Embedding(cfg.num_buckets, cfg.heads)
        block_cls = T5DecoderBlock if causal else T5EncoderBlock
        self.blocks = nn.ModuleList(block_cls(cfg) for _ in range(cfg.layers // 2))
        self.final_norm = RMSNorm(cfg.hidden)

    def position_bias(self, like: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(self.length, device=like.device)
        relative = positions[None, :] - positions[:, None]  # key - query
        buckets = relative_position_bucket(relative, not self.causal, self.config.num_buckets,
                                           self.config.max_distance)
        bias = self.rel_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # 1, heads, S, S
        if self.causal:
            bias = bias.masked_fill(relative > 0, float("-inf"))
        return bias.to(like.dtype)

    def forward(self, x, encoder_out=None):
        bias = self.position_bias(x)
        for block in self.blocks:
            x = block(x, bias) if encoder_out is None else block(x, bias, encoder_out)
        return self.final_norm(x)


class T5(nn.Module):
    """``forward(input_ids [B, S], labels [B, T]) -> loss``; the decoder reads ``labels`` shifted
    right by one (start token 0), teacher forcing."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab, cfg.hidden)
        self.encoder = T5Stack(cfg, causal=False)
        self.decoder = T5Stack(cfg, causal=True)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.shared.weight

    def forward(self, input_ids, labels):
        encoder_out = self.encoder(self.shared(input_ids))
        decoder_ids = F.pad(labels[:, :-1], (1, 0), value=0)
        h = self.decoder(self.shared(decoder_ids), encoder_out)
        logits = self.lm_head(h * self.config.hidden ** -0.5)
        return lm_loss(logits, labels)


Model = T5


def example_args(cfg: Config, device, generator, dtype):
    return (
        random_ints((cfg.batch, cfg.seq_len), cfg.vocab, device, generator),
        random_ints((cfg.batch, cfg.tgt_len), cfg.vocab, device, generator),
    )
