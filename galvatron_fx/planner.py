"""Public planning API: ``gfx.search``, ``gfx.estimate``, ``Plan.uniform`` and the baselines.

This module is the glue between a captured graph and the pure search core: it builds the cost
model (:class:`galvatron_fx.cost.CostModel`), derives which TP degrees each layer admits, runs
:class:`galvatron_fx.solver.engine.Engine` and turns its result into a :class:`Plan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from . import dims
from .cluster import PRECISIONS, Cluster, default_precision
from .dims import as_list
from .dims.checkpointing import is_ckpt_mode
from .dims.context import kinds_of
from .errors import ConfigError, GalvatronError, InfeasibleError
from .ir import META_KEY
from .plan import LAYER_ATTRIBUTES, LayerPlan, Plan
from .solver.engine import Engine, SearchOptions, SearchResult, stderr_progress
from .solver.objective import estimate_plan
from .units import parse_bytes

# constraint key -> where it goes: SearchOptions field, or strategy_space keyword
_OUTER = ("pp", "micro_batches", "schedule", "virtual_stages", "global_batch_size")
_SPACE = ("ckpt", "sp", "zero2", "zero3", "max_tp", "allow_cross_node_tp", "power_of_two")
_COST = ("precision", "dtype", "mode", "mixed_precision", "reserve_bytes", "optimizer")
CONSTRAINT_KEYS = _OUTER + _SPACE + ("tp", "sdp", "ep", "cp", "cp_kind", "granularity", "uniform",
                                     "max_global_batch_size", "max_micro_batches", "max_micro_batch_size") \
    + dims.constraint_keys()
"""Keys ``gfx.search(..., constraints={...})`` accepts: ``pp``, ``micro_batches``, ``schedule``,
``virtual_stages`` pin the outer loop; ``tp`` (int) pins the TP degree of every layer; ``sdp`` (list of "none",
"zero2", "zero3") limits data-parallel kinds; ``ckpt``/``sp``/``zero2``/``zero3`` (bool) switch
options off, ``ckpt="all"`` checkpoints every layer fully, ``ckpt="selective"`` selectively, a list
(``[false, "selective"]``) limits the checkpointing modes searched; ``max_tp``, ``allow_cross_node_tp``,
``power_of_two`` (TP and DP degrees powers of two; off by default) shape the strategy tree;
``max_global_batch_size`` / ``max_micro_batches`` bound the searched batch and micro-batch counts,
``max_micro_batch_size`` the samples one device runs per micro-batch; ``granularity`` (bytes) sets
the memory relaxation's unit (speed only); ``uniform`` (bool) searches uniform plans only; ``ep``
(int or list of ints) limits the expert-parallel degrees of the layers with experts (1 among them
keeps them unsplit; other layers always run ``ep = 1``); ``cp`` (int or list of ints) the
context-parallel degrees every layer the context-parallel pass takes at them may run (``{"cp": 4}``:
those layers run cp 4, the others cp 1; ``[1, 4]``: searched per layer; given, it offers cp > 1 at
any sequence length, :data:`CP_MIN_SEQ`), ``cp_kind`` (``"ring"``, ``"ulysses"`` or a list) the
context-parallel attention kinds."""

CP_MIN_SEQ = 16384
"""Without a ``cp`` constraint the search offers context parallelism only when the captured
sequence is at least this long (positions): below it the attention's share of a layer is small and
splitting the sequence only adds exchanges, while every degree and kind multiplies the per-layer
space (106 strategies on 8 devices instead of 34), and so the search time."""


def resolve_precision(cluster: Cluster, precision: str | None = None, dtype=None, mixed_precision=None) -> str:
    """The plan's precision: ``precision`` if given, else the one the legacy ``dtype`` /
    ``mixed_precision`` options name (``dtype="bf16"`` is ``"bf16-mixed"``: fp32 masters always),
    else the cluster's default (:func:`galvatron_fx.cluster.default_precision`)."""
    from .cluster import normalize_dtype

    if precision is not None:
        if precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        if dtype is not None or mixed_precision is not None:
            legacy = resolve_precision(cluster, None, dtype if dtype is not None else precision.split("-")[0],
                                       mixed_precision)
            if legacy != precision:
                raise ConfigError(f"precision={precision!r} contradicts dtype={dtype!r} / "
                                  f"mixed_precision={mixed_precision!r}; give only precision")
        return precision
    if dtype is None and mixed_precision is None:
        return default_precision(cluster)
    if dtype is None:
        raise ConfigError("mixed_precision needs dtype='bf16' or 'fp16' (or pass precision='bf16-mixed')")
    d = normalize_dtype(dtype)
    if d == "fp32":
        if mixed_precision:
            raise ConfigError("mixed_precision=True needs dtype='bf16' or 'fp16' (the low-precision copy)")
        return "fp32"
    if mixed_precision is False:
        raise ConfigError(f"dtype={dtype!r} without fp32 master weights is not a supported precision; use "
                          f"precision={d + '-mixed'!r} (fp32 masters and optimizer states, {d} compute)")
    return f"{d}-mixed"


