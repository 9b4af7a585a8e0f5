"""transformers models captured as they run on a GPU: eager's mask decisions, fused GELU.

:func:`hf_capture` wraps every capture front end. It does two things, each a no-op for models that
are not transformers':

**Masks decided as eager decides them.**

A transformers model run eagerly with SDPA and no padding skips its causal mask: it passes
``attn_mask=None, is_causal=True`` (and ``enable_gqa=True`` for grouped key / value heads), so the
device runs a fused kernel (flash or memory-efficient attention) that stores O(S) per head. Under a
tracer the same code keeps the mask, for reasons that do not hold for a training graph:

* ``find_packed_sequence_indices`` cannot read the position ids under a tracer, so it keeps a
  "packed sequences" mask even when the positions are the model's own ``arange`` (never packed);
* ``_ignore_causal_mask_sdpa`` refuses to skip under ``torch.export`` (a graph exported at one
  length might later be called at another; a captured training graph is specialised to its
  sequence length anyway).

The traced graph then materialises a ``[b, 1, S, S]`` boolean mask, SDPA converts it into an
additive ``[b, 1, S, S]`` tensor in the compute dtype and saves it for backward in every layer, and
the kernels that take no mask (flash) are ruled out: at 128k tokens that is 32 GiB per sample and
layer, which the model would not hold when run eagerly. :func:`eager_mask_decisions` makes the
traced run take eager's decision where eager's decision does not depend on data:

* when the caller passes no ``position_ids`` the positions are the model's own ``arange``, which
  eager finds unpacked: the packed-sequence detection returns None;
* the export front end decides as dynamo does (a padding mask given as an input is still never
  read, so a graph taking ``attention_mask`` keeps the mask, as eager keeps it for padded batches).

Explicit masks a model computes from its inputs (padding, sliding windows, position biases) stay as
written, and so does attention a model writes itself (an explicit softmax).

**The tanh GELU as one op.** transformers' ``gelu_new`` (GPT-2, GPT-J, CodeGen...) writes the tanh
approximation of GELU in Python: eight element-wise ops, three of whose results autograd saves (the
tanh, ``0.5 x`` and ``1 + tanh``: 24 bytes per hidden unit of the MLP in bf16 beyond the input, 62 h
bytes per token per GPT-2 layer where Korthikanti et al. count 34 h). transformers' own
``gelu_pytorch_tanh`` is the same function as one ``torch.nn.functional.gelu(x, approximate="tanh")``
("a faster implementation of gelu_new"), and on a GPU transformers swaps in a fused hub kernel for it
(``use_kernel_forward_from_hub("NewGELU")``). Capture records that one op: it saves only its input,
and its values match the Python form to rounding (fp32: ~1e-7 relative).
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def hf_capture(kwargs: dict):
    """While capturing a model called with ``kwargs``: eager's mask decisions and the fused tanh
    GELU (module docstring)."""
    with eager_mask_decisions(kwargs), fused_tanh_gelu():
        yield


@contextlib.contextmanager
def fused_tanh_gelu():
    """transformers' ``NewGELUActivation`` runs as ``F.gelu(x, approximate="tanh")`` (module
    docstring). A no-op when transformers is not imported."""
    acts = sys.modules.get("transformers.activations")
    cls = getattr(acts, "NewGELUActivation", None)
    if cls is None:
        yield
        return
    saved = cls.forward
    cls.forward = _tanh_gelu
    try:
        yield
    finally:
        cls.forward = saved


def _tanh_gelu(self, input):
    import torch.nn.functional as F

    return F.gelu(input, approximate="tanh")


@contextlib.contextmanager
def eager_mask_decisions(kwargs: dict):
    """While capturing a transformers model called with ``kwargs``: take eager's mask decisions
    (module docstring). A no-op when transformers is not imported or lacks these functions."""
    mu = sys.modules.get("transformers.masking_utils")
    patches = {}
    if mu is not None:
        if "position_ids" not in kwargs and hasattr(mu, "find_packed_sequence_indices"):
            patches["find_packed_sequence_indices"] = _unpacked
        if hasattr(mu, "is_torchdynamo_exporting"):
            patches["is_torchdynamo_exporting"] = _not_exporting
    saved = {name: getattr(mu, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(mu, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(mu, name, fn)


def _unpacked(position_ids):
    """The model's own positions (``arange``): one sequence per row, as eager finds them."""
    return None


def _not_exporting() -> bool:
    return False
