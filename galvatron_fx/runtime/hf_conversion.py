"""transformers' checkpoint conversions for :func:`.materialize.load_pretrained`.

transformers 5.x keeps some weights in another layout than its files: a mixture of experts holds
its experts as one ``[E, ...]`` tensor per projection (``mlp.experts.gate_up_proj``) while
``save_pretrained`` (and the hub) write one tensor per expert
(``block_sparse_moe.experts.3.w1.weight``), converted on load by the model's
``WeightRenaming`` / ``WeightConverter`` list (``transformers.conversion_mapping``). This module
applies that same list to a directory's keys: :func:`conversions` maps each model parameter name to
the file keys it is built from, :func:`load_converted` builds one parameter (its whole tensor: the
per-expert pieces of one layer, read one layer at a time) with transformers' own operations.
Models without a conversion list (and transformers 4.x) get an empty mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Converted:
    """How parameter ``target`` is built: the converter and, per source pattern, its file keys."""

    target: str
    converter: object
    sources: dict[str, list[str]] = field(default_factory=dict)


def conversions(model, file_keys) -> tuple[dict[str, str], dict[str, Converted]]:
    """``(renamed, converted)`` for ``model`` and a directory's ``file_keys``: ``renamed`` maps a
    parameter name to the one file key holding it under another name; ``converted`` a parameter
    name to the pieces :func:`load_converted` joins. Empty without a conversion list."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    except ImportError:
        return {}, {}
    try:
        transforms = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - not a transformers model: nothing to convert
        return {}, {}
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    renamed: dict[str, str] = {}
    converted: dict[str, Converted] = {}
    for key in sorted(file_keys, key=dot_natural_key):   # experts 0, 1, ..., 10 in order
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            if target != key:
                renamed[target] = key
            continue
        conv = next(c for c in converters if pattern in c.source_patterns)
        entry = converted.setdefault(target, Converted(target, conv))
        entry.sources.setdefault(pattern, []).append(key)
    return renamed, converted


def load_converted(entry: Converted, read, model) -> torch.Tensor:
    """Parameter ``entry.target`` as one tensor: its file keys read with ``read(key)``, passed
    through the converter's operations (e.g. stack the experts, concatenate gate and up)."""
    conv = entry.converter
    tensors = {p: [read(k) for k in entry.sources.get(p, [])] for p in conv.source_patterns}
    for op in conv.operations:
        tensors = op.convert(tensors, source_patterns=conv.source_patterns, target_patterns=conv.target_patterns,
                             full_layer_name=entry.target, model=model, config=getattr(model, "config", None),
                             missing_keys=None)
    values = list(tensors.values())
    if len(values) != 1:
        raise ValueError(f"{entry.target}: the checkpoint conversion gave {len(values)} tensors, expected one")
    value = values[0]
    return value[0] if isinstance(value, list) and len(value) == 1 else value