def _cost_options(cluster: Cluster, options: dict) -> tuple[str, dict]:
    """``(precision, the other cost-model options)`` from a search / estimate's keyword options."""
    opts = dict(options)
    precision = resolve_precision(cluster, opts.pop("precision", None), opts.pop("dtype", None),
                                  opts.pop("mixed_precision", None))
    return precision, opts


def _as_graph(model, example_inputs, method: str) -> torch.fx.GraphModule:
    from .frontend import capture

    if isinstance(model, torch.fx.GraphModule) and isinstance(model.meta.get(META_KEY), object) \
            and model.meta.get(META_KEY) is not None:
        return model
    if example_inputs is None:
        raise ConfigError("gfx.search on an nn.Module needs example_inputs=(...) to capture it "
                          "(or pass a graph from gfx.capture)")
    if isinstance(example_inputs, dict):
        return capture(model, (), example_inputs, method=method)
    return capture(model, tuple(example_inputs), method=method)


def resolve_cluster(cluster) -> Cluster:
    """A Cluster from a Cluster, a preset name, a JSON path or a dict; ``None``: profile the live world."""
    if cluster is None:
        return Cluster.preset("local")
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return Cluster.load(cluster) if cluster.endswith(".json") else Cluster.preset(cluster)
    if isinstance(cluster, dict):
        return Cluster.from_dict(cluster)
    raise ConfigError(f"cluster must be a Cluster, a preset name or a JSON path, got {type(cluster).__name__}")


def cost_model_for(gm: torch.fx.GraphModule, cluster: Cluster, **cost_options):
    """The (cached per cluster and options) cost model of a captured graph (``precision`` among
    the options; the legacy ``dtype`` / ``mixed_precision`` map onto it, see :func:`resolve_precision`)."""
    from .cost import CostModel

    info = gm.meta[META_KEY]
    cache = info.__dict__.setdefault("_cost_models", {})
    precision, rest = _cost_options(cluster, cost_options)
    key = (repr(sorted(cluster.to_dict().items())), precision, repr(sorted(rest.items())))
    if key not in cache:
        cache[key] = CostModel(gm, cluster, precision=precision, **rest)
    return cache[key]


def ep_degrees(cost_model, world_size: int) -> list[int]:
    """Expert-parallel degrees some layer of the model admits (divisors of its experts' counts
    up to the world size); ``[1]`` for a model without experts."""
    counts = {e for i in range(len(cost_model.layers)) if (ex := cost_model.experts(i)) for e in ex.num_experts}
    if not counts:
        return [1]
    g = math.gcd(*counts)
    return [d for d in range(1, min(g, world_size) + 1) if g % d == 0]


def cp_degrees(cost_model, world_size: int, constraints: dict | None = None) -> list[int]:
    """Context-parallel degrees the search offers: the ``cp`` constraint's, else (a captured
    sequence of at least :data:`CP_MIN_SEQ` positions) every divisor of the world size that divides
    the sequence, else ``[1]`` (the default search keeps its speed on short sequences)."""
    asked = as_list((constraints or {}).get("cp"), "cp")
    if asked is not None:
        if any(c < 1 for c in asked):
            raise ConfigError(f"constraint cp must hold degrees >= 1, got {asked}")
        return sorted(set(asked))
    seq = cost_model.sequence_length()
    if seq < CP_MIN_SEQ:
        return [1]
    return [d for d in range(1, world_size + 1) if world_size % d == 0 and seq % d == 0]


