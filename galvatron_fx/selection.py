"""Measured final selection: the plan a user gets is the fastest of a few, timed on the live world.

``gfx.search(..., measure=K)`` (collective: every rank calls it under torch.distributed):

1. *Candidates* (rank 0, :func:`candidates`, broadcast): the searched best plan; the best plan of
   every other pipeline degree and the best uniform plan; of these the ``K`` best distinct plans by
   estimate; plus the best plan of every baseline family that fits (:data:`planner.BASELINES`, the
   ones ``galvatron-fx plan --baselines`` prints), duplicates dropped.
2. *Measurement* (every rank, :func:`measure_plans`): one candidate at a time (one program in memory
   at a time), ``gfx.transform`` builds it, then ``warmup`` + ``steps`` training steps
   (``train_step`` and an AdamW step) run on a synthetic batch in the graph inputs' shapes (integer
   inputs 1, floats N(0, 1)). A candidate's time is its steps' median on the slowest rank, the
   ``steps`` timed steps run back to back as training runs them (:func:`_time_steps`). A candidate
   that fails to build or run on any rank (a plan that does not build, out of memory before its
   first collective) is skipped on every rank and its error recorded; one that fails inside a
   collective on one rank only still stops the run. Up to ``rounds`` - 1 more rounds, in
   alternating order, time the candidates again: every one in the second round (one round in a few
   runs 1.5x slow on a shared host), then those whose best round is within ``close`` (20 %: short
   runs of one plan measure 10-20 % apart) of the fastest's; each counts with the median of its
   rounds. No new candidate starts after ``seconds``.
3. The fastest measured candidate is returned (:func:`winner`: of those the timing cannot tell
   apart from the fastest, within ``tie`` of it, or within ``doubt`` while a round had them within
   ``tie``, the one the model prices fastest), with ``plan.extra["measured"]``: per candidate its
   name, label, estimated and measured step (seconds), rounds and each round's seconds
   (``round_s``, ``None`` where it sat out), and ``plan.extra["measure"]``:
   the budget used (candidates, steps, seconds), the cluster's time scales refitted to the
   measurements of the candidates within ``close`` of the fastest (``fit``: :func:`near_fastest`,
   :func:`fit_time_scales`), the chosen plan's step re-priced with them
   (``calibrated_step_s``), how many candidates the fit took (``fitted_candidates``) and their
   median estimate error before and after it (``error_before``, ``error_after``:
   :func:`calibration_error`, in sample).
4. *Calibration*: ``Cluster.calibrated(fit)`` is the cluster with the fit; ``galvatron-fx plan /
   train --measure K --cluster FILE`` writes it back to FILE (``--no-calibrate``: not), so the next
   search on FILE starts closer. The fit moves the scales only (``time_scale``,
   ``pipeline_time_scale``); a cluster JSON may also carry per-step constants (``step_overhead_s``,
   ``pipeline_step_s``), which the search prices too (:data:`galvatron_fx.cluster.CALIBRATION_FIELDS`).

Budget: ``(warmup + steps)`` steps per candidate and round, plus one transform each. The number of
candidates is at most ``K`` plus the baseline families (8), and usually fewer (baselines coincide
on small worlds); the time grows with the model's step time, not with the search space.
A meta-device model is timed with this rank's parts of each candidate randomly initialised
(``dist_model.init_weights``): only shapes matter to the time.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time

import torch
import torch.distributed as dist

from .errors import ConfigError, GalvatronError, InfeasibleError
from .ir import META_KEY, graph_batch_size
from .plan import Plan
from .solver.objective import Pipe, stage_limit, stage_total, step_time

DEFAULTS = {"warmup": 3, "steps": 8, "close": 0.20, "rounds": 3, "seconds": 120.0, "tie": 0.03,
            "doubt": 0.10}
"""Measurement options (``measure_options={...}``): warm-up and timed steps per candidate and round,
the relative gap under which a candidate is timed again, the rounds for those (the first included),
the time after which no new candidate starts (seconds), the relative gap within which two measured
candidates tie, and the one within which they tie unless every round tells them apart
(:func:`winner`)."""


def winner(rounds: dict[int, dict[int, float]], estimated: dict[int, float | None], tie: float,
           doubt: float = 0.0) -> int:
    """The candidate a measured selection returns, from each candidate's seconds per round
    (``rounds[i][k]``: candidate ``i`` in round ``k``; the rounds alternate the order, so a round's
    figures are paired in time). The fastest by median wins over a candidate that the timing tells
    apart from it; of the others (and it) the one with the lowest estimate wins (then the lowest
    median). A candidate is not told apart from the fastest when its median is within ``tie``
    (relative), or within ``doubt`` while at least one round they share had it within ``tie`` of
    the fastest's figure of that round, faster included. Short timings of one plan differ by 5-10 %
    on a shared host (measured: docs/measurements.md, "Figures behind the design")."""
    med = {i: statistics.median(r.values()) for i, r in rounds.items() if r}
    best = min(med, key=lambda i: (med[i], i))

    def undecided(i: int) -> bool:
        if med[i] <= med[best] * (1 + tie):
            return True
        shared = rounds[i].keys() & rounds[best].keys()
        return med[i] <= med[best] * (1 + doubt) and any(rounds[i][k] <= rounds[best][k] * (1 + tie) for k in shared)

    tied = [i for i in med if undecided(i)]
    return min(tied, key=lambda i: (math.inf if estimated.get(i) is None else estimated[i], med[i]))


def label(plan: Plan) -> str:
    """A short description: ``pp2 m2 1f1b | tp1·dp2, tp2·dp1·zero3·ckpt`` (the layers' distinct
    strategy labels, sorted)."""
    kinds = sorted({lp.strategy.label for lp in plan.layers})
    return f"pp{plan.pp} m{plan.micro_batches} {plan.schedule} | " + ", ".join(kinds)


def measured_lines(records: list[dict]) -> list[str]:
    """One line per candidate of ``plan.extra["measured"]``: its name, estimated and measured step
    (ms; ``-`` where there is none) and label; what the command line and the main job print."""
    def ms(s):
        return "-" if s is None else f"{s * 1e3:.1f} ms"
    return [f"timed {r['name']:<18} est. {ms(r['estimated_step_s']):>9}  measured {ms(r['measured_step_s']):>9}  "
            f"{r['label']}" for r in records]


def plan_key(plan: Plan) -> tuple:
    """What makes two plans the same program: pipeline, micro-batches, schedule, stages and every
    layer's strategy (estimates and records aside)."""
    return (plan.pp, plan.micro_batches, plan.schedule if plan.pp > 1 else "", tuple(map(tuple, plan.stages)),
            tuple(lp.strategy for lp in plan.layers))


