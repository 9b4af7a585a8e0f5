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