def _ckpt_constraint(value) -> bool | tuple:
    """The ``ckpt`` constraint as the space option: ``false`` (none), ``true`` (searched per layer:
    none, selective or full), ``"all"`` (every layer fully), ``"selective"`` / ``"selective-op"``
    (every layer selectively, under that policy) or a list of the modes to search among."""
    if isinstance(value, bool):
        return value
    if value in ("all", "selective", "selective-op"):
        return (True,) if value == "all" else (value,)
    if isinstance(value, (list, tuple)) and value and all(is_ckpt_mode(v) for v in value):
        return tuple(value)
    raise ConfigError(f"constraint ckpt must be true, false, 'all', 'selective', 'selective-op' or a list of "
                      f"false / 'selective' / 'selective-op' / true, got {value!r}")


def _options(constraints: dict | None, global_batch_size, reserve: float) -> SearchOptions:
    c = dict(constraints or {})
    unknown = sorted(set(c) - set(CONSTRAINT_KEYS))
    if unknown:
        raise ConfigError(f"unknown search constraint(s) {unknown}; valid keys: {', '.join(CONSTRAINT_KEYS)}")
    opt = SearchOptions(global_batch_size=global_batch_size, reserve_bytes=reserve)
    for k in ("pp", "micro_batches", "schedule", "virtual_stages"):
        setattr(opt, k, c.get(k))
    if "ckpt" in c:
        c["ckpt"] = _ckpt_constraint(c["ckpt"])
    opt.space = {k: c[k] for k in _SPACE if k in c}
    more = dims.space_options(c)
    if more:
        opt.space["more"] = more
    for k in ("max_global_batch_size", "max_micro_batches", "max_micro_batch_size"):
        if c.get(k) is not None:
            setattr(opt, k, int(c[k]))
    if "granularity" in c:
        opt.granularity = parse_bytes(c["granularity"], "granularity")
    tp, kinds = c.get("tp"), c.get("sdp")
    if tp is not None or kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        opt.strategy_filter = lambda s: (tp is None or s.tp == tp) and (kinds is None or s.sdp in kinds)
    opt.uniform_only = bool(c.get("uniform", False))
    return opt


def _plan(result: SearchResult, names: list[str], world_size: int, fingerprint: str, cluster: Cluster,
          precision: str, cost_options: dict, cm=None) -> Plan:
    layers = [LayerPlan(n, s.tp, s.dp, s.sdp, s.sp, s.ckpt, dims.extra_fields(s, LAYER_ATTRIBUTES), ep=s.ep,
                        cp=s.cp, cp_kind=s.cp_kind)
              for n, s in zip(names, result.strategies)]
    for i, (lp, s) in enumerate(zip(layers, result.strategies)):
        if s.ep > 1 and cm is not None:   # the token exchange the cost model found cheaper
            n = result.global_batch_size / result.micro_batches / s.dp
            lp.extra["ep_dispatch"] = cm.ep_dispatch(i, n, s)[0]
            if cm.expert_tp_of(i, s) > 1:   # priced so (the search's default): experts sharded over TP
                lp.extra["expert_tp"] = True
        if s.cp > 1 and cm is not None:   # explain(): the attention exchanges, seconds per micro-batch
            n = result.global_batch_size / result.micro_batches / s.dp
            lp.extra["cp_exchange_s"] = float(f"{cm.cp_terms(i, n, s)[0]:.6g}")
        if cm is not None and cm.measure(i).kernels:   # SDPA, priced as the kernel the device picks
            lp.extra["attention_kernel"] = ",".join(sorted(set(cm.measure(i).kernels)))
    extra = {"cost_model": dict(cost_options)}
    if cm is not None:
        extra["attention_target"] = cm.attention_target
    return Plan(world_size, result.pp, result.schedule, result.micro_batches, result.global_batch_size,
                [tuple(s) for s in result.stages], layers, _json_estimate(result.estimate), fingerprint,
                cluster.to_dict(), extra, precision=precision, virtual_stages=result.virtual_stages)


def _json_estimate(est: dict) -> dict:
    """Round floats to 12 significant digits so the plan JSON is stable and re-estimates exactly."""
    def r(x):
        if isinstance(x, float):
            return float(f"{x:.12g}")
        if isinstance(x, list):
            return [r(v) for v in x]
        if isinstance(x, dict):
            return {k: r(v) for k, v in x.items()}
        return x
    return r(est)


