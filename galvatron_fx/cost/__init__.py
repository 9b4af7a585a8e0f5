"""Cost model: per-layer FLOPs, activation and state memory, communication, for any strategy.

::

    from galvatron_fx.cost import CostModel
    cm = CostModel(gm, cluster, dtype="bf16", mode="analytic", mixed_precision=True)
    cm.layer_cost(3, Strategy(tp=2, dp=4), micro_batch_size=8)   # -> LayerCost (seconds, bytes)

See :mod:`galvatron_fx.cost.model` for the scaling rules, :mod:`.memory` for model states,
:mod:`.measure` for the fake-tensor measurement, :mod:`.profile` for profiled mode and
:mod:`.context` for context parallelism's terms.
"""

from .context import LayerAttention, cp_attention_time, cp_messages, find_attention, layout_time
from .extract import LayerGraph, extract_layer, retarget_devices, roles_from_analysis
from .flop_rules import SDPA_FORMULAS, flop_counter
from .measure import Affine, LayerMeasure, measure_layer
from .memory import OPTIMIZER_STATES, StatesBytes, states_bytes
from .model import CostModel
from .profile import PROFILE_CALLS, cache_dir, profile_layer
from .records import B, LayerCost, dp_group, tp_group

__all__ = [
    "Affine", "B", "CostModel", "LayerCost", "LayerGraph", "LayerMeasure", "OPTIMIZER_STATES",
    "PROFILE_CALLS", "SDPA_FORMULAS", "StatesBytes", "cache_dir", "dp_group", "extract_layer",
    "flop_counter", "measure_layer", "profile_layer", "retarget_devices", "states_bytes", "tp_group",
    "roles_from_analysis", "LayerAttention", "cp_messages", "cp_attention_time", "find_attention",
    "layout_time",
]
