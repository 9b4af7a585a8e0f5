"""Memory rules: model states (parameters, gradients, optimizer states) per device, in bytes.

For a layer whose parameters have ``sharded`` elements TP splits (linear weights, column-parallel
biases, vocab-parallel embeddings) and ``replicated`` elements it keeps whole (norms, row-parallel
biases), one device holds ``n = ceil(sharded / tp) + replicated`` elements of each state, then:

========================  ===========================  ==========================================
state                     plain (``mixed=False``)       mixed precision (``mixed=True``)
========================  ===========================  ==========================================
parameters                ``n * w``                     ``n * w`` (low-precision working copy)
gradients                 ``n * w``                     ``n * w``
optimizer states          ``k * n * w``                 ``4 n`` (fp32 master copy) ``+ k * 4 n``
========================  ===========================  ==========================================

``w`` is the training dtype's itemsize and ``k`` the optimizer's states per parameter (Adam 2:
first and second moments; SGD with momentum 1; SGD 0). By plan precision: ``"fp32"`` is plain with
``w = 4`` (Adam: 4 + 4 + 8 = 16 bytes per parameter); ``"bf16-mixed"`` / ``"fp16-mixed"`` are mixed
with ``w = 2`` (Adam: 2 + 2 + (4 + 8) = 16 bytes per parameter: a 2-byte working copy the layers
compute with, 2-byte gradients as they are reduced, and in the optimizer state the fp32 master
copy and the fp32 moments it updates). These are the buffers the runtime holds (the fp32 path is
checked byte for byte by tests/test_memory_equality_dist.py; a mixed-precision runtime holds the same). The runtime keeps each layer's ``n``
elements in one flat buffer padded to a multiple of ``dp`` (:func:`flat_layout`, shared with
:mod:`galvatron_fx.runtime.data_parallel`); plain DP holds the padded buffer, ZeRO-2 the padded
parameters but a ``1/dp`` shard of gradients and optimizer states, ZeRO-3 a shard of all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..runtime.data_parallel import flat_layout  # NOTE: the runtime owns its buffer layout; costed alike
from ..solver.strategy import Strategy

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}


@dataclass(frozen=True)
class StatesBytes:
    """Per-device bytes of one layer's model states."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def optimizer_states(optimizer: str) -> int:
    """States per parameter of ``optimizer`` (see :data:`OPTIMIZER_STATES`)."""
    try:
        return OPTIMIZER_STATES[optimizer.lower()]
    except KeyError:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}") from None


def per_tp_elements(sharded: int, replicated: int, tp: int) -> int:
    """Parameter elements one device of a TP group holds."""
    return math.ceil(sharded / tp) + replicated


def states_bytes(sharded: int, replicated: int, strategy: Strategy, *, itemsize: int,
                 mixed_precision: bool = False, optimizer: str = "adam") -> StatesBytes:
    """Per-device bytes of parameters, gradients and optimizer states (module docstring)."""
    padded, shard = flat_layout(per_tp_elements(sharded, replicated, strategy.tp), strategy.dp)
    held = {"none": (padded, padded, padded), "zero2": (padded, shard, shard),
            "zero3": (shard, shard, shard)}[strategy.sdp]  # elements of params, grads, optimizer
    k = optimizer_states(optimizer)
    opt = (4 + 4 * k) * held[2] if mixed_precision else k * held[2] * itemsize
    return StatesBytes(held[0] * itemsize, held[1] * itemsize, opt)
