"""The host budget (CPU offload) in the exact search: a stage's layers keep at most the device's share
of host memory, ``sum_l H[l, s_l] <= host_budget``, besides the device-memory budget.

* :func:`~galvatron_fx.solver.stage.solve_stage_exact` against every sequence
  (``itertools.product``) under the same objective, on random instances where the host budget binds
  (the device-memory optimum keeps too much in host memory), with every A* search refining at once
  or not; all-zero host bytes (or a budget even the hungriest sequence fits) solve exactly as
  without a host.
* :func:`~galvatron_fx.solver.tables.undominated` never drops a strategy for one keeping more host
  bytes.
* ``gfx.search`` against the exhaustive enumeration of tests/test_search_exact.py with the host
  check applied, on a cost model whose ZeRO-3 strategies keep host bytes (a stand-in for offload:
  host bytes on the strategies that save device memory), at host budgets that bind; and the
  infeasible search's message when the host budget binds alone or with the memory budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types

import numpy as np
import pytest

import galvatron_fx as gfx
from galvatron_fx import planner
from galvatron_fx.solver import stage as stage_mod
from galvatron_fx.solver.engine import Engine, SearchResult
from galvatron_fx.solver.stage import binding_host, path_cost, solve_stage_exact
from galvatron_fx.solver.tables import undominated
from tests import test_search_exact as exact


def _brute(T, M, X, R, gid, P, budget, H=None, host_budget=math.inf):
    """The best sequence in bytes: ``sum M + max X <= budget`` and ``sum H <= host_budget``."""
    n, S = T.shape
    best = (math.inf, None)
    for path in itertools.product(range(S), repeat=n):
        if not all(np.isfinite(T[l, s]) for l, s in enumerate(path)):
            continue
        if sum(M[l, s] for l, s in enumerate(path)) + max(X[l, s] for l, s in enumerate(path)) > budget:
            continue
        if H is not None and sum(H[l, s] for l, s in enumerate(path)) > host_budget:
            continue
        c = path_cost(T, R, gid, P, path)
        if c < best[0]:
            best = (c, path)
    return best


def _instance(rng, it: int):
    """A random stage: offloaded strategies (host bytes > 0) leaner on the device, so the device
    budget pushes towards them; whole host bytes (as the cost model's)."""
    n, S = int(rng.integers(1, 5)), int(rng.integers(2, 7))
    gid = rng.integers(0, int(rng.integers(1, S + 1)), S)
    G = int(gid.max()) + 1
    T = rng.uniform(0, 1, (n, S))
    T[rng.random((n, S)) < 0.1] = np.inf
    M = rng.integers(0, 50, (n, S)).astype(float) if it % 2 else rng.uniform(0, 50, (n, S))
    off = rng.random((n, S)) < 0.5
    M = np.where(off, M * 0.3, M)
    H = np.where(off, rng.integers(1, 40, (n, S)), 0).astype(float)
    X = rng.integers(0, 4, (n, S)).astype(float) * rng.integers(0, 20)
    R = rng.uniform(0, 0.3, (max(n - 1, 0), G, G))
    P = rng.uniform(0, 0.2, S)
    budget = float(rng.uniform(10 * n, 50 * n))
    return T, M, X, R, gid, P, budget, H


@pytest.mark.parametrize("refine", [False, True])
def test_stage_solve_under_a_host_budget_matches_brute_force(refine, monkeypatch):
    if refine:  # every A* search refines its relaxation as soon as it can
        monkeypatch.setattr(stage_mod, "ASTAR_EXPANSIONS", 1)
    searched = []
    real = stage_mod._astar

    def astar(*args, **kw):   # count the A* searches that carry host bytes
        searched.append(len(args) > 6 and args[6] is not None)
        return real(*args, **kw)
    monkeypatch.setattr(stage_mod, "_astar", astar)
    rng = np.random.default_rng(5 + refine)
    binds = feasible = 0
    for it in range(220):
        T, M, X, R, gid, P, budget, H = _instance(rng, it)
        free_cost, free_path = _brute(T, M, X, R, gid, P, budget)
        if free_path is None:
            continue
        free_host = sum(H[l, s] for l, s in enumerate(free_path))
        # a host budget below the device-memory optimum's host bytes (it binds), or anywhere
        host_budget = float(rng.integers(0, int(free_host))) if free_host > 0 and it % 4 else float(rng.integers(0, 80))
        cost, path = _brute(T, M, X, R, gid, P, budget, H, host_budget)
        units = int(rng.choice([1, 2, 16, 256]))
        sol = solve_stage_exact(T, M, X, R, budget, groups=gid, final=P, units=units, host=H,
                                host_budget=host_budget)
        binds += free_host > host_budget
        if path is None:
            assert not sol.feasible, (it, sol)
            continue
        feasible += 1
        assert sol.feasible and sol.cost == pytest.approx(cost, rel=1e-12, abs=1e-15), (it, sol, cost, path)
        assert sol.memory_bytes <= budget
        assert sol.host_bytes == sum(H[l, s] for l, s in enumerate(sol.strategies)) <= host_budget
        assert free_host <= host_budget or cost >= free_cost
        # a cutoff at the optimum finds nothing below it; just above, it finds the optimum
        kw = dict(groups=gid, final=P, units=units, host=H, host_budget=host_budget)
        assert not solve_stage_exact(T, M, X, R, budget, cutoff=cost, **kw).feasible
        assert solve_stage_exact(T, M, X, R, budget, cutoff=cost * (1 + 1e-9) + 1e-12, **kw).feasible
    assert binds >= 80 and feasible >= 60 and sum(searched) >= 10, (binds, feasible, sum(searched))


def test_the_device_optimum_is_refused_when_it_overflows_the_host():
    """Two layers: the fast, lean strategy 1 keeps 10 host bytes a layer; the host takes 15."""
    T = np.array([[2.0, 1.0], [2.0, 1.0]])
    M = np.array([[30.0, 10.0], [30.0, 10.0]])
    H = np.array([[0.0, 10.0], [0.0, 10.0]])
    assert solve_stage_exact(T, M, None, None, 60.0).strategies == (1, 1)
    sol = solve_stage_exact(T, M, None, None, 60.0, host=H, host_budget=15.0)
    assert sol.strategies == (0, 1) and sol.cost == 3.0 and sol.host_bytes == 10.0
    assert not solve_stage_exact(T, M, None, None, 39.0, host=H, host_budget=15.0).feasible
    # inf host bytes: the strategy is not allowed
    assert solve_stage_exact(T, M, None, None, 60.0, host=np.where(H > 0, np.inf, 0.0)).strategies == (0, 0)


def test_a_host_budget_that_cannot_bind_solves_as_without_one():
    rng = np.random.default_rng(3)
    for it in range(60):
        T, M, X, R, gid, P, budget, H = _instance(rng, it)
        plain = solve_stage_exact(T, M, X, R, budget, groups=gid, final=P)
        assert solve_stage_exact(T, M, X, R, budget, groups=gid, final=P, host=np.zeros_like(H),
                                 host_budget=0.0) == plain
        worst = float(np.where(np.isfinite(T), H, 0.0).max(axis=1).sum())
        assert binding_host(H, np.isfinite(T), worst) is None
        assert binding_host(np.zeros_like(H), np.isfinite(T), 0.0) is None
        roomy = solve_stage_exact(T, M, X, R, budget, groups=gid, final=P, host=H, host_budget=worst)
        assert dataclasses.replace(roomy, host_bytes=0.0) == plain


def test_undominated_never_trades_host_bytes_away():
    t = np.array([[1.0, 1.0, 2.0]])
    mem = np.array([[5.0, 5.0, 6.0]])
    trans = np.zeros((1, 3))
    gid = np.zeros(3, dtype=np.int64)
    assert undominated(t, mem, trans, gid).tolist() == [0]
    assert undominated(t, mem, trans, gid, np.array([[4.0, 0.0, 0.0]])).tolist() == [1]
    # the slower, hungrier strategy 2 keeps nothing in host memory: it stays
    assert undominated(t, mem, trans, gid, np.array([[4.0, 4.0, 0.0]])).tolist() == [0, 2]


# ------------------------------------------------------------------ the whole search

class HostCosts:
    """A cost model whose ZeRO-3 strategies keep ``factor`` x their states more in host memory and
    every strategy ``every`` more bytes (besides what offloaded strategies keep: a stand-in for
    CPU offload on more strategies); everything else is the model's."""

    def __init__(self, cm, factor: float, every: float):
        self.cm, self.factor, self.every = cm, factor, every

    def __getattr__(self, name):
        return getattr(self.cm, name)

    def layer_cost(self, index, strategy, micro_batch_size):
        c = self.cm.layer_cost(index, strategy, micro_batch_size)
        host = self.factor * math.ceil(c.states_bytes) if strategy.sdp == "zero3" else 0.0
        return dataclasses.replace(c, host_bytes=float(getattr(c, "host_bytes", 0.0) + host + self.every))


def _offloading(monkeypatch, factor: float = 2.0, every: float = 0.0) -> None:
    """The search, the estimate and the enumeration all price with :class:`HostCosts`."""
    real = planner.cost_model_for

    def wrapped(gm, cluster, **kw):
        return HostCosts(real(gm, cluster, **kw), factor, every)
    monkeypatch.setattr(planner, "cost_model_for", wrapped)
    monkeypatch.setattr(exact, "cost_model_for", wrapped)


def _host(cluster, per_device: int):
    """``cluster`` with ``per_device`` bytes of host memory per device."""
    cluster.host_memory_bytes = int(per_device) * cluster.devices_per_node
    cluster.host_bandwidth = cluster.host_bandwidth or 1e10
    assert cluster.has_host and cluster.host_memory_per_device == per_device
    return cluster


INTERLEAVED = {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2}


@pytest.mark.parametrize("preset, gbs, shares, pin", [("2xA100-80GB", 8, (0.6, 0.95), None),
                                                      ("4xA100-80GB", 4, (0.6,), None),
                                                      ("4xA100-80GB", 4, (0.6, 0.9), INTERLEAVED)])
def test_search_equals_the_enumerated_best_under_a_host_budget(preset, gbs, shares, pin, monkeypatch):
    """At host budgets of ``shares`` of what the unconstrained best plans keep in host memory (the
    most of them, then the least above 0), the searched plan is the enumerated best: slower than without
    the host budget at some memory budget, and at others none fits both budgets (the search says so).
    ``pin``: the search and the enumeration pinned to 2 ranks of 2 chunks (one host budget per rank)."""
    _offloading(monkeypatch)
    gm, cluster = exact._graph(2, False), gfx.Cluster.preset(preset)
    precision = gfx.cluster.default_precision(cluster)
    kw = dict(precision=precision, reserve_bytes=0, constraints=pin)
    with pytest.raises(gfx.InfeasibleError) as err:   # the preset's host is roomy: the device budget binds
        gfx.search(gm, cluster, 1, gbs, **kw)
    least = err.value.min_memory_bytes
    budgets = [int(least * f) for f in exact.FACTORS]
    free = {b: gfx.search(gm, cluster, b, gbs, **kw).estimate for b in budgets}
    kept = sorted(h for h in (max(est["host_bytes_per_device"]) for est in free.values()) if h > 0)
    slower = refused = 0
    for host_budget in [int(kept[-1] * shares[0])] + [int(kept[0] * f) for f in shares[1:]]:
        _host(cluster, host_budget)
        fronts, spaces, L = exact.enumerate_space(gm, cluster, gbs, precision, host_budget=host_budget)
        if pin:
            fronts = {k: f for k, f in fronts.items() if k[0] == 2 and k[2:] == ("interleaved-1f1b", 2)}
        for budget in budgets:
            thr, config, stages, seqs = exact.best_plan(fronts, L, gbs, budget, cluster)
            if config is None:   # nothing fits both budgets: the search says the host binds
                with pytest.raises(gfx.InfeasibleError, match="host memory budget") as err:
                    gfx.search(gm, cluster, budget, gbs, **kw)
                assert "within the per-device memory budget" in str(err.value)
                refused += 1
                continue
            ref = exact._as_plan(gm, cluster, gbs, precision, config, stages, seqs, spaces)
            ref_est = gfx.estimate(gm, ref, cluster, reserve_bytes=0)
            assert ref_est["throughput_samples_s"] == pytest.approx(thr, rel=1e-9)
            assert max(ref_est["host_bytes_per_device"]) <= host_budget == ref_est["host_budget_bytes"]
            plan = gfx.search(gm, cluster, budget, gbs, **kw)
            got = gfx.estimate(gm, plan, cluster)
            assert max(got["memory_bytes_per_device"]) <= budget
            assert max(got["host_bytes_per_device"]) <= host_budget
            assert got["throughput_samples_s"] == pytest.approx(thr, rel=1e-9), (budget, host_budget, config)
            assert not pin or (plan.pp, plan.virtual_stages) == (2, 2)
            slower += thr < free[budget]["throughput_samples_s"] * (1 - 1e-9)
        need = exact.least_memory(fronts, L)   # the least memory of a plan within the host budget
        assert gfx.search(gm, cluster, int(need) + 1, gbs, **kw)
    assert slower >= len(shares) and refused >= (0 if pin else 2), (slower, refused)


def test_a_host_too_small_for_any_plan_names_its_least_need(monkeypatch):
    """Every strategy keeps 1000 host bytes: 4 layers on 2 devices need 2000 per device (2 stages)."""
    _offloading(monkeypatch, factor=0.0, every=1000.0)
    gm = exact._graph(2, False)
    cluster = _host(gfx.Cluster.preset("2xA100-80GB"), 1999)
    with pytest.raises(gfx.InfeasibleError, match="least host memory any searched plan needs") as err:
        gfx.search(gm, cluster, None, 8, reserve_bytes=0)
    assert err.value.min_host_bytes == 2000 and "(2000 bytes)" in str(err.value)
    plan = gfx.search(gm, _host(cluster, 2000), None, 8, reserve_bytes=0)
    assert plan.pp == 2 and plan.estimate["host_bytes_per_device"] == [2000, 2000]


class TwinCosts:
    """A cost model whose ZeRO-3 strategies cost what their ZeRO-2 twins (same layout group) cost,
    1% faster, and keep ``host`` bytes more in host memory: they dominate their twins in time and
    device memory, not in host bytes."""

    def __init__(self, cm, host: float):
        self.cm, self.host = cm, host

    def __getattr__(self, name):
        return getattr(self.cm, name)

    def layer_cost(self, index, strategy, micro_batch_size):
        if strategy.sdp != "zero3":
            return self.cm.layer_cost(index, strategy, micro_batch_size)
        twin = self.cm.layer_cost(index, dataclasses.replace(strategy, sdp="zero2"), micro_batch_size)
        return dataclasses.replace(twin, fwd_s=twin.fwd_s * 0.99, bwd_s=twin.bwd_s * 0.99,
                                   host_bytes=getattr(twin, "host_bytes", 0.0) + self.host)


@pytest.mark.parametrize("uniform", [False, True])
def test_strategies_keeping_host_bytes_do_not_hide_their_twins(uniform, monkeypatch):
    """ZeRO-3 twins too big for the host: the best plan is the best without ZeRO-3 (the dominance
    filter keeps the ZeRO-2 twins; the uniform screen passes over the uniform ZeRO-3 plans)."""
    real = planner.cost_model_for
    monkeypatch.setattr(planner, "cost_model_for", lambda gm, cluster, **kw: TwinCosts(real(gm, cluster, **kw), 1e15))
    gm = exact._graph(2, False)
    cluster = _host(gfx.Cluster.preset("4xA100-80GB"), 10**12)
    with pytest.raises(gfx.InfeasibleError) as err:
        gfx.search(gm, cluster, 1, 8, reserve_bytes=0)
    for f in (1.1, 1.5, 3.0):
        budget = int(err.value.min_memory_bytes * f)
        got = [gfx.search(gm, cluster, budget, 8, reserve_bytes=0, constraints=dict(uniform=uniform, **sdp))
               for sdp in ({}, {"sdp": ["none", "zero2"]})]
        assert all(lp.sdp != "zero3" for lp in got[0].layers)
        assert got[0].estimate["throughput_samples_s"] == pytest.approx(got[1].estimate["throughput_samples_s"],
                                                                        rel=1e-9)


def test_a_plan_over_the_host_budget_does_not_fit():
    cluster = _host(gfx.Cluster.preset("2xA100-80GB"), 1000)
    engine = Engine(None, cluster, ["a"], 2, 10**9)
    est = {"memory_bytes_per_device": [10**9], "host_bytes_per_device": [1000]}
    plan = SearchResult([], [(0, 0)], 1, 1, "1f1b", 1, est)
    assert engine.host_budget == 1000 and engine.fits(plan)
    assert not engine.fits(dataclasses.replace(plan, estimate={**est, "host_bytes_per_device": [1001]}))
    assert Engine(None, types.SimpleNamespace(), ["a"], 2, 10**9).host_budget == math.inf   # no host: no bound
