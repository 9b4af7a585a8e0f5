"""Memory rules: model states (parameters, gradients, optimizer states, masters) per device, in bytes.

For a layer whose parameters have ``sharded`` elements TP splits (linear weights, column-parallel
biases, vocab-parallel embeddings) and ``replicated`` elements it keeps whole (norms, row-parallel
biases), one device holds ``n = ceil(sharded / tp) + replicated`` elements of each state. The
runtime keeps them in one flat buffer per layer in which every parameter is padded along dim 0 to a
multiple of ``dp`` rows (:func:`~galvatron_fx.runtime.zero_layout.zero_layout`, the same function
the runtime lays its buffers out with, given the TP-local parameter shapes): ``P`` padded elements,
a ``S = P / dp`` shard per rank (each parameter's dim-0 slice). Without the shapes (element counts
only) the layer counts as one 1-D parameter of ``n`` elements. With ``k`` optimizer states per
parameter (Adam 2: first and second moments; SGD with momentum 1; SGD 0), per device:

=============  ==========  ==========  ==========  ===========================================
state          DP          ZeRO-2      ZeRO-3
=============  ==========  ==========  ==========  ===========================================
fp32 (``w = 4``, the parameters are their own masters)
-------------------------------------------------------------------------------------------------
params         ``4 P``     ``4(P+S)``  ``4 S``     the buffer the layer reads (ZeRO-2: whole,
                                                   plus its shard, a copy; ``4 P`` at dp = 1)
grads          ``4 P``     ``4 S``     ``4 S``
optimizer      ``4 k N``   ``4 k H``   ``4 k H``
-------------  ----------  ----------  ----------  -------------------------------------------
bf16-mixed / fp16-mixed (working copy in 2 bytes, fp32 masters, fp32 gradients)
-------------------------------------------------------------------------------------------------
params         ``2 P``     ``2 P``     0           the low-precision working copy at rest
                                                   (ZeRO-3 gathers it per use: a transient)
masters        ``4 P``     ``4 S``     ``4 S``     fp32, what the user's parameters view
grads          ``4 P``     ``4 S``     ``4 S``     fp32 (accumulated and reduced in fp32)
optimizer      ``4 k N``   ``4 k H``   ``4 k H``   fp32 moments
=============  ==========  ==========  ==========  ===========================================

The optimizer keeps one state per user-facing parameter (:mod:`galvatron_fx.runtime.params`): ``N``
is the layer's unpadded elements, ``H`` the elements a rank's shard holds without padding
(:meth:`~galvatron_fx.runtime.zero_layout.ZeroLayout.held`; the first DP rank holds the most, and
that rank is the one priced unless ``dp_index`` says otherwise).

**Frozen parameters** (``requires_grad=False``) live in a buffer of their own (``P_f``/``S_f``):
their weights only, no gradients, no optimizer states; whole under DP and ZeRO-2 (``4 P_f``;
mixed: ``2 P_f`` working copy + ``4 P_f`` masters), sharded under ZeRO-3 (``4 S_f``; mixed: the
fp32 masters ``4 S_f``).

A registered dimension may move the states elsewhere (its ``states`` hook, :mod:`galvatron_fx.dims`):
CPU offload puts the masters, optimizer states and a gradient shard copy in host memory
(``host``, :mod:`galvatron_fx.dims.offload`).

Adam per parameter, DP: 16 bytes in fp32, 18 mixed (the working copy on top of the fp32 states);
ZeRO-3 mixed: ``16 / dp``. These are exactly the storages the runtime holds
(:meth:`galvatron_fx.runtime.module.DistributedModel.states_bytes`, checked byte for byte by
tests/test_memory_equality_dist.py and tests/test_mixed_precision_dist.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import dims
from ..dims import StateSizes
from ..errors import ConfigError
from ..runtime.zero_layout import zero_layout  # NOTE: the runtime owns its buffer layout; costed alike
from ..solver.strategy import Strategy

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}


@dataclass(frozen=True)
class StatesBytes:
    """Per-device bytes of one layer's model states (module docstring)."""

    params: int
    grads: int
    optimizer: int
    masters: int = 0
    host: int = 0   # bytes in host memory (CPU offload), not in ``total``

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.masters


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
                 mixed_precision: bool = False, optimizer: str = "adam", shapes=None, frozen_shapes=(),
                 dp_index: int = 0) -> StatesBytes:
    """Per-device bytes of parameters, gradients, optimizer states and masters (module docstring);
    ``itemsize``: the compute dtype's (4 for fp32, 2 for a mixed plan's working copy); ``shapes``:
    the layer's trainable TP-local parameter shapes at ``strategy.tp`` (exact padding), else
    ``None`` (``sharded`` / ``replicated`` elements as one parameter); ``frozen_shapes``: its frozen
    ones; ``dp_index``: the rank of the DP group priced (0 holds the most)."""
    if shapes is None:
        shapes = [(per_tp_elements(sharded, replicated, strategy.tp),)] if sharded + replicated else []
    layout = zero_layout(shapes, strategy.shard)   # the ZeRO group (HSDP: the shard group)
    padded, shard = layout.padded, layout.shard
    zero2_params = padded + (shard if strategy.shard > 1 else 0)   # fp32: the shard is a copy
    opt = layout.held(dp_index % strategy.shard) if strategy.sdp != "none" else sum(r * w for r, w in zip(layout.rows, layout.row))
    held = {"none": (padded, padded), "zero2": (zero2_params, shard), "zero3": (shard, shard)}[strategy.sdp]
    k = optimizer_states(optimizer)
    fz_working, fz_masters = _frozen_bytes(zero_layout(list(frozen_shapes), strategy.shard), strategy.sdp,
                                           itemsize, mixed_precision)
    sizes = StateSizes(padded, shard, opt, k, itemsize, fz_working + fz_masters)
    for d in dims.DIMENSIONS:
        if d.states is not None and (moved := d.states(strategy, sizes)) is not None:
            return StatesBytes(*moved)
    if not mixed_precision:
        return StatesBytes(held[0] * itemsize + fz_working, held[1] * itemsize, k * opt * itemsize)
    working = 0 if strategy.sdp == "zero3" else padded * itemsize
    return StatesBytes(working + fz_working, 4 * held[1], 4 * k * opt, masters=4 * held[1] + fz_masters)


def _frozen_bytes(fz, sdp: str, itemsize: int, mixed_precision: bool) -> tuple[int, int]:
    """The frozen buffer's bytes per device (module docstring), as (working copy, fp32 masters):
    fp32, the parameters themselves (whole, or a ZeRO-3 shard); mixed, the working copy (none at
    rest under ZeRO-3) and the fp32 masters (whole, or a ZeRO-3 shard)."""
    elems = fz.shard if sdp == "zero3" else fz.padded
    if not mixed_precision:
        return elems * itemsize, 0
    return (0 if sdp == "zero3" else fz.padded * itemsize), 4 * elems
