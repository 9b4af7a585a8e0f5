"""The cost model's records and shared figures: :class:`LayerCost` (one layer's time and memory
terms under a strategy), parameters and experts per layer, the rank groups of a strategy, and the
precision and itemsize tables."""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass

import sympy

from ..layout import Layout
from ..solver.strategy import Strategy

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
PRECISION_DTYPES = {"fp32": ("fp32", False), "bf16-mixed": ("bf16", True), "fp16-mixed": ("fp16", True)}
"""precision -> (compute / storage dtype of parameters, gradients and activations, fp32 masters)."""
B = sympy.Symbol("b", positive=True)
"""The micro-batch size symbol of :meth:`CostModel.symbolic`."""


@dataclass(frozen=True)
class LayerCost:
    """One layer under one strategy and micro-batch size, per device. Seconds and bytes.

    ``fwd_s``/``bwd_s``/``tp_comm_s``/``zero3_gather_s``/``reduce_scatter_s`` (ZeRO-2/3's gradient
    reduce-scatter)/``overhead_s``/``activation_bytes``/``output_bytes`` are per micro-batch; ``grad_sync_s``, ``optimizer_s``, ``exposed_sync_s`` (the
    part of ``grad_sync_s`` no backward can hide: the last gradient bucket's share) and
    ``regather_s`` (ZeRO-2's all-gather of the updated shards, beside the next forward) per step; ``param_bytes``/``grad_bytes``/``optimizer_bytes``/
    ``master_bytes`` (fp32 masters of a mixed plan)/``transient_bytes`` are resident (transient:
    the layer's largest temporary buffer). Under a split (zero-bubble) backward the layer also
    takes ``split_extra_s`` more per micro-batch (torch's split walks the graph and re-runs each
    parameter's consumer: the cluster's ``split_backward_op_s`` per op; a checkpointed layer
    recomputes its forward in both the input- and the weight-gradient pass) and holds
    ``split_held_bytes`` (ZeRO-3's gathered buffer, kept from a micro-batch's input-gradient pass to
    its weight-gradient pass) and, per micro-batch between those passes, ``split_wgrad_bytes`` (the
    gradients of the outputs where parameters meet activations, which the weight pass starts from).
    ``host_bytes``: what the layer keeps in its device's share of host memory (CPU offload: masters,
    optimizer states, the gradient shard), counted against the host, not the device;
    ``host_activation_bytes`` what it keeps there per micro-batch in flight (offloaded activations).
    """

    fwd_s: float
    bwd_s: float
    tp_comm_s: float
    grad_sync_s: float
    zero3_gather_s: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    transient_bytes: float
    output_bytes: float
    master_bytes: float = 0.0
    overhead_s: float = 0.0
    optimizer_s: float = 0.0
    exposed_sync_s: float = 0.0
    regather_s: float = 0.0
    reduce_scatter_s: float = 0.0
    split_extra_s: float = 0.0
    split_held_bytes: float = 0.0
    split_wgrad_bytes: float = 0.0
    host_bytes: float = 0.0
    host_activation_bytes: float = 0.0

    @property
    def states_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.master_bytes

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LayerParams:
    """Element counts of the parameters a layer owns: TP-sharded and replicated."""

    sharded: int
    replicated: int


@dataclass(frozen=True)
class LayerExperts:
    """A layer's experts blocks (:mod:`galvatron_fx.sharding.experts`) as expert parallelism prices
    them: the expert weights' names, the experts per block (``ep`` must divide each), the router's
    ``top_k``, the tokens' width and the tokens per sample (sequence positions)."""

    fqns: frozenset
    num_experts: tuple[int, ...]
    top_k: int
    hidden: int
    tokens_per_sample: float
    loops: tuple = ()   # loop-form blocks: per block, per expert, its parameters' names (whole, not [E, ...])

    def held(self, ep: int) -> dict[str, bool]:
        """Loop experts' parameter name -> whether EP rank 0 of ``ep`` holds it (the first ``E / ep``
        experts; every EP rank holds as many of one shape)."""
        return {f: e < len(block) // ep for block in self.loops for e, names in enumerate(block) for f in names}

    def allows(self, ep: int) -> bool:
        return all(e % ep == 0 for e in self.num_experts)

    def needing_fraction(self, ep: int) -> float:
        """Share of a source's tokens one EP rank must see (uniform routing): those with at least
        one of their ``top_k`` experts among its ``E / ep``: ``1 - C(E - E/ep, k) / C(E, k)``."""
        e = min(self.num_experts)
        return 1.0 - math.comb(e - e // ep, self.top_k) / math.comb(e, self.top_k)


def expert_dp_group(strategy: Strategy, expert_tp: bool = False) -> list[int]:
    """Ranks holding the first EP rank's expert weights: every ``ep``-th DP rank, every TP rank
    (``expert_tp``: TP position 0 only, the others hold other slices)."""
    s = strategy
    return list(Layout(s.tp, s.dp, ep=s.ep, etp=expert_tp).expert_dp_ranks(0))


def ep_group(strategy: Strategy) -> list[int]:
    """Ranks of the first EP group: ``ep`` consecutive DP ranks (:class:`~galvatron_fx.layout.Layout`)."""
    return list(Layout(strategy.tp, strategy.dp, ep=strategy.ep).ep_ranks(0))


def tp_group(strategy: Strategy) -> list[int]:
    """Ranks of the first TP group of a stage (consecutive; :class:`~galvatron_fx.layout.Layout`)."""
    return list(Layout(strategy.tp, strategy.dp).tp_ranks(0))


def dp_group(strategy: Strategy) -> list[int]:
    """Ranks of the first data-parallel group of a stage (strided by ``tp``; :class:`~galvatron_fx.layout.Layout`)."""
    return list(Layout(strategy.tp, strategy.dp).dp_ranks(0))


CALL_OPS = ("call_function", "call_method", "call_module")
FREE_TARGETS = (operator.getitem,)
PROFILE_MAX_PARAM_BYTES = 64 * 2**20
"""Largest layer (fp32 parameter bytes) :func:`default_mode` profiles on a measured cluster."""
