"""Tensor parallelism (Megatron-style) with optional sequence parallelism: fields ``tp`` and ``sp``.

A layer's weights split over ``tp`` consecutive ranks of its stage (column- then row-parallel, as
the op-level analysis of :mod:`galvatron_fx.sharding` admits: heads, key / value heads and widths
must divide); ``sp`` also splits the regions between the TP regions (norms, dropout, residuals)
along the sequence. Rewritten by ``passes/tensor_parallel.py``; run by ``runtime/tp_ops.py``.
Priced by :func:`_cost_terms`: the TP collectives of the layer (the cost model's
``tp_comm_time``, from the sites the TP pass's analysis finds) and, for a batch-coupled layer over
several DP ranks, the gathers of its whole batch.
"""

from __future__ import annotations

from typing import Any

from .base import (
    Admission,
    CostTerms,
    Dimension,
    Field,
    LayerWork,
    PassSpec,
    SpaceOptions,
    a_bool,
    is_pow2,
    plan_bool,
    positive_int,
    rule,
)


def _power_of_two(s: Any, o: SpaceOptions) -> bool:
    """With ``power_of_two=True`` (default) the TP and DP degrees are powers of two, as in the papers:
    collectives and head/hidden splits are balanced, and the space stays small."""
    return not o.power_of_two or (is_pow2(s.tp) and is_pow2(s.dp))


def _tp_within_node(s: Any, o: SpaceOptions) -> bool:
    """TP all-reduces every layer's activations, so a TP group stays inside one node (its fast
    interconnect) unless ``allow_cross_node_tp=True``: ``tp <= devices_per_node`` and ``tp`` divides
    ``devices_per_node`` (so groups of consecutive ranks never straddle a node boundary)."""
    if o.allow_cross_node_tp:
        return True
    return s.tp <= o.devices_per_node and o.devices_per_node % s.tp == 0


def _tp_divides_heads(s: Any, o: SpaceOptions) -> bool:
    """Megatron-style TP splits attention by heads: ``tp`` divides ``heads`` (when given)."""
    return o.heads is None or o.heads % s.tp == 0


def _tp_divides_hidden(s: Any, o: SpaceOptions) -> bool:
    """TP splits the hidden / FFN dimensions evenly: ``tp`` divides ``hidden`` (when given)."""
    return o.hidden is None or o.hidden % s.tp == 0


def _max_tp(s: Any, o: SpaceOptions) -> bool:
    """``tp <= max_tp`` when a cap is given (e.g. a user constraint)."""
    return o.max_tp is None or s.tp <= o.max_tp


def _sp_needs_tp(s: Any, o: SpaceOptions) -> bool:
    """Sequence parallelism splits the non-TP regions (norms, dropout) across the TP group; with
    ``tp == 1`` it is a no-op, so ``sp=True`` requires ``tp > 1``."""
    return s.tp > 1 or not s.sp


def _sp_switch(s: Any, o: SpaceOptions) -> bool:
    """``sp=False`` in the options drops the SP strategies."""
    return not s.sp or o.sp


def _admission(cost_model: Any, constraints) -> Admission:
    """The TP pass's own analysis decides: a degree is admitted where it accepts the layer (and SP
    where the boundary activations' sequence divides by ``tp``), and preferred where it shards
    some parameter (a degree that shards nothing only repeats the layer on every TP rank)."""
    cache: dict = {}

    def analysis(layer: int, tp: int, sp: bool):
        key = (layer, tp, sp)
        if key not in cache:
            cache[key] = cost_model.tp_analysis(layer, tp, sp=True) if sp else cost_model.tp_analysis(layer, tp)
        return cache[key]

    def admits(layer: int, s: Any) -> bool:
        if s.tp == 1:
            return not s.sp
        return not isinstance(analysis(layer, s.tp, False), Exception) and (
            not s.sp or not isinstance(analysis(layer, s.tp, True), Exception))

    def prefers(layer: int, s: Any) -> bool:
        if s.tp == 1:
            return True
        res = analysis(layer, s.tp, False)
        return not isinstance(res, Exception) and bool(res.sharded_params)
    return Admission(admits, prefers)


def _explain(layers: list) -> list[str]:
    """What TP shards in the ``tp > 1`` layers (the search's ``tp_report``), one line per distinct
    report, with the parameters that stay whole for a reason."""
    out, seen = [], {}
    for i, layer in enumerate(layers):
        rep = layer.extra.get("tp_report")
        if not rep:
            continue
        key = (layer.tp, rep["summary"], tuple(sorted(set(rep.get("whole", {}).values()))))
        if key in seen:
            out[seen[key]] += f", {i}"
            continue
        if not out:
            out.append("tensor parallelism (what TP shards; layers with the same report grouped):")
        seen[key] = len(out)
        out.append(f"  tp={layer.tp} {rep['summary']}: layers {i}")
        out += [f"      whole  {fqn}: {why}" for fqn, why in rep.get("whole", {}).items()]
    return out


def _divisors(o: SpaceOptions, n: int, chosen: dict):
    return [d for d in range(1, n + 1) if n % d == 0]


def _plan_sp(w: str, layer, micro_batch: int) -> str | None:
    if (why := plan_bool(f"{w}.sp", layer.sp)):
        return why
    if layer.sp and layer.tp == 1:
        return f"plan {w} ({layer.name!r}): sp=true needs tp > 1; set sp to false or tp >= 2"
    return None


def _cost_terms(cm: Any, index: int, n: float, s: Any, work: LayerWork) -> CostTerms:
    """The layer's TP collectives per micro-batch (a checkpointed layer's forward ones twice) and,
    where the layer mixes the samples of its batch over ``dp > 1`` ranks, the all-gathers of its
    inputs and of its outputs' gradients (:mod:`galvatron_fx.batch_symbol`)."""
    m = cm.measure(index)
    tp = cm.tp_comm_time(m, n, s, work.fwd, work.plain_bwd)
    whole = s.dp > 1 and bool(cm.layers[index].batch_coupled)
    return CostTerms(tp_comm_s=tp + (cm.whole_batch_gather_time(m, n, s) if whole else 0.0))


DIMENSION = Dimension(
    name="tensor",
    fields=(Field("tp", int, None, 10, values=_divisors, check=positive_int, json_required=True),
            Field("sp", bool, False, 40, values=lambda o, n, c: (False, True), check=a_bool, json_required=True)),
    rules=tuple(map(rule, (_power_of_two, _tp_within_node, _tp_divides_heads, _tp_divides_hidden, _max_tp,
                           _sp_needs_tp, _sp_switch))),
    admission=_admission,
    label=lambda s: [(10, f"tp{s.tp}")] + ([(60, "sp")] if s.sp else []),
    explain=_explain,
    cost_terms=_cost_terms,
    passes=(PassSpec("tensor_parallel", after="stage_split"),),
    runtime=("runtime.tp_ops", "runtime.vocab_parallel"),
    plan_checks=(_plan_sp,),
)