def _engine(gm, cluster, world_size, budget, global_batch_size, constraints, cost_options, progress):
    cm = cost_model_for(gm, cluster, **cost_options)
    opt = _options(constraints, global_batch_size, cm.reserve_bytes)
    sigs = [cm.cost_key(i) for i in range(len(cm.layers))]
    reads = [set(rec.params) for rec in cm.layers]
    tied = [i for i, r in enumerate(reads) if any(r & other for j, other in enumerate(reads) if j != i)]
    cps, kinds = cp_degrees(cm, world_size, constraints), kinds_of(constraints)
    admits, prefers = dims.admission(cm, constraints)
    return Engine(cm, cluster, sigs, world_size, budget, opt, admits=admits, prefers=prefers,
                  ep_degrees=ep_degrees(cm, world_size), cp_degrees=cps, cp_kinds=kinds,
                  tied_layers=tied, batch_coupled=[i for i, rec in enumerate(cm.layers) if rec.batch_coupled],
                  progress=stderr_progress if progress is True else (progress or None),
                  layer_names=[rec.name for rec in cm.layers])


def search(model, cluster=None, memory_budget=None, global_batch_size: int | None = None, *,
           example_inputs=None, constraints: dict | None = None, world_size: int | None = None,
           method: str = "dynamo", progress: bool | Callable[[str], None] = False, precision: str | None = None,
           **cost_options) -> Plan:
    """Search the best plan for ``model`` (a captured graph, or an ``nn.Module`` with
    ``example_inputs``, meta-device models welcome) on ``cluster`` under ``memory_budget`` bytes per
    device (default: the device memory). ``global_batch_size=None`` chooses it for throughput.

    ``precision`` (``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``; default by cluster, see
    :func:`galvatron_fx.cluster.default_precision`) is priced by the cost model and stored in the
    plan. ``cost_options`` go to the cost model (``mode``, ``reserve_bytes``, ``optimizer``; the
    legacy ``dtype`` / ``mixed_precision`` map onto ``precision``). The result is the best plan of
    the whole space under the cost model (:mod:`galvatron_fx.solver.engine` states the space and the
    argument). Raises :class:`InfeasibleError` naming the least memory any plan needs when nothing
    fits, or the restriction that excluded every plan. ``gfx.search`` (:func:`galvatron_fx.api.search`)
    adds the measured selection (``measure=K``).
    """
    cluster = resolve_cluster(cluster)
    gm = _as_graph(model, example_inputs, method)
    world = int(world_size or cluster.world_size)
    budget = parse_bytes(memory_budget, "memory_budget") if memory_budget is not None else cluster.device_memory
    if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
        raise ConfigError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    precision, rest = _cost_options(cluster, {**cost_options, "precision": precision})
    engine = _engine(gm, cluster, world, budget, global_batch_size, constraints, {**rest, "precision": precision},
                     progress)
    result = engine.run()
    info = gm.meta[META_KEY]
    plan = _plan(result, [rec.name for rec in info.layers], world, info.fingerprint, cluster, precision, rest,
                 engine.costs)
    plan.extra["memory_budget_bytes"] = int(budget)
    plan.extra["schedules"] = _schedule_summary(engine.best_by_schedule, engine.schedule_bounds)
    _attach_tp_reports(gm, engine.costs, plan)
    return plan


def _schedule_summary(best: dict, bounds: dict) -> dict:
    """Per schedule, the best plan the search found with it (the runner-ups explain() names):
    configuration, throughput, bubble share of the step and peak in-flight activation bytes; for a
    schedule whose configurations all lost on their bounds, that bound (``at_most_samples_s``)."""
    from .solver.schedules import step_slots

    out = {sched: {"at_most_samples_s": round(b, 6)} for sched, b in bounds.items()}
    for sched, r in best.items():
        slots = step_slots(sched, r.pp, r.virtual_stages, r.micro_batches)
        out[sched] = {"pp": r.pp, "micro_batches": r.micro_batches, "virtual_stages": r.virtual_stages,
                      "throughput_samples_s": _json_estimate(r.estimate)["throughput_samples_s"],
                      "bubble_fraction": round((slots - r.micro_batches) / slots, 6),
                      "activation_bytes": max(r.estimate["per_device"]["activation_bytes"])}
    return out


