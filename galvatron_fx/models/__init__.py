"""Built-in model zoo: the Galvatron paper's workloads plus GPT-3 / LLaMA sizes and a tiny GPT.

::

    model, example_args = galvatron_fx.models.build("gpt3-175b")            # meta: no weight memory
    model, example_args = galvatron_fx.models.build("gpt-tiny", device="cpu", seed=0)
    loss = model(*example_args)                                             # scalar fp32 training loss

``example_args`` is a tuple passed positionally that includes the targets. Overrides change the
published hyper-parameters; the same key means the same thing in every family (``layers``,
``hidden``, ``heads``, ``kv_heads``, ``ffn_hidden``, ``seq_len``, ``vocab``, ``batch``,
``image_size``, ``patch``, ``num_classes``, ``window``, Swin's ``depths``; ``dtype`` everywhere).

Structure every model follows, for capture and layer grouping:

* repeated blocks live in ``nn.ModuleList`` attributes of one class each (``blocks``; Swin
  ``stages[i].blocks``; T5 ``encoder.blocks`` / ``decoder.blocks``);
* per-model constants (masks, position bias, rotary tables) are computed once above the blocks
  and passed to each block as arguments, so all blocks of a list run the same graph;
* every model traces with ``torch.fx`` (no leaf modules), ``torch.compile(fullgraph=True)`` and
  ``torch.export.export(strict=False)``;
* no model has buffers (constants are computed from static sizes in ``forward``), so a meta-built
  model materialises with ``model.to_empty(device=...)`` followed by :func:`init_weights`.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import nn

from ..errors import ConfigError
from . import bert, gpt, llama, swin, t5, vit
from .layers import init_weights

__all__ = ["build", "config", "init_weights", "names", "param_count"]

_FAMILIES = (gpt, llama, bert, vit, t5, swin)
_REGISTRY = {name: (family, preset) for family in _FAMILIES for name, preset in family.PRESETS.items()}

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def names() -> list[str]:
    """Every zoo name, in family order."""
    return list(_REGISTRY)


def _family(name: str):
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; valid names: {', '.join(names())}") from None


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ConfigError(f"unknown dtype {value!r}; use a torch.dtype or one of {', '.join(_DTYPES)}")


def config(name: str, **overrides):
    """The family config dataclass for ``name`` with ``overrides`` applied (``dtype`` excluded)."""
    family, preset = _family(name)
    valid = family.Config.keys()
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown override(s) {', '.join(unknown)} for {name!r}; valid keys: {', '.join(valid + ['dtype'])}"
        )
    try:
        return family.Config(**{**preset, **overrides})
    except TypeError as exc:  # e.g. a list where an int belongs
        raise ConfigError(f"bad override for {name!r}: {exc}") from None


def build(name: str, device="meta", seed: int = 0, **overrides) -> tuple[nn.Module, tuple]:
    """Build zoo model ``name`` and its example inputs.

    Args:
        name: one of :func:`names`.
        device: ``"meta"`` (default; allocates no parameter memory, inputs are meta tensors too)
            or a real device such as ``"cpu"``.
        seed: seeds weight init and example inputs; same seed, same model and inputs.
        overrides: hyper-parameter changes (see the module docstring); ``dtype`` (a torch dtype
            or ``"fp32" | "bf16" | "fp16"``) sets the parameter and float-input dtype, default fp32.

    Returns:
        ``(model, example_args)`` with ``model(*example_args)`` the scalar fp32 training loss.

    Raises:
        ConfigError: unknown name, unknown override key or inconsistent sizes.
    """
    dtype = _dtype(overrides.pop("dtype", torch.float32))
    family, _ = _family(name)
    cfg = config(name, **overrides)
    device = torch.device(device)
    materialised = device.type != "meta"
    # NOTE: fork_rng keeps the caller's global RNG untouched while making init a pure function
    # of `seed`.
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = family.Model(cfg)
        if materialised:
            init_weights(model)
    model = model.to(dtype)
    model.zoo_name = name
    generator = torch.Generator().manual_seed(seed + 1)
    example_args = family.example_args(cfg, device, generator, dtype)
    return model, tuple(example_args)


def param_count(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once); works on meta models."""
    return sum(p.numel() for p in model.parameters())


def load(spec: str, device: str = "meta", overrides: dict | None = None):
    """A ``MODEL`` argument (CLI, trainer) -> ``(model, example_args)``: a zoo name, a transformers
    ``config.json`` (or a directory holding one; :mod:`.hf_config`: keyword example inputs, ``seq_len``
    and ``batch`` overrides set their shape, others set config attributes) or
    ``package.module:factory``."""
    from .hf_config import config_path, from_config

    if config_path(spec):
        kw = dict(overrides or {})
        return from_config(spec, device=device, seq_len=kw.pop("seq_len", None), batch=int(kw.pop("batch", 8)),
                           **kw)
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot load model factory {spec!r}: {exc}") from None
        result = factory(**(overrides or {}))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ConfigError(f"model factory {spec!r} must return (model, example_inputs)")
        return result
    if spec.endswith(".json") or os.sep in spec or os.path.isdir(spec):   # meant as a file, not a zoo name
        if os.path.isdir(spec):
            raise ConfigError(f"{spec!r}: no config.json in this directory; point MODEL at a transformers "
                              "config.json, or its directory")
        raise ConfigError(f"{spec!r}: no such file; MODEL is a zoo name ({', '.join(names()[:3])}, ...), a "
                          "transformers config.json (or its directory) or package.module:factory")
    return build(spec, device=device, **(overrides or {}))