def candidates(search, best: Plan, k: int, gm: torch.fx.GraphModule, cluster, world: int,
               constraints: dict | None) -> list[tuple[str, Plan]]:
    """``(name, plan)`` to measure (module docstring, step 1). ``search(constraints)`` runs the
    planner's search with the user's constraints updated by ``constraints``; ``best`` is its result
    unconstrained."""
    from .planner import BASELINES, baseline_constraints

    n_layers = len(gm.meta[META_KEY].layers)
    pool = [("searched", best)]
    variants = [({"pp": p}, f"best pp{p}") for p in range(1, world + 1)
                if world % p == 0 and p <= n_layers and p != best.pp]
    variants.append(({"uniform": True}, "best uniform"))
    for extra, name in variants:
        try:
            pool.append((name, search(extra)))
        except InfeasibleError:
            pass
    pool.sort(key=lambda np_: -np_[1].estimate["throughput_samples_s"])
    out, seen = [], set()
    for name, plan in pool:
        if plan_key(plan) not in seen and len(out) < max(k, 1):
            seen.add(plan_key(plan))
            out.append((name, plan))
    for name in BASELINES:
        try:
            plan = search({**baseline_constraints(name, gm, cluster, world), **(constraints or {})})
        except (InfeasibleError, ConfigError):
            continue
        if plan_key(plan) not in seen:
            seen.add(plan_key(plan))
            out.append((f"baseline {name}", plan))
    return out


