"""Swin Transformer family (Liu et al. 2021, "Swin Transformer: Hierarchical Vision Transformer
using Shifted Windows"): patch embedding, four stages of (shifted-)window attention blocks with
patch merging between stages, mean-pooled classification head.

``swin-huge-{32,48}`` are the Galvatron paper's Swin-Huge workloads: embed dim 320, depths
[2, 2, 26, 2] / [2, 2, 42, 2], heads [10, 20, 40, 80], window 7, patch 4, 224x224 images,
1000 classes, MLP ratio 4.

Capture notes: the window constants -- per stage the relative-position index, the additive
attention masks (all-zero for regular windows, the shifted-window mask) and the cyclic-shift
token permutations -- are computed from static sizes in ``Swin.forward`` before the first stage
(no buffers: a meta-built model needs nothing re-initialised) and passed to every block. The
cyclic shift is an ``index_select`` with a permutation (identity for regular blocks) instead of
``torch.roll``, so shifted and regular blocks trace to the same ops with the same argument
structure.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ZooConfig, image_classification_args
from .layers import MLP, Attention
from .vit import patchify


@dataclasses.dataclass
class Config(ZooConfig):
    depths: list = dataclasses.field(default_factory=lambda: [2, 2, 26, 2])
    hidden: int = 320  # embed dim of stage 0; doubles every stage
    heads: list = dataclasses.field(default_factory=lambda: [10, 20, 40, 80])
    window: int = 7
    patch: int = 4
    image_size: int = 224
    channels: int = 3
    num_classes: int = 1000
    mlp_ratio: int = 4

    def __post_init__(self):
        self.depths, self.heads = list(self.depths), list(self.heads)
        self.check_positive("hidden", "window", "patch", "image_size", "channels", "num_classes", "mlp_ratio", "batch")
        self.check(len(self.depths) == len(self.heads) and len(self.depths) > 0,
                   f"depths {self.depths} and heads {self.heads} need one entry per stage")
        self.check(all(isinstance(d, int) and d > 0 for d in self.depths), f"depths must be positive ints: {self.depths}")
        self.check_divides("patch", "image_size")
        for i, heads in enumerate(self.heads):
            dim, res = self.stage_dim(i), self.stage_resolution(i)
            self.check(dim % heads == 0, f"stage {i}: heads {heads} must divide dim {dim}")
            self.check(res > 0 and (i == 0 or (self.stage_resolution(i - 1) % 2 == 0)),
                       f"stage {i}: resolution must halve exactly (image_size / patch / 2**i)")
            self.check(res % self.stage_window(i) == 0,
                       f"stage {i}: window {self.stage_window(i)} must divide resolution {res}")

    def stage_dim(self, i: int) -> int:
        return self.hidden * 2 ** i

    def stage_resolution(self, i: int) -> int:
        return (self.image_size // self.patch) // 2 ** i

    def stage_window(self, i: int) -> int:
        # As in the reference code: a stage no larger than the window uses one unshifted window.
        return min(self.window, self.stage_resolution(i))


PRESETS = {
    "swin-huge-32": dict(depths=[2, 2, 26, 2]),
    "swin-huge-48": dict(depths=[2, 2, 42, 2]),
}


def relative_position_index(window: int, device=None) -> torch.Tensor:
    """``[N, N]`` (N = window**2) index into the ``(2*window-1)**2`` relative-bias table."""
    token = torch.arange(window * window, device=device)
    row, col = token // window, token % window
    rel_row = row[:, None] - row[None, :] + (window - 1)
    rel_col = col[:, None] - col[None, :] + (window - 1)
    return rel_row * (2 * window - 1) + rel_col


def shifted_window_mask(resolution: int, window: int, shift: int, device=None) -> torch.Tensor:
    """``[nW, 1, N, N]`` additive mask: -100 between tokens that come from different regions
    before the cyclic shift (all zeros for ``shift == 0``)."""
    n_win = resolution // window
    y = torch.arange(resolution, device=device)
    # Regions along one axis: [0, R-w), [R-w, R-s), [R-s, R) -- the reference's three slices.
    band = (y >= resolution - window).long() + (y >= resolution - shift).long()
    region = band[:, None] * 3 + band[None, :]
    ids = region.unflatten(0, (n_win, window)).unflatten(2, (n_win, window)).permute(0, 2, 1, 3).flatten(2).flatten(0, 1)
    diff = ids[:, None, :] - ids[:, :, None]
    return torch.where(diff != 0, -100.0, 0.0).unsqueeze(1)


def cyclic_shift_index(resolution: int, shift: int, device=None) -> torch.Tensor:
    """``[R*R]`` token permutation equal to ``torch.roll(-shift, -shift)`` on the ``R x R`` grid
    (``+shift`` for a negative ``shift``); the identity for ``shift == 0``."""
    grid = torch.arange(resolution * resolution, device=device).view(resolution, resolution)
    return grid.roll(shifts=(-shift, -shift), dims=(0, 1)).flatten()


def stage_constants(cfg: Config, i: int, like: torch.Tensor):
    """Per-stage inputs of the blocks, from static sizes: ``(rel_index, regular, shifted)`` where
    ``regular`` and ``shifted`` are ``(attn_mask, shift_in, shift_out)`` triples (``shifted`` is
    None when the stage does not shift). Every tensor is a distinct graph node, so regular and
    shifted blocks see the same argument structure."""
    res, window = cfg.stage_resolution(i), cfg.stage_window(i)
    shift = window // 2 if res > window else 0

    def triple(s):
        mask = shifted_window_mask(res, window, s, like.device).to(like.dtype)
        return mask, cyclic_shift_index(res, s, like.device), cyclic_shift_index(res, -s, like.device)

    return relative_position_index(window, like.device), triple(0), (triple(shift) if shift else None)


class SwinBlock(nn.Module):
    """Window attention block on ``[B, R*R, C]``. The cyclic shift is a token gather with
    ``shift_in`` / ``shift_out`` (identity permutations for a regular block), so shifted and
    regular blocks run the same ops; ``shift`` (0 or window // 2) only picks the stage inputs."""

    def __init__(self, dim: int, heads: int, resolution: int, window: int, shift: int, mlp_ratio: int):
        super().__init__()
        self.resolution, self.window, self.shift, self.heads = resolution, window, shift, heads
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.rel_bias = nn.Embedding((2 * window - 1) ** 2, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio * dim, act="gelu")

    def forward(self, x, attn_mask, rel_index, shift_in, shift_out):
        r, w = self.resolution, self.window
        n_win = r // w
        h = self.norm1(x).index_select(1, shift_in).unflatten(1, (r, r))
        # B, R, R, C -> B, nW, N, C
        h = h.unflatten(1, (n_win, w)).unflatten(3, (n_win, w)).permute(0, 1, 3, 2, 4, 5).flatten(3, 4).flatten(1, 2)
        bias = self.rel_bias(rel_index).permute(2, 0, 1)  # heads, N, N
        h = self.attn(h, attn_mask=attn_mask + bias)  # mask: nW, heads, N, N
        # B, nW, N, C -> B, R*R, C
        h = h.unflatten(1, (n_win, n_win)).unflatten(3, (w, w)).permute(0, 1, 3, 2, 4, 5).flatten(1, 4)
        x = x + h.index_select(1, shift_out)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """``[B, R*R, C] -> [B, (R/2)*(R/2), 2C]``: concat each 2x2 neighbourhood, LayerNorm, Linear."""

    def __init__(self, dim: int, resolution: int):
        super().__init__()
        self.resolution = resolution
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        half = self.resolution // 2
        x = x.unflatten(1, (half, 2, half, 2))  # B, R/2, dh, R/2, dw, C
        # Reference order of the four neighbours: (0,0), (1,0), (0,1), (1,1) -> dw major, dh minor.
        x = x.permute(0, 1, 3, 4, 2, 5).flatten(3).flatten(1, 2)
        return self.reduction(self.norm(x))


class Stage(nn.Module):
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        dim, res, window = cfg.stage_dim(i), cfg.stage_resolution(i), cfg.stage_window(i)
        shift = window // 2 if res > window else 0
        self.blocks = nn.ModuleList(
            SwinBlock(dim, cfg.heads[i], res, window, shift if j % 2 else 0, cfg.mlp_ratio) for j in range(cfg.depths[i])
        )
        self.downsample = PatchMerging(dim, res) if i + 1 < len(cfg.depths) else None

    def forward(self, x, rel_index, regular, shifted):
        for block in self.blocks:
            mask, shift_in, shift_out = shifted if block.shift else regular
            x = block(x, mask, rel_index, shift_in, shift_out)
        if self.downsample is not None:
            x = self.downsample(x)
        return x


class Swin(nn.Module):
    """``forward(images [B, C, H, W], labels [B]) -> loss``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch * cfg.patch, cfg.hidden)  # = stride-p conv
        self.patch_norm = nn.LayerNorm(cfg.hidden)
        self.stages = nn.ModuleList(Stage(cfg, i) for i in range(len(cfg.depths)))
        final_dim = cfg.stage_dim(len(cfg.depths) - 1)
        self.norm = nn.LayerNorm(final_dim)
        self.head = nn.Linear(final_dim, cfg.num_classes)

    def forward(self, images, labels):
        cfg = self.config
        x = self.patch_norm(self.patch_embed(patchify(images, cfg.image_size // cfg.patch, cfg.patch)))
        # NOTE: all window constants are built here, before the first stage, so they land in the
        # model's "pre" layer and every block receives them as plain inputs.
        constants = [stage_constants(cfg, i, x) for i in range(len(self.stages))]
        for stage, (rel_index, regular, shifted) in zip(self.stages, constants):
            x = stage(x, rel_index, regular, shifted)
        logits = self.head(self.norm(x).mean(dim=1))
        return F.cross_entropy(logits.float(), labels)


Model = Swin
example_args = image_classification_args
