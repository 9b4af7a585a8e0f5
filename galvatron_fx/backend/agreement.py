"""Plan agreement across ranks for the galvatron backend (step 2 of the package docstring).

Takes the normalised graph, the :class:`BackendOptions` and the global batch size; gives the
:class:`~galvatron_fx.plan.Plan` every rank runs: ``options["plan"]`` loaded on every rank, or
searched on rank 0 (:func:`_search`) and broadcast. Every rank then all-gathers a digest of
(plan, model fingerprint) and all raise :class:`PlanMismatchError` if any differs, or
:class:`ConfigError` if the plan's global batch is not the one the model was called with.

NOTE: :func:`_agreed_plan` looks :func:`_search` up in this module at call time, so a test may
replace ``galvatron_fx.backend.agreement._search`` to forbid or count plan searches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings

import torch.distributed as dist

from ..errors import ConfigError, PlanMismatchError
from ..ir import META_KEY
from .options import BackendOptions, stats


def _search(graph, opts: BackendOptions, batch: int, cluster):
    """Search a plan (rank 0). Separate so tests can count or forbid it."""
    from ..api import search

    stats["searches"] += 1
    cost = {}
    if opts.reserve is not None:
        cost["reserve_bytes"] = opts.reserve
    if opts.measure:
        cost["measure"] = opts.measure   # collective: every rank times the candidates
        cost["measure_options"] = opts.measure_options
    return search(graph, cluster, opts.memory_budget, batch, constraints=opts.constraints,
                  world_size=dist.get_world_size(), precision=opts.precision, **cost)


def _warn_mixed_default_on_cpu(cluster) -> None:
    """Say so when a GPU preset's default precision (bf16 / fp16 mixed) would train on a CPU world,
    where low-precision matmuls run far slower than fp32 (~80x on x86 CPUs without AMX)."""
    from ..cluster import default_precision
    from ..distributed import pick_device

    precision = default_precision(cluster)
    if precision != "fp32" and pick_device().type == "cpu":
        warnings.warn(f"galvatron backend: cluster {cluster.name!r} trains in {precision} by default, but this "
                      f"world computes on the CPU, where {precision.split('-')[0]} matmuls are far slower than "
                      "fp32; pass options={'precision': 'fp32'} (--precision fp32), or the precision you "
                      "intend, to silence this", stacklevel=3)


def _with_door(plan, tensors: int):
    """``plan`` with the torch.compile door's cost per step in its estimate: its cluster's
    :meth:`~galvatron_fx.cluster.Cluster.door_time` for ``tensors`` trainable parameter tensors as
    ``estimate["door_s"]``, added to ``step_time_s`` (the throughput re-derived) and to the measured
    selection's ``calibrated_step_s`` (its candidates are timed on ``train_step``, without the door).
    The search ranks plans without it: every plan of one model pays the same. Once only: a plan
    whose estimate holds ``door_s`` already (saved by an earlier compile) is returned as it is."""
    from ..cluster import Cluster

    est = plan.estimate
    door = Cluster.from_dict(plan.cluster).door_time(tensors) if plan.cluster else 0.0
    if "door_s" in est or est.get("step_time_s") is None or door <= 0:
        return plan
    step = est["step_time_s"] + door
    est = {**est, "door_s": door, "step_time_s": step, "throughput_samples_s": plan.global_batch_size / step}
    extra = dict(plan.extra)
    measured = extra.get("measure")
    if isinstance(measured, dict) and measured.get("calibrated_step_s") is not None:
        extra["measure"] = {**measured, "calibrated_step_s": measured["calibrated_step_s"] + door}
    return dataclasses.replace(plan, estimate=est, extra=extra)


def _agreed_plan(graph, opts: BackendOptions, batch: int, tensors: int = 0):
    """The plan every rank runs: loaded, or searched on rank 0 and broadcast, the door's cost in its
    estimate (:func:`_with_door`, ``tensors`` trainable parameter tensors); then verified."""
    from ..plan import Plan
    from ..planner import broadcast_plan, resolve_cluster

    info = graph.meta[META_KEY]
    if opts.plan is not None:
        plan = opts.plan if isinstance(opts.plan, Plan) else Plan.load(opts.plan)
        if opts.precision is not None and opts.precision != plan.precision:
            # NOTE: not silent: the plan's estimate was priced for its own precision
            warnings.warn(f"galvatron backend: option precision={opts.precision!r} overrides the plan's "
                          f"{plan.precision!r}; the plan's memory and time estimate were made for "
                          f"{plan.precision!r} (re-plan with --precision {opts.precision} to match)", stacklevel=2)
            plan = dataclasses.replace(plan, precision=opts.precision)
    else:
        cluster = resolve_cluster(opts.cluster)  # None: profiles the live world (collective on every rank)
        if opts.precision is None:
            _warn_mixed_default_on_cpu(cluster)
        if opts.measure:
            plan = _search(graph, opts, batch, cluster)
        else:
            plan = broadcast_plan(lambda: _search(graph, opts, batch, cluster))
    plan = _with_door(plan, tensors)
    digest = hashlib.sha256(json.dumps([plan.to_dict(), info.fingerprint], sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PlanMismatchError(
            f"ranks disagree on the plan or the model before the first step (plan/model digest of rank 0 "
            f"{digests[0]}, ranks {odd} differ: {[digests[r] for r in odd]}); give every rank the same "
            "options['plan'] file and the same model")
    if plan.global_batch_size != batch:
        raise ConfigError(f"the plan is for global batch {plan.global_batch_size} but the model was called with "
                          f"{batch} samples; call it with the plan's global batch or re-plan")
    return plan