def synthetic_inputs(gm: torch.fx.GraphModule, batch: int, device: torch.device) -> list[torch.Tensor]:
    """The graph's inputs in their captured shapes (dim 0 of batched inputs ``batch`` when the
    graph's batch is symbolic, or an fx graph's): integers 1 (valid token ids, masks that attend),
    floats N(0, 1)."""
    info = gm.meta[META_KEY]
    captured = graph_batch_size(gm)
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        shape = list(val.shape)
        # NOTE: fx graphs read their sizes at run time: they take any batch too
        if (info.symbolic_batch or info.method == "fx") and shape and (captured is None or shape[0] == captured):
            shape[0] = batch
        if val.is_floating_point():
            out.append(torch.randn(shape, dtype=val.dtype, device=device))
        else:
            out.append(torch.ones(shape, dtype=val.dtype, device=device))
    return out


def _time_steps(dm, inputs, warmup: int, steps: int, device) -> float:
    """Seconds per training step: ``warmup`` steps, a barrier, then ``steps`` steps back to back as
    a training loop runs them, each timed; the median step of each rank, the slowest rank's. No
    barrier between steps: a pipeline's stages overlap one step's tail with the next one's head,
    and a barrier per step prices what training never pays; the median, not the mean: one step
    in a few on a shared host runs 1.5-2x slower (the 20-step runs of the main job)."""
    from .distributed import synchronize

    # NOTE: lr 0: the same work, and no value a candidate holds moves (each transform copies the
    # model's values today; this keeps the measurement harmless if one ever shares them)
    opt = torch.optim.AdamW([p for p in dm.parameters() if p.requires_grad], lr=0.0)

    def step() -> None:
        dm.train_step(*inputs)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    synchronize(device)
    dist.all_reduce(torch.zeros(1, device=device))   # NOTE: a barrier that needs no device guess (NCCL's does)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    # NOTE: on the compute device: NCCL reduces device tensors only
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def measure_plans(gm: torch.fx.GraphModule, cands: list[tuple[str, Plan]], options: dict | None = None
                  ) -> tuple[Plan, list[dict]]:
    """Time every candidate on the live world (module docstring, step 2; collective); returns the
    fastest measured plan and one record per candidate. Leaves the model and the process as it found
    them: floating buffers (a norm's running statistics: restored) and the random number generators
    (the synthetic batch, dropout: forked), so that training the chosen plan gives what training it
    without the measurement gives."""
    from .distributed import pick_device

    device = pick_device()
    buffers = [(b, b.detach().clone()) for b in gm.buffers() if b.is_floating_point() and not b.is_meta]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        out = _measure_plans(gm, cands, options, device)
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    return out


