"""A transformers Llama built on the meta device from a small config, captured as users call it
(keyword inputs, labels): the tests that price a real architecture without weights or downloads."""

from __future__ import annotations

import pytest
import torch

import galvatron_fx as gfx


def meta_llama(seq: int, batch: int = 1, method: str | None = None, **config):
    """The captured graph of ``LlamaForCausalLM(LlamaConfig(**config))`` with SDPA attention on the
    meta device, for ``batch`` sequences of ``seq`` tokens (``method``: the capture front end)."""
    pytest.importorskip("transformers")
    import transformers as tf

    cfg = tf.LlamaConfig(use_cache=False, **config)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    kwargs = {} if method is None else {"method": method}
    return gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), **kwargs)