def _attach_tp_reports(gm, cost_model, plan: Plan) -> None:
    """Each ``tp > 1`` layer's TP report in the plan (``layer.extra["tp_report"]``: the summary and
    the parameters that stay whole because an op of theirs runs replicated), for ``plan.explain()``."""
    from .sharding.report import layer_report

    done: dict[tuple, dict] = {}
    for i, layer in enumerate(plan.layers):
        if layer.tp > 1:
            res = cost_model.tp_analysis(i, layer.tp)
            # NOTE: the analysis is cached per layer signature: a repeated block reports as the
            # first block of its signature (fqns named after that one)
            first = i if isinstance(res, Exception) else res.layer
            if (first, layer.tp) not in done:
                rep = layer_report(gm, res, first, layer.tp)
                done[first, layer.tp] = {"summary": rep.summary(), "whole": rep.notable_whole()}
            layer.extra["tp_report"] = done[first, layer.tp]


def estimate(gm: torch.fx.GraphModule, plan: Plan, cluster=None, **cost_options) -> dict:
    """The cost model's figures for any plan (searched, loaded or hand-made): the plan JSON's
    ``estimate`` keys plus ``per_device`` (``states_bytes``, ``activation_bytes``,
    ``transient_bytes``, ``reserve_bytes``, one entry per stage) and ``stage_time_s``.

    The plan's ``precision`` and recorded cost options are used unless overridden here, so
    re-estimating a saved plan reproduces it.
    """
    cluster = resolve_cluster(cluster if cluster is not None else (plan.cluster or None))
    recorded = {k: v for k, v in plan.extra.get("cost_model", {}).items()
                if k not in ("precision", "dtype", "mixed_precision")}
    opts = {**recorded, **cost_options}
    if not any(k in cost_options for k in ("precision", "dtype", "mixed_precision")):
        opts["precision"] = plan.precision
    info = gm.meta[META_KEY]
    plan.validate_for(fingerprint=info.fingerprint, layer_names=[rec.name for rec in info.layers])
    cm = cost_model_for(gm, cluster, **opts)
    est = estimate_plan(cm, cluster, strategies=plan.layer_strategies(), stages=list(plan.stages),
                        micro_batches=plan.micro_batches, global_batch_size=plan.global_batch_size,
                        schedule=plan.schedule, world_size=plan.world_size, reserve_bytes=cm.reserve_bytes,
                        virtual_stages=plan.virtual_stages)
    return _json_estimate(est)


# ------------------------------------------------------------------------------------------------
# baselines: the limited strategies of the Galvatron paper, judged by the same cost model

BASELINES: dict[str, dict[str, Any]] = {
    "dp": {"uniform": True, "pp": 1, "tp": 1, "sdp": ["none"], "ckpt": False, "sp": False, "micro_batches": 1},
    "zero3": {"uniform": True, "pp": 1, "tp": 1, "sdp": ["zero3"], "ckpt": False, "sp": False, "micro_batches": 1},
    "tp": {"uniform": True, "pp": 1, "sdp": ["none"], "ckpt": False, "sp": False, "micro_batches": 1},
    "pp": {"uniform": True, "tp": 1, "sdp": ["none"], "ckpt": False, "sp": False, "schedule": "gpipe"},
    "3d": {"uniform": True, "sdp": ["none"], "ckpt": False, "sp": False, "schedule": "1f1b"},
    "dp+tp": {"pp": 1, "sdp": ["none"], "ckpt": False, "sp": False, "micro_batches": 1},
    "dp+pp": {"tp": 1, "sdp": ["none"], "ckpt": False, "sp": False, "schedule": "1f1b"},
    "megatron": {"uniform": True, "sdp": ["none", "zero2"], "allow_cross_node_tp": False,
                 "schedule": ["1f1b", "interleaved-1f1b"], "max_micro_batch_size": 8},
    "fsdp": {"uniform": True, "pp": 1, "tp": 1, "sdp": ["zero3"]},
    "fsdp+tp": {"uniform": True, "pp": 1, "sdp": ["zero3"], "allow_cross_node_tp": False},
}
"""Baseline name -> search constraints. The Galvatron paper's limited strategies, each pinned as the
paper runs it (one micro-batch, no recomputation, no SP unless named): ``dp``, ``zero3``; ``tp``:
TP over a whole node (or the world, if smaller) then DP; ``pp``: one stage per device (or per
layer), GPipe; ``3d``: the best uniform DP x TP x PP grid, 1F1B; ``dp+tp`` / ``dp+pp``: per-layer
search in two dimensions. What practitioners run, each searched over its own knobs (micro-batches
for gradient accumulation, recomputation on or off, SP where TP is on): ``fsdp``: ZeRO-3 over every
device, torchtitan's 1D; ``fsdp+tp``: TP inside the node, ZeRO-3 across, torchtitan's 2D;
``megatron``: Megatron-LM's uniform TP (within a node) x PP x DP with the distributed optimizer
(ZeRO-2 over DP) or without, 1F1B or interleaved 1F1B, 1 to 8 samples per device per micro-batch.
None uses context parallelism (``cp = 1``)."""
PRACTITIONER_BASELINES = ("megatron", "fsdp", "fsdp+tp")
"""The baselines practitioners run (each searched over its own knobs), against which the searched
plan's speed-up is reported."""