def _measure_plans(gm: torch.fx.GraphModule, cands: list[tuple[str, Plan]], options: dict | None,
                   device: torch.device) -> tuple[Plan, list[dict]]:
    from .parallelize import transform

    opts = {**DEFAULTS, **(options or {})}
    unknown = sorted(set(opts) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown measure option(s) {unknown}; known: {', '.join(DEFAULTS)}")
    on_meta = any(p.is_meta for p in gm.parameters())
    runs: dict[int, dict[int, float]] = {i: {} for i in range(len(cands))}   # candidate -> round -> seconds
    failed: dict[int, str] = {}
    start = time.perf_counter()

    def run(i: int, k: int) -> None:
        plan, dm, error = cands[i][1], None, ""
        try:
            dm = transform(gm, plan=plan)
            if on_meta:   # no values to time with: this rank's parts, randomly initialised
                dm.init_weights(seed=0)
            inputs = synthetic_inputs(gm, plan.global_batch_size, device)
            step = _time_steps(dm, inputs, int(opts["warmup"]), int(opts["steps"]), device)
        except (GalvatronError, RuntimeError) as exc:   # out of memory included (torch.OutOfMemoryError)
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        del dm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # NOTE: every rank skips a candidate that failed on any (an error raised alike on every rank:
        # a plan that does not build, memory that does not suffice before the first collective)
        ok = torch.tensor([0.0 if error else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if float(ok) < 1.0:
            failed[i] = error or "failed on another rank"
        else:
            runs[i][k] = step

    def medians() -> dict[int, float]:
        """Each timed candidate's median over its rounds."""
        return {i: statistics.median(v.values()) for i, v in runs.items() if v}

    for i in range(len(cands)):
        if i and _elapsed(start, device) > opts["seconds"]:
            break
        run(i, 0)
    timed = medians()
    if not timed:
        raise ConfigError("search(measure=K): no candidate plan ran on the live world: "
                          + "; ".join(f"{cands[i][0]}: {e}" for i, e in failed.items()))
    for k in range(1, int(opts["rounds"])):   # every one again, then the close ones; order alternating
        # NOTE: closeness on each candidate's best round: noise only slows a run, and one slow first
        # round (1.5x here, one in a few) once left DP out of the regret sweep's race (regret 1.24)
        best = {i: min(runs[i].values()) for i in timed}
        fastest = min(best.values())
        close = [i for i in sorted(timed, reverse=k % 2 == 1) if k == 1 or best[i] <= fastest * (1 + opts["close"])]
        if len(close) < 2 or _elapsed(start, device) > opts["seconds"]:
            break
        for i in close:
            run(i, k)
        timed = medians()
    records = []
    done = 1 + max(k for r in runs.values() for k in r)
    for i, (name, plan) in enumerate(cands):
        est = plan.estimate.get("step_time_s")
        step = timed.get(i)
        records.append({"name": name, "label": label(plan), "estimated_step_s": est, "measured_step_s": step,
                        "rounds": len(runs[i]), "round_s": [runs[i].get(k) for k in range(done)],
                        **({"error": failed[i]} if i in failed and not runs[i] else {})})
    win = winner({i: r for i, r in runs.items() if r}, {i: cands[i][1].estimate.get("step_time_s") for i in timed},
                 float(opts["tie"]), float(opts["doubt"]))
    plan = dataclasses.replace(cands[win][1])
    plan.extra = {**cands[win][1].extra, "measured": records, "chosen": cands[win][0],
                  "measure": {"candidates": len(cands), "timed": sum(1 for v in runs.values() if v),
                              "steps_per_round": int(opts["warmup"]) + int(opts["steps"]),
                              "seconds": round(_elapsed(start, device), 3)}}
    return plan, records


def _elapsed(start: float, device: torch.device) -> float:
    """Seconds since ``start``, agreed on every rank (rank 0's), so every rank stops alike."""
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t)


def measured_search(gm: torch.fx.GraphModule, search_fn, k: int, cluster, constraints: dict | None,
                    options: dict | None = None) -> Plan:
    """``search_fn(extra_constraints)`` on rank 0 for the candidates, broadcast, then measured on
    every rank (collective); see the module docstring."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("search(measure=K) times candidate plans on the live world: run it under torchrun "
                          "(torch.distributed initialised) on every rank, or use measure=0")
    from .planner import on_rank0

    value = on_rank0(lambda: [(n, p.to_dict()) for n, p in candidates(search_fn, search_fn({}), k, gm, cluster,
                                                                      dist.get_world_size(), constraints)])
    cands = [(n, Plan.from_dict(d)) for n, d in value]
    plan, records = measure_plans(gm, cands, options)
    plans = [p for _n, p in cands]
    world = dist.get_world_size()
    near = near_fastest(records, {**DEFAULTS, **(options or {})}["close"])
    fitted_records, fitted_plans = [records[i] for i in near], [plans[i] for i in near]
    fit = fit_time_scales(fitted_records, fitted_plans, cluster, world)
    fitted = cluster.calibrated(fit)

    def recalibrated(estimate: float, plan: Plan) -> float:
        """The estimate re-priced on the fitted cluster."""
        pipe = Pipe.of(plan)
        return step_time(fitted, plan.pp, world, stage_limit(cluster, plan.pp, world, estimate, pipe), pipe)

    plan.extra["measure"].update(
        fit=fit, fitted_candidates=len(near), calibrated_step_s=recalibrated(plan.estimate["step_time_s"], plan),
        error_before=calibration_error(fitted_records, fitted_plans, lambda e, _plan: e),
        error_after=calibration_error(fitted_records, fitted_plans, recalibrated))
    return plan


FIT_MIN_PER_KIND = 2
"""Measured candidates each kind (unpipelined, pipelined) needs for its own scale in
:func:`fit_time_scales`; with fewer the fit is one uniform scale."""


def near_fastest(records: list[dict], close: float) -> list[int]:
    """Indices of the measured candidates within ``close`` of the fastest, at least the
    :data:`FIT_MIN_PER_KIND` fastest: the ones the time scales are fitted to
    (:func:`measured_search`). They are the plans a search chooses among, each timed in the most
    rounds; slower ones are off for reasons of their own and would move every plan's scale; one
    short run alone is too noisy to fit to (measured: docs/measurements.md, "Figures behind the design")."""
    timed = sorted((r["measured_step_s"], i) for i, r in enumerate(records) if r["measured_step_s"] is not None)
    if not timed:
        return []
    fastest = timed[0][0]
    near = {i for k, (t, i) in enumerate(timed) if t <= fastest * (1 + close) or k < FIT_MIN_PER_KIND}
    return sorted(near)


def fit_time_scales(records: list[dict], plans: list[Plan], cluster, world: int) -> dict[str, float]:
    """The cluster's time scales (:data:`galvatron_fx.cluster.SCALE_FIELDS`) refitted to the
    measured candidates: each candidate's slowest stage as the cluster prices it (its estimate
    less the per-step constant, over the scale: its wait at the transfers included,
    :func:`~.solver.objective.stage_total`) against its measured step less the constant; the
    median ratio of the unpipelined candidates moves ``time_scale``, the pipelined ones' median
    beyond that moves ``pipeline_time_scale``. Where a kind has fewer than :data:`FIT_MIN_PER_KIND`
    measured candidates, the median of all the ratios moves ``time_scale`` alone (a uniform scale:
    the next search ranks plans as before, its estimates closer): one short run of one plan is too
    noisy to set a kind's scale. The constants are kept. Why scales, not constants: the residuals
    were proportional to the estimates (measured: docs/measurements.md, "Figures behind the design")."""
    flat, piped = [], []
    for r, plan in zip(records, plans):
        if r["measured_step_s"] is None or not r["estimated_step_s"]:
            continue
        stage = stage_total(cluster, plan.pp, world, r["estimated_step_s"])
        wanted = stage_total(cluster, plan.pp, world, r["measured_step_s"])
        if stage > 0 and wanted > 0:
            (piped if plan.pp > 1 else flat).append(wanted / stage)
    base = float(getattr(cluster, "time_scale", 1.0))
    pipe = float(getattr(cluster, "pipeline_time_scale", 1.0))
    if len(flat) >= FIT_MIN_PER_KIND and len(piped) >= FIT_MIN_PER_KIND:
        r0 = statistics.median(flat)
        return {"time_scale": base * r0, "pipeline_time_scale": pipe * statistics.median(piped) / r0}
    if flat or piped:
        return {"time_scale": base * statistics.median(flat + piped), "pipeline_time_scale": pipe}
    return {"time_scale": base, "pipeline_time_scale": pipe}


def calibration_error(records: list[dict], plans: list[Plan], calibrate) -> float:
    """Median relative error of ``calibrate(estimate, plan)`` against the measured candidates (in
    sample: how well a calibration describes the measurements it was fitted to)."""
    errors = [abs(calibrate(r["estimated_step_s"], p) / r["measured_step_s"] - 1)
              for r, p in zip(records, plans) if r["measured_step_s"] and r["estimated_step_s"] is not None]
    return statistics.median(errors) if errors else math.inf
