"""Config plumbing shared by the zoo families: the config base class, validation and example inputs."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import ConfigError


@dataclasses.dataclass
class ZooConfig:
    """Base of every family config. Field names are the override keys accepted by
    ``galvatron_fx.models.build`` (plus ``dtype``); sizes are element counts, never bytes."""

    batch: int = 8

    @classmethod
    def keys(cls) -> list[str]:
        return sorted(f.name for f in dataclasses.fields(cls))

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(f"{type(self).__module__.rsplit('.', 1)[-1]} config: {message} (config: {self})")

    def check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            self.check(isinstance(value, int) and value > 0, f"{name} must be a positive int, got {value!r}")

    def check_divides(self, a: str, b: str) -> None:
        self.check(getattr(self, b) % getattr(self, a) == 0, f"{a}={getattr(self, a)} must divide {b}={getattr(self, b)}")


@dataclasses.dataclass
class TransformerConfig(ZooConfig):
    """Sizes every transformer family shares; ``ffn_hidden=None`` means ``4 * hidden``."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ffn_hidden: int | None = None

    def __post_init__(self):
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden
        self.check_positive("batch", "layers", "hidden", "heads", "ffn_hidden")
        self.check_divides("heads", "hidden")


def random_ints(shape, high: int, device, generator: torch.Generator) -> torch.Tensor:
    """Uniform int64 tensor in ``[0, high)``; on the meta device an uninitialised meta tensor."""
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=torch.long, device="meta")
    return torch.randint(0, high, shape, generator=generator).to(device)


def random_floats(shape, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """Standard-normal tensor (e.g. images); on the meta device an uninitialised meta tensor."""
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def causal_lm_args(cfg, device, generator, dtype):
    """``(input_ids, labels)`` for a causal LM: labels are the inputs (the model shifts them)."""
    ids = random_ints((cfg.batch, cfg.seq_len), cfg.vocab, device, generator)
    return ids, ids.clone()


def image_classification_args(cfg, device, generator, dtype):
    """``(images [B, C, H, W] in dtype, labels [B])``."""
    return (
        random_floats((cfg.batch, cfg.channels, cfg.image_size, cfg.image_size), dtype, device, generator),
        random_ints((cfg.batch,), cfg.num_classes, device, generator),
    )
