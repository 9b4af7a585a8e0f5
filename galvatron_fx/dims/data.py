"""Data parallelism and its sharded kinds: fields ``dp`` and ``sdp``.

The ``dp`` ranks of a layer (its stage's devices over ``tp``) run different samples. ``sdp`` is the
kind: plain DP (states replicated, gradients all-reduced), ZeRO-2 (optimizer states and gradients
sharded over the group) or ZeRO-3 (parameters too, all-gathered around each use). Rewritten by
``passes/data_parallel.py`` (and ``passes/resharding.py`` between layouts); run by
``runtime/data_parallel.py`` over the dim-0 layout of ``runtime/zero_layout.py``.
"""

from __future__ import annotations

from typing import Any

from .base import Dimension, Field, PassSpec, SpaceOptions, one_of, positive_int, rule

SDP_KINDS: tuple[str, ...] = ("none", "zero2", "zero3")
"""Data-parallel kinds, in enumeration order: plain DP (replicated states), ZeRO-2 (optimizer states
and gradients sharded over the ``dp`` group), ZeRO-3 (parameters sharded too)."""


def _sdp_needs_dp(s: Any, o: SpaceOptions) -> bool:
    """ZeRO shards states over the data-parallel group; with ``dp == 1`` there is nothing to shard,
    so ZeRO-2/3 equal plain DP (same memory, same time, no communication). We canonicalise such a
    layer to ``sdp="none"`` and prune the two duplicates: with ``dp == 1`` only ``sdp="none"``."""
    return s.dp > 1 or s.sdp == "none"


def _sdp_switch(s: Any, o: SpaceOptions) -> bool:
    """``zero2=False`` / ``zero3=False`` in the options drop that data-parallel kind."""
    return not (s.sdp == "zero2" and not o.zero2) and not (s.sdp == "zero3" and not o.zero3)


def _plan_sdp(w: str, layer, micro_batch: int) -> str | None:
    if layer.sdp not in SDP_KINDS:
        return f"plan {w}.sdp must be one of {list(SDP_KINDS)}, got {layer.sdp!r}"
    return None


DIMENSION = Dimension(
    name="data",
    fields=(Field("dp", int, None, 20, derive=lambda n, chosen: n // chosen["tp"], check=positive_int, json_required=True),
            Field("sdp", str, "none", 30, values=lambda o, n, c: SDP_KINDS, check=one_of(SDP_KINDS), json_required=True)),
    rules=(rule(_sdp_needs_dp), rule(_sdp_switch)),
    label=lambda s: [(20, f"dp{s.dp}")] + ([(50, s.sdp)] if s.sdp != "none" else []),
    passes=(PassSpec("data_parallel", after="checkpointing"),),
    runtime=("runtime.data_parallel", "runtime.zero_layout", "runtime.reshard"),
    plan_checks=(_plan_sdp,),
)
