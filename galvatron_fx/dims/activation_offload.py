"""Activation offload: field ``act_offload`` (``False`` | ``True``).

A layer with ``act_offload`` keeps what its forward saves for backward in host memory instead of
on its device: torch's saved-tensor hooks (the mechanism of ``torch.autograd.graph.save_on_cpu``)
copy each saved activation to the host as the forward saves it and back as the backward reads it.
The layer's parameters stay where they are (its flat buffer's views, ZeRO-3's gathered buffer:
:func:`galvatron_fx.runtime.saved.is_state`). Megatron-LM's activation ``--cpu-offloading`` is the
same trade: device memory for host-link traffic, with no recomputation.

Offered where the search is asked for it (constraint ``act_offload``: ``true`` searches it per
layer, ``"all"`` offloads every layer that can; the default space leaves it out, so the plans
searched without it are unchanged), on layers without checkpointing (a checkpointed layer keeps
only its inputs and recomputes the rest: nothing left worth moving), context or expert parallelism
(the ring's and the token dispatch's own saved buffers are not measured under it), on clusters
whose devices have a host apart from them (:attr:`galvatron_fx.cluster.Cluster.has_host`).

Priced (:func:`_cost_terms`): the device keeps none of the layer's saved activations
(``activation_bytes = -kept``), the host keeps them per micro-batch in flight
(``host_activation_bytes = kept``, against the device's share of the host), the backward brings one
micro-batch's back (a transient of ``kept``), and each micro-batch moves them device -> host and
back over the device's host link, exposed (the runtime's copies are synchronous on the compute
stream). On a cluster without a host (the devices are the host) the copies stay in the same
memory: only their time is priced. Rewritten by ``passes/activation_offload.py`` (the layer's call
runs under :func:`galvatron_fx.runtime.activation_offload.offload_layer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .base import Admission, CostTerms, Dimension, Field, LayerWork, PassSpec, SpaceOptions, a_bool, plan_bool
from .offload import check_host

NAME = "act_offload"


def _why_not(ckpt: Any, cp: int, ep: int) -> str | None:
    """What keeps a layer from offloading its activations (``None``: nothing)."""
    if ckpt:
        return "checkpointing (it keeps only the layer's inputs)"
    if cp > 1 or ep > 1:
        return "context or expert parallelism (their own saved buffers are not offloaded)"
    return None


def _values(o: SpaceOptions, n: int, chosen: dict) -> tuple:
    if _why_not(chosen["ckpt"], chosen.get("cp", 1), chosen.get("ep", 1)):
        return (False,)
    return tuple(o.more.get(NAME, (False,)))


def _check(s: Any) -> str | None:
    why = s.act_offload and _why_not(s.ckpt, s.cp, s.ep)
    return f"Strategy.act_offload is not combined with {why}; set act_offload to False" if why else None


def _plan_check(w: str, layer, micro_batch: int) -> str | None:
    value = layer.value(NAME)
    if value is None:
        return None
    bad = plan_bool(f"{w}.{NAME}", value)
    if bad or not value:
        return bad
    why = _why_not(layer.ckpt, layer.cp, layer.ep)
    return f"plan {w}.{NAME} is not combined with {why}; set {NAME} to false" if why else None


def _space_options(c: Mapping) -> dict:
    """Constraint ``act_offload``: ``false`` (none, the default), ``true`` (searched per layer) or
    ``"all"`` (every layer that can)."""
    if NAME not in c:
        return {}
    value = c[NAME]
    if isinstance(value, bool):
        return {NAME: (False, True) if value else (False,)}
    if value == "all":
        return {NAME: (True,)}
    raise ConfigError(f"constraint {NAME} must be true, false or \"all\", got {value!r}")


def _admission(cm: Any, constraints: Mapping) -> Admission:
    """Only where the cluster's devices have a host apart from them; asking for it on one without
    is a configuration error."""
    cluster = getattr(cm, "cluster", None)
    if getattr(cluster, "has_host", False):
        return Admission()
    check_host(cluster, constraints.get(NAME), f"constraint {NAME}")
    return Admission(admits=lambda layer, s: not getattr(s, NAME, False))


def _cost_terms(cm: Any, index: int, n: float, s: Any, work: LayerWork) -> CostTerms:
    if not getattr(s, NAME, False) or work.kept_bytes <= 0:
        return CostTerms()
    kept, c = work.kept_bytes, cm.cluster
    if not getattr(c, "has_host", False):   # the devices are the host: copies in the same memory
        return CostTerms(overhead_s=2 * kept * c.copy_s_per_byte)
    return CostTerms(activation_bytes=-kept, host_activation_bytes=kept, transient_bytes=kept,
                     overhead_s=2 * kept / c.host_bandwidth)


def _explain(layers: list) -> list[str]:
    moved = [lp.name for lp in layers if lp.value(NAME)]
    if not moved:
        return []
    return [f"activation offload: {len(moved)} layer(s) keep their saved activations in host memory between "
            "forward and backward (copied over the host link each micro-batch)"]


DIMENSION = Dimension(
    name="activation_offload",
    fields=(Field(NAME, bool, False, 120, values=_values, check=a_bool, omit_default=True),),
    admission=_admission,
    checks=(_check,),
    label=lambda s: [(75, "aoff")] if getattr(s, NAME, False) else [],
    explain=_explain,
    cost_terms=_cost_terms,
    passes=(PassSpec("activation_offload", after="checkpointing",
                     when=lambda ctx: any(lp.value(NAME) for lp in ctx.plan.layers)),),
    runtime=("runtime.activation_offload",),
    plan_checks=(_plan_check,),
    constraints=(NAME,),
    space_options=_space_options,
)