for _cons in BASELINES.values():   # NOTE: the paper's limited strategies: no context parallelism
    _cons["cp"] = 1


def baselines(gm: torch.fx.GraphModule, cluster=None, memory_budget=None, global_batch_size: int | None = None,
              *, world_size: int | None = None, names: list[str] | None = None, constraints: dict | None = None,
              **cost_options) -> dict[str, Any]:
    """Estimate of every baseline (name -> estimate dict, or ``"oom"`` when it cannot fit), each
    searched under its :data:`BASELINES` constraints plus ``constraints`` (e.g. a batch bound)."""
    cluster = resolve_cluster(cluster)
    world = int(world_size or cluster.world_size)
    out: dict[str, Any] = {}
    for name in names or list(BASELINES):
        cons = {**baseline_constraints(name, gm, cluster, world), **(constraints or {})}
        try:
            plan = search(gm, cluster, memory_budget, global_batch_size, constraints=cons, world_size=world,
                          **cost_options)
        except InfeasibleError:
            out[name] = "oom"
            continue
        out[name] = dict(plan.estimate, config=plan_config(plan))
    return out


def plan_config(plan: Plan) -> str:
    """A plan's configuration in one line: ``tp2·dp4·zero3·sp·ckpt pp2 1f1b m4 v2`` (a uniform
    plan's one strategy, else its strategies' count; ``v`` virtual stages when interleaved)."""
    kinds = {lp.strategy for lp in plan.layers}
    layer = kinds.pop().label if len(kinds) == 1 else f"{len(kinds)} strategies"
    if plan.pp == 1:   # one stage: no schedule, the micro-batches are gradient accumulation
        return f"{layer} pp1 m{plan.micro_batches}"
    v = f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return f"{layer} pp{plan.pp} {plan.schedule} m{plan.micro_batches}{v}"


def baseline_constraints(name: str, gm: torch.fx.GraphModule, cluster: Cluster, world: int) -> dict:
    """The search constraints of baseline ``name`` for ``gm`` on ``world`` devices of ``cluster``."""
    cons = dict(BASELINES[name])
    if name == "tp":
        cons["tp"] = min(world, getattr(cluster, "devices_per_node", world))
    if name == "pp":
        n_layers = len(gm.meta[META_KEY].layers)
        cons["pp"] = max(d for d in range(1, world + 1) if world % d == 0 and d <= n_layers)
    return cons


def speedups(plan: Plan, base: dict[str, Any]) -> dict[str, float | None]:
    """Searched throughput over each baseline's (None where the baseline is "oom")."""
    t = plan.estimate["throughput_samples_s"]
    return {k: (t / v["throughput_samples_s"] if isinstance(v, dict) else None) for k, v in base.items()}


def broadcast_plan(make_plan: Callable[[], Plan]) -> Plan:
    """``make_plan()`` on rank 0 of the live torch.distributed world, its plan broadcast to every
    rank (collective: call it on all ranks). A :class:`GalvatronError` on rank 0 is raised on every
    rank as :class:`ConfigError` naming it."""
    return Plan.from_dict(on_rank0(lambda: make_plan().to_dict()))


def on_rank0(make: Callable[[], Any]) -> Any:
    """``make()`` on rank 0, its (picklable) result broadcast to every rank (collective). A
    :class:`GalvatronError` on rank 0 is raised on every rank as :class:`ConfigError` naming it."""
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", make())
        except GalvatronError as exc:
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status != "ok":
        raise ConfigError(f"the plan search on rank 0 failed: {value}")
    return value
