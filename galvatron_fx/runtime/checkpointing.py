"""Activation checkpointing of whole layer submodules."""

from __future__ import annotations

import torch.utils.checkpoint


def checkpoint_layer(layer, *args):
    """Run ``layer(*args)`` keeping only its inputs; its activations are recomputed in backward.

    NOTE: non-reentrant checkpointing (``use_reentrant=False``) is the one that supports inputs
    which do not require grad, keyword-free calls from fx code and nested autograd Functions.
    Without early stop: torch stops a recomputation early by raising an exception through the
    layer, and a ``GraphModule`` layer turns every such exception into a traceback extraction
    (torch.fx's ``_WrappedCall``), ~80 us per layer call here; recomputing the layer's last ops
    instead costs less (measured: docs/measurements.md, "Figures behind the design").
    """
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, early_stop=False)
