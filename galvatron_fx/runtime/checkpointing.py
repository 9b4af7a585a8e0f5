"""Activation checkpointing of whole layer submodules."""

from __future__ import annotations

import torch.utils.checkpoint


def checkpoint_layer(layer, *args):
    """Run ``layer(*args)`` keeping only its inputs; its activations are recomputed in backward.

    NOTE: non-reentrant checkpointing (``use_reentrant=False``) is the one that supports inputs
    which do not require grad, keyword-free calls from fx code and nested autograd Functions;
    it also stops recomputing as soon as every needed activation is back (early stop).
    """
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
