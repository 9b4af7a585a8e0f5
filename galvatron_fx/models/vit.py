"""Vision Transformer family: patch embedding, cls token, learned positions, pre-LN blocks.

``vit-huge-{32,48}`` follow ViT-H/14 of Dosovitskiy et al. 2021 ("An Image is Worth 16x16
Words", Table 1: hidden 1280, MLP 5120, 16 heads, 32 layers) at 224x224 with 1000 classes;
the 48-layer variant is the Galvatron paper's deeper workload.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ._common import TransformerConfig, image_classification_args
from .layers import PreLNBlock


@dataclasses.dataclass
class Config(TransformerConfig):
    layers: int = 32
    hidden: int = 1280
    heads: int = 16
    image_size: int = 224
    patch: int = 14
    channels: int = 3
    num_classes: int = 1000

    def __post_init__(self):
        super().__post_init__()
        self.check_positive("image_size", "patch", "channels", "num_classes")
        self.check_divides("patch", "image_size")


PRESETS = {
    "vit-huge-32": dict(layers=32),
    "vit-huge-48": dict(layers=48),
}


def patchify(images: torch.Tensor, grid: int, patch: int) -> torch.Tensor:
    """``[B, C, grid*patch, grid*patch] -> [B, grid*grid, C*patch*patch]`` (row-major patches;
    the same flattening as a stride-``patch`` Conv2d's weight), from static sizes only."""
    x = images.unflatten(2, (grid, patch)).unflatten(4, (grid, patch))  # B, C, gh, p, gw, p
    return x.permute(0, 2, 4, 1, 3, 5).flatten(3).flatten(1, 2)


class ViT(nn.Module):
    """``forward(images [B, C, H, W], labels [B]) -> loss`` (classification on the cls token)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.grid = cfg.image_size // cfg.patch
        # A Linear over flattened patches is exactly the paper's stride-p convolution.
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch * cfg.patch, cfg.hidden)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid + 1, cfg.hidden))
        self.blocks = nn.ModuleList(PreLNBlock(cfg.hidden, cfg.heads, cfg.ffn_hidden, eps=1e-6)
                                    for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.head = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, images, labels):
        x = self.patch_embed(patchify(images, self.grid, self.config.patch))
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)[:, 0])
        return F.cross_entropy(logits.float(), labels)


Model = ViT
example_args = image_classification_args
