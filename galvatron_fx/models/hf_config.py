"""A transformers ``config.json`` as a ``MODEL``: what a transformers user has on disk.

    model, inputs = from_config("llama-tiny/config.json", device="meta", seq_len=2048, batch=8)

``from_config`` reads the config offline (``AutoConfig.from_pretrained`` on the file's directory),
builds the model with ``AutoModelForCausalLM.from_config`` (``AutoModelForSeq2SeqLM`` for
encoder-decoders, ``AutoModelForMaskedLM`` for encoder-only configs) on ``device`` (``meta``: no
weight memory, for planning) and returns keyword example inputs ``input_ids`` / ``labels`` of
``batch x seq_len`` tokens, as a training loop calls the model. The KV cache is turned off
(``use_cache=False``): training never reads it. Attention is transformers' SDPA path (as the model
runs on a GPU; eager where the architecture has none or the config names another), so the cost
model prices the fused kernel the device would pick.
"""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError

CONFIG_NAME = "config.json"
DEFAULT_SEQ_LEN = 128


def config_path(spec: str) -> str | None:
    """The ``config.json`` a ``MODEL`` argument names (the file, or a directory holding one), else None."""
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, CONFIG_NAME)):
        return os.path.join(spec, CONFIG_NAME)
    if spec.endswith(".json") and os.path.isfile(spec):
        return spec
    return None


def load_config(path: str):
    """The transformers config of ``path`` (a ``config.json`` or its directory), read offline."""
    try:
        import transformers
    except ImportError:   # pragma: no cover - transformers is a test dependency
        raise ConfigError("a config.json MODEL needs the transformers package: pip install transformers") from None
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise their own classes
        raise ConfigError(f"{path}: transformers rejects this config: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """transformers' own message in one line: the innermost cause's last non-empty line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def model_class(config):
    """The ``AutoModelFor...`` class that trains ``config`` with a loss from ``labels``: seq2seq for
    encoder-decoders, masked LM for encoder-only text models, image classification for vision
    encoders, else causal LM."""
    import transformers

    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    archs = " ".join(getattr(config, "architectures", None) or [])
    if "ImageClassification" in archs or (not archs and hasattr(config, "image_size") and hasattr(config, "patch_size")
                                           and not hasattr(config, "vocab_size")):
        return transformers.AutoModelForImageClassification
    if "MaskedLM" in archs or (not archs and getattr(config, "model_type", "") in ("bert", "roberta", "distilbert")):
        return transformers.AutoModelForMaskedLM
    return transformers.AutoModelForCausalLM


def _build(cls, config):
    """The model with the attention a GPU runs it with: SDPA (flash / memory-efficient kernels,
    priced as such: :mod:`galvatron_fx.cost.attention_kernels`) unless the config names an
    implementation or the architecture has no SDPA path (then transformers' default, eager)."""
    if getattr(config, "_attn_implementation_internal", None) is None:
        try:
            return cls.from_config(config, attn_implementation="sdpa")
        except (ValueError, ImportError):   # no SDPA path for this architecture
            pass
    return cls.from_config(config)


def from_config(spec: str, device: str = "meta", seq_len: int | None = None, batch: int = 8,
                seed: int = 0, **overrides):
    """``(model, {"input_ids", "labels"})`` for the config at ``spec`` (module docstring);
    ``overrides`` set config attributes (``--set num_hidden_layers=2``)."""
    path = config_path(spec) or spec
    config = load_config(path)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConfigError(f"{path}: the config has no attribute {key!r} to override")
        setattr(config, key, value)
    config.use_cache = False
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = int(seq_len or min(DEFAULT_SEQ_LEN, limit or DEFAULT_SEQ_LEN))
    if limit and seq > limit:
        raise ConfigError(f"--seq-len {seq} exceeds the config's max_position_embeddings={limit}")
    cls = model_class(config)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = _build(cls, config)
    except ValueError as exc:   # no such model class for this config
        raise ConfigError(f"{path}: cannot build a model for model_type {getattr(config, 'model_type', '?')!r} "
                          f"with {cls.__name__}: {_reason(exc)[:200]}") from None
    g = torch.Generator().manual_seed(seed + 1)
    if cls.__name__ == "AutoModelForImageClassification":
        size, channels = int(config.image_size), int(getattr(config, "num_channels", 3))
        pixels = torch.randn(batch, channels, size, size, generator=g).to(device)
        labels = torch.randint(0, int(config.num_labels), (batch,), generator=g).to(device)
        return model, {"pixel_values": pixels, "labels": labels}
    vocab = int(config.vocab_size)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    return model, {"input_ids": ids, "labels": ids}


SIZE_FIELDS = ("vocab_size", "hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "d_ff",
               "num_hidden_layers", "n_layer", "num_layers", "num_attention_heads", "n_head", "num_heads",
               "num_key_value_heads", "max_position_embeddings", "n_positions")


def defaulted_sizes(path: str) -> list[str]:
    """``"hidden_size 4096"`` for each size field the model uses that ``path``'s JSON leaves to the
    transformers class's default (a config holding only ``num_hidden_layers`` plans a model of the
    defaults' size: the planner says so)."""
    import json

    cfg = load_config(path)
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    with open(file) as f:
        given = set(json.load(f))
    aliases = getattr(cfg, "attribute_map", {}) or {}
    given |= {target for alias, target in aliases.items() if alias in given}
    given |= {alias for alias, target in aliases.items() if target in given}
    out = []
    for name in SIZE_FIELDS:
        value = cfg.__dict__.get(name)
        if isinstance(value, int) and name not in given:
            out.append(f"{name} {value}")
    return out
