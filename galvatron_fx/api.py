"""``gfx.search`` and ``gfx.transform``: the planner, the measured selection and the program builder
composed in one place, so that none of them imports another back.

* :func:`search` is :func:`galvatron_fx.planner.search` (the best plan under the cost model), or with
  ``measure=K`` :func:`galvatron_fx.selection.measured_search`, which times the planner's candidates
  as :func:`galvatron_fx.parallelize.transform` builds them.
* :func:`transform` is :func:`galvatron_fx.parallelize.transform` for a plan, or for ``plan=None``
  the plan :func:`search_on_rank0` finds first.

Imports point one way: ``api -> selection -> (planner, parallelize)``; the planner never imports
the selection or the builder, and the builder never imports the planner.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx

from .errors import ConfigError
from .ir import graph_batch_size
from .parallelize import DEFAULT_BUCKET_BYTES, check_transformable
from .parallelize import transform as build
from .plan import Plan
from .planner import _as_graph, broadcast_plan, resolve_cluster
from .planner import search as plan_search


def search(model, cluster=None, memory_budget=None, global_batch_size: int | None = None, *,
           example_inputs=None, constraints: dict | None = None, world_size: int | None = None,
           method: str = "dynamo", progress: bool | Callable[[str], None] = False, precision: str | None = None,
           measure: int = 0, measure_options: dict | None = None, **cost_options) -> Plan:
    """Search the best plan for ``model`` (a captured graph, or an ``nn.Module`` with
    ``example_inputs``, meta-device models welcome) on ``cluster`` under ``memory_budget`` bytes per
    device (default: the device memory); every argument but ``measure`` / ``measure_options`` as
    :func:`galvatron_fx.planner.search`, which states the result (the best plan under the cost model)
    and its errors.

    ``measure=K`` (collective: every rank calls it under torch.distributed) times the ``K`` best
    distinct plans by estimate and the best plan of every baseline family on the live world and
    returns the fastest measured (:mod:`galvatron_fx.selection`; ``measure_options``: its budget);
    ``plan.extra["measured"]`` records every candidate's estimated and measured step.
    """
    cluster = resolve_cluster(cluster)
    gm = _as_graph(model, example_inputs, method)

    def search_fn(extra: dict | None = None) -> Plan:
        return plan_search(gm, cluster, memory_budget, global_batch_size,
                           constraints={**(constraints or {}), **(extra or {})}, world_size=world_size,
                           progress=progress, precision=precision, **cost_options)
    if not measure:
        return search_fn()
    from .selection import measured_search

    return measured_search(gm, search_fn, int(measure), cluster, constraints, measure_options)


def search_on_rank0(gm: torch.fx.GraphModule, cluster=None, memory_budget=None,
                    global_batch_size: int | None = None, **kwargs) -> Plan:
    """:func:`search` for the live world on rank 0, the plan broadcast to every rank (collective).
    ``cluster=None`` profiles the live world (collective on every rank too). With ``measure=K`` every
    rank searches along (the candidates come from rank 0) and times the candidates."""
    import torch.distributed as dist

    cluster = resolve_cluster(cluster)
    if kwargs.get("measure"):
        return search(gm, cluster, memory_budget, global_batch_size, world_size=dist.get_world_size(), **kwargs)
    return broadcast_plan(lambda: search(gm, cluster, memory_budget, global_batch_size,
                                         world_size=dist.get_world_size(), **kwargs))


def transform(gm: torch.fx.GraphModule, plan: Plan | None = None, loss_fn=None, *,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, bind: dict | None = None,
              reduce_dtype: str | None = None, **search_options):
    """This rank's distributed module for ``plan``: :func:`galvatron_fx.parallelize.transform`
    (its arguments, its result, its errors). ``plan=None``: rank 0 searches one first
    (:func:`search_on_rank0`, with ``search_options``: the cluster profiled from the live world
    unless they name one; the global batch the captured one) and every rank runs it."""
    if plan is None:
        check_transformable(gm)
        search_options.setdefault("global_batch_size", graph_batch_size(gm))
        plan = search_on_rank0(gm, **search_options)
    elif search_options:
        raise ConfigError(f"gfx.transform: {sorted(search_options)} only apply when it searches (plan=None)")
    return build(gm, plan, loss_fn, bucket_bytes=bucket_bytes, bind=bind, reduce_dtype=reduce_dtype)
