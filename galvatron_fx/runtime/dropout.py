"""Dropout that follows the step: active in ``train_step``, off in ``eval_step``.

A graph captured in training mode bakes ``dropout(x, p, training=True)``; the normalise pass makes
every such node call :func:`dropout`, which drops only while :data:`MODE` says the program trains
(``DistributedModel.eval_step`` switches it off for its forward, as ``model.eval()`` does eagerly;
the torch.compile door evaluates under ``model.eval()`` / ``torch.no_grad()``). A graph captured in
eval mode (``training=False`` baked) never drops.
"""

from __future__ import annotations

import contextlib

import torch


class _Mode:
    training = True


MODE = _Mode()


def dropout(x: torch.Tensor, p: float = 0.5, train: bool = True) -> torch.Tensor:
    """``torch.nn.functional.dropout`` when both the captured call and the current step train."""
    return torch.nn.functional.dropout(x, p, training=bool(train) and MODE.training)


@contextlib.contextmanager
def evaluating():
    """Dropout off for the duration (nested calls restore the outer state)."""
    before, MODE.training = MODE.training, False
    try:
        yield
    finally:
        MODE.training = before


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 **kwargs) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` whose attention dropout follows the step
    (transformers passes ``dropout_p`` only in training mode: a graph captured then bakes it in)."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p if MODE.training else 0.0, is_causal, **kwargs)
