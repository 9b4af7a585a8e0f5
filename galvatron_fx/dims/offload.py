"""CPU offload of optimizer states and fp32 masters: field ``offload`` (``"none"`` | ``"optimizer"``).

ZeRO-Offload's and FSDP2's ``CPUOffloadPolicy`` idea, per layer: an offloaded ZeRO-2 / ZeRO-3 layer
keeps its fp32 masters (the parameters the user's optimizer sees), a copy of its gradient shard and
its optimizer states in host memory, and the optimizer step runs on the host: the user's
``torch.optim`` optimizer works unchanged, over host tensors. The device keeps what the layer
computes with and the shard its all-gathers start from (in the compute dtype), and reduces the
gradient there; once the step's backward is over the reduced shard moves device -> host
(``finish_grad_sync``), and the updated masters move host -> device the next time the layer is
gathered (:mod:`galvatron_fx.runtime.data_parallel`, ``FlatParams(offload=True)``).

Offered on ZeRO layers without expert parallelism (expert buffers keep their own data-parallel
groups) on clusters whose devices have a host apart from them
(:attr:`galvatron_fx.cluster.Cluster.has_host`: host memory and a device <-> host link; a CPU cluster's
devices are the host). Priced (:func:`_cost_terms`): per step, the gradient shard down and the
master shard up over the device's host link and the host's optimizer step in place of the
device's, exposed (not overlapped with compute); memory (:func:`_states`): the fp32 masters (an fp32
plan's parameters themselves), the optimizer states and a copy of the gradient shard in host memory
(``4 S + 4 S + 4 k H``, in :func:`galvatron_fx.cost.memory.states_bytes`' terms), which count against
the device's share of its node's host memory (the search enforces it beside the device budget).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .base import (
    Admission,
    CostTerms,
    Dimension,
    Field,
    SpaceOptions,
    StateSizes,
    as_list,
    layer_elems,
    one_of,
    rule,
)

OFFLOAD_MODES = ("none", "optimizer")


def _values(o: SpaceOptions, n: int, chosen: dict) -> tuple:
    if chosen["sdp"] == "none":
        return ("none",)
    return tuple(o.more.get("offload", OFFLOAD_MODES))


def _needs_zero(s: Any) -> str | None:
    if s.offload != "none" and s.sdp == "none":
        return (f"Strategy.offload {s.offload!r} needs sdp 'zero2' or 'zero3' (the host holds each rank's "
                "shard of the optimizer states); use offload 'none' with sdp 'none'")
    return None


def _offload_plain(s: Any, o: SpaceOptions) -> bool:
    """Offload is offered to layers without expert parallelism (expert buffers have their own
    data-parallel groups, not offloaded yet)."""
    return getattr(s, "offload", "none") == "none" or s.ep == 1


def _plan_offload(w: str, layer, micro_batch: int) -> str | None:
    mode = layer.value("offload")
    if mode is None or mode == "none":
        return None
    if mode not in OFFLOAD_MODES:
        return f"plan {w}.offload must be one of {', '.join(OFFLOAD_MODES)}, got {mode!r}"
    if layer.sdp == "none":
        return f"plan {w}.offload {mode!r} needs sdp zero2 or zero3; set offload to 'none' or shard the layer"
    if layer.ep > 1:
        return f"plan {w}.offload {mode!r} is not supported with ep > 1; set offload to 'none'"
    return None


def _space_options(c: Mapping) -> dict:
    """Constraint ``offload``: ``false`` (none), ``true`` (searched: the default where the cluster
    has a host), ``"optimizer"`` (every ZeRO layer offloads) or a list of modes."""
    if "offload" not in c:
        return {}
    value = c["offload"]
    if isinstance(value, bool):
        return {"offload": OFFLOAD_MODES if value else ("none",)}
    modes = as_list(value, "offload", str)
    bad = [m for m in modes if m not in OFFLOAD_MODES]
    if bad:
        raise ConfigError(f"constraint offload must be true, false, one of {OFFLOAD_MODES} or a list of "
                          f"them, got {value!r}")
    return {"offload": tuple(modes)}


def check_host(cluster: Any, asked: Any, what: str = "constraint offload") -> None:
    """Refuse offload asked for (``asked``: the constraint's value) on a cluster without a host."""
    if getattr(cluster, "has_host", False) or asked in (None, False, "none") or asked == ["none"]:
        return
    said = what if what.startswith("--") else f"{what}={asked!r}"   # a flag, or a constraint's value
    raise ConfigError(f"{said}: cluster {getattr(cluster, 'name', '?')!r} has no host memory apart from "
                      "its devices (host_memory_bytes / host_bandwidth are 0, as on CPU clusters); drop it or "
                      "describe the host in the cluster file")


def _admission(cm: Any, constraints: Mapping) -> Admission:
    """Offload only where the cluster's devices have a host apart from them; asking for it on one
    without is a configuration error."""
    cluster = getattr(cm, "cluster", None)
    if getattr(cluster, "has_host", False):
        return Admission()
    check_host(cluster, constraints.get("offload"))
    return Admission(admits=lambda layer, s: getattr(s, "offload", "none") == "none")


def _states(s: Any, z: StateSizes) -> tuple[int, int, int, int, int] | None:
    """An offloaded layer's device keeps what it computes with (ZeRO-2: the whole buffer; ZeRO-3:
    nothing at rest) plus the shard its all-gathers start from, in the compute dtype (ZeRO-2 on one
    rank copies the masters straight into its buffer and keeps none), its frozen buffer as without
    offload, and its fp32 gradient shard (reduced there, copied to the host once the step's
    backward is over); the host the masters, the gradient shard's copy and the optimizer states."""
    if getattr(s, "offload", "none") == "none":
        return None
    source = z.shard if s.sdp == "zero3" or s.shard > 1 else 0   # the gathers' device shard
    whole = z.padded if s.sdp == "zero2" else 0
    return (whole + source) * z.itemsize + z.frozen_bytes, 4 * z.shard, 0, 0, 4 * z.shard + 4 * z.shard + 4 * z.k * z.held


def _cost_terms(cm: Any, index: int, n: float, s: Any, work: Any) -> CostTerms:
    """Per step: the reduced gradient shard device -> host and the updated fp32 master shard host
    -> device over the host link (a cluster without a host: the runtime's copies), and the host's
    optimizer step instead of the device's; all exposed."""
    if s.offload == "none":
        return CostTerms()
    held = math.ceil(layer_elems(cm, index, s)[1] / s.shard)
    c = cm.cluster
    if not getattr(c, "has_host", False):   # the devices are the host: copies in their memory, the same step
        return CostTerms(optimizer_s=2 * 4 * held * c.copy_s_per_byte)
    moved = 2 * 4 * held / c.host_bandwidth
    step = 4 * held * (c.host_optimizer_s_per_byte - c.optimizer_s_per_byte)
    return CostTerms(optimizer_s=moved + step)


def _explain(layers: list) -> list[str]:
    off = [lp.name for lp in layers if (lp.value("offload") or "none") != "none"]
    if not off:
        return []
    return [f"CPU offload: {len(off)} layer(s) keep optimizer states and fp32 masters in host memory "
            "(the optimizer steps on the host)"]


DIMENSION = Dimension(
    name="offload",
    fields=(Field("offload", str, "none", 110, values=_values, check=one_of(OFFLOAD_MODES)),),
    rules=(rule(_offload_plain),),
    admission=_admission,
    checks=(_needs_zero,),
    label=lambda s: [(57, "off")] if getattr(s, "offload", "none") != "none" else [],
    explain=_explain,
    cost_terms=_cost_terms,
    states=_states,
    plan_checks=(_plan_offload,),
    constraints=("offload",),
    space_options=_space_options,
)
