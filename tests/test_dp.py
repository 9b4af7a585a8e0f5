"""The per-stage DP solver against exhaustive enumeration (same memory discretisation)."""

from __future__ import annotations

import numpy as np
import pytest

from galvatron_fx.errors import ConfigError, InfeasibleError
from galvatron_fx.solver import stage as stage_mod
from galvatron_fx.solver.dp import memory_units, solve_stage
from galvatron_fx.solver.stage import path_cost, solve_stage_exact, stage_min_memory


def _brute(time, mem, reshard, budget, gran):
    """All S**L sequences, costs summed in the DP's order: acc = (acc + R) + T."""
    L, S = time.shape
    seqs = np.indices((S,) * L).reshape(L, -1).T  # [N, L]
    units = -(-mem // gran)  # integer ceil
    if reshard is None:
        reshard = np.zeros((max(L - 1, 0), S, S))
    if reshard.ndim == 2:
        reshard = np.broadcast_to(reshard, (max(L - 1, 0), S, S))
    acc = time[0, seqs[:, 0]]
    used = units[0, seqs[:, 0]].copy()
    for l in range(1, L):
        acc = (acc + reshard[l - 1, seqs[:, l - 1], seqs[:, l]]) + time[l, seqs[:, l]]
        used = used + units[l, seqs[:, l]]
    E = int(np.floor(budget / gran)) if budget >= 0 else -1
    allowed = np.isfinite(acc)
    fits = allowed & (used <= E)
    min_units = used[allowed].min() if allowed.any() else np.inf
    if not fits.any():
        return None, min_units * gran, None
    best = acc[fits].min()
    opt = seqs[fits & (acc == best)]
    # tie rule: smallest sequence compared from the last layer backwards
    tie = min(tuple(r) for r in opt[:, ::-1])[::-1]
    return float(best), min_units * gran, tuple(int(x) for x in tie)


def _instance(rng, integer_times):
    L = int(rng.integers(1, 7))
    S = int(rng.integers(1, 7))
    if integer_times:
        time = rng.integers(0, 4, (L, S)).astype(float)
    else:
        time = rng.uniform(0.0, 1.0, (L, S))
    time[rng.random((L, S)) < 0.15] = np.inf
    mem = rng.integers(0, 12, (L, S))
    kind = rng.integers(0, 3)
    if kind == 0:
        reshard = None
    elif kind == 1:
        reshard = rng.integers(0, 3, (S, S)).astype(float) if integer_times else rng.uniform(0, 0.3, (S, S))
    else:
        shape = (L - 1, S, S)
        reshard = rng.integers(0, 3, shape).astype(float) if integer_times else rng.uniform(0, 0.3, shape)
    if reshard is not None:
        reshard[rng.random(reshard.shape) < 0.1] = np.inf
    gran = int(rng.choice([1, 2, 3]))
    top = int(mem.max(axis=1).sum()) + 2
    budget = float(rng.integers(-2, top + 1))
    return time, mem, reshard, budget, gran


@pytest.mark.parametrize("integer_times", [False, True])
def test_dp_matches_exhaustive(integer_times):
    rng = np.random.default_rng(20261130 + integer_times)
    n_infeasible = n_feasible = 0
    for _ in range(200):
        time, mem, reshard, budget, gran = _instance(rng, integer_times)
        best, min_bytes, tie = _brute(time, mem, reshard, budget, gran)
        sol = solve_stage(time, mem, reshard, budget, gran)
        assert sol.min_memory_bytes == min_bytes
        if best is None:
            n_infeasible += 1
            assert not sol.feasible and sol.strategies == () and sol.objective_s == np.inf
            continue
        n_feasible += 1
        assert sol.feasible
        assert sol.objective_s == best  # exact, not approximate
        assert len(sol.strategies) == time.shape[0]
        assert sol.memory_bytes <= budget and sol.memory_bytes_exact <= sol.memory_bytes
        assert sol.memory_units == int(sum(-(-mem[l, s] // gran) for l, s in enumerate(sol.strategies)))
        if integer_times:  # exact arithmetic: the documented tie rule is checkable
            assert sol.strategies == tie
    assert n_infeasible >= 40 and n_feasible >= 60


def test_memory_rounds_up_and_fits_in_bytes():
    # two layers, each 1.5 units of memory at granularity 2 -> 2 units each; budget 3 bytes -> 1 unit
    time = np.array([[1.0, 2.0], [1.0, 2.0]])
    mem = np.array([[3.0, 1.0], [3.0, 1.0]])
    sol = solve_stage(time, mem, None, budget_bytes=4, granularity=2)
    assert sol.feasible and sol.strategies == (1, 1) and sol.memory_bytes == 4
    sol = solve_stage(time, mem, None, budget_bytes=8, granularity=2)
    assert sol.strategies == (0, 0) and sol.objective_s == 2.0 and sol.memory_bytes == 8
    assert list(memory_units(np.array([0.0, 1.0, 2.0, 2.0000001, np.inf]), 2)) == [0, 1, 1, 2, -1]


def test_infeasible_reports_min_memory_and_raises():
    time = np.ones((3, 2))
    mem = np.array([[5, 7], [5, 9], [6, 6]])
    sol = solve_stage(time, mem, None, budget_bytes=15, granularity=1)
    assert not sol.feasible and sol.min_memory_bytes == 16
    with pytest.raises(InfeasibleError, match="16 bytes"):
        sol.raise_if_infeasible()
    time[1] = np.inf
    sol = solve_stage(time, mem, None, budget_bytes=10**6, granularity=1)
    assert not sol.feasible and sol.min_memory_bytes == np.inf
    with pytest.raises(InfeasibleError, match="any memory budget"):
        sol.raise_if_infeasible()


def test_reshard_changes_choice_and_ties_are_lowest_index():
    time = np.array([[1.0, 1.0], [1.0, 1.0]])
    mem = np.zeros((2, 2), dtype=int)
    sol = solve_stage(time, mem, None, 0, 1)
    assert sol.strategies == (0, 0)
    reshard = np.array([[0.0, 0.0], [5.0, 0.0]])
    time = np.array([[2.0, 1.0], [1.0, 1.5]])
    # (1,0): 1+5+1=7, (1,1): 1+0+1.5=2.5, (0,0): 2+0+1=3
    assert solve_stage(time, mem, reshard, 0, 1).strategies == (1, 1)


def test_bad_inputs_raise_config_error():
    with pytest.raises(ConfigError, match="shape"):
        solve_stage(np.ones((2, 2)), np.ones((2, 3)), None, 10, 1)
    with pytest.raises(ConfigError, match="reshard"):
        solve_stage(np.ones((2, 2)), np.ones((2, 2)), np.ones((3, 2, 2)), 10, 1)
    with pytest.raises(ConfigError, match="granularity"):
        solve_stage(np.ones((2, 2)), np.ones((2, 2)), None, 10, 0)
    with pytest.raises(ConfigError, match="time"):
        solve_stage(-np.ones((2, 2)), np.ones((2, 2)), None, 10, 1)


def test_benchmark_size_runs():
    """L=96, S=40, 1024 memory units (the report's micro-benchmark) — correctness smoke only."""
    rng = np.random.default_rng(0)
    L, S = 96, 40
    time = rng.uniform(0.01, 0.1, (L, S))
    mem = rng.integers(1, 40, (L, S))
    sol = solve_stage(time, mem, rng.uniform(0, 0.01, (S, S)), 1024, 1)
    assert sol.feasible and sol.memory_units <= 1024


def _brute_exact(T, M, X, R, gid, P, budget):
    """Every sequence, in bytes: sum M + max X <= budget; cost summed as the estimate sums it."""
    import itertools

    n, S = T.shape
    best, minmem = (np.inf, None), np.inf
    for path in itertools.product(range(S), repeat=n):
        if not all(np.isfinite(T[l, s]) for l, s in enumerate(path)):
            continue
        mem = sum(M[l, s] for l, s in enumerate(path)) + max(X[l, s] for l, s in enumerate(path))
        minmem = min(minmem, mem)
        if mem <= budget:
            c = path_cost(T, R, gid, P, path)
            if c < best[0]:
                best = (c, path)
    return best, minmem


@pytest.mark.parametrize("refine", [False, True])
def test_exact_stage_solve_matches_brute_force_in_bytes(refine, monkeypatch):
    """solve_stage_exact: exact in bytes (no rounding), largest transient of the chosen strategies,
    layout-group resharding, a final send; relaxations from 1 unit (A* does the work) up."""
    if refine:  # every A* search refines its relaxation as soon as it can
        monkeypatch.setattr(stage_mod, "ASTAR_EXPANSIONS", 1)
    rng = np.random.default_rng(11 + refine)
    feasible = 0
    for it in range(160):
        n, S = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        gid = rng.integers(0, int(rng.integers(1, S + 1)), S)
        G = int(gid.max()) + 1
        T = rng.uniform(0, 1, (n, S))
        T[rng.random((n, S)) < 0.1] = np.inf
        M = rng.integers(0, 50, (n, S)).astype(float) if it % 2 else rng.uniform(0, 50, (n, S))
        X = rng.integers(0, 4, (n, S)).astype(float) * rng.integers(0, 20)
        R = rng.uniform(0, 0.3, (max(n - 1, 0), G, G))
        P = rng.uniform(0, 0.2, S)
        budget = float(rng.uniform(0, 50 * n))
        units = int(rng.choice([1, 2, 16, 256]))
        (cost, path), minmem = _brute_exact(T, M, X, R, gid, P, budget)
        sol = solve_stage_exact(T, M, X, R, budget, groups=gid, final=P, units=units)
        if np.isfinite(minmem):
            assert sol.min_memory_bytes == pytest.approx(minmem, rel=1e-12)
            assert stage_min_memory(M, X, np.isfinite(T)) == pytest.approx(minmem, rel=1e-12)
        if path is None:
            assert not sol.feasible
            continue
        feasible += 1
        assert sol.feasible and sol.cost == pytest.approx(cost, rel=1e-12, abs=1e-15)
        assert sol.memory_bytes <= budget
        # a cutoff at the optimum finds nothing below it; just above, it finds the optimum
        assert not solve_stage_exact(T, M, X, R, budget, groups=gid, final=P, units=units, cutoff=cost).feasible
        assert solve_stage_exact(T, M, X, R, budget, groups=gid, final=P, units=units,
                                 cutoff=cost * (1 + 1e-9) + 1e-12).feasible
    assert feasible >= 60


def test_exact_stage_counts_only_the_chosen_transient():
    # two layers; strategy 1 is fast but carries a large transient, strategy 0 is lean. With the
    # transient of *any* candidate subtracted from the budget (the old rule) nothing fast would fit.
    T = np.array([[2.0, 1.0], [2.0, 1.0]])
    M = np.array([[10.0, 10.0], [10.0, 30.0]])
    X = np.array([[0.0, 50.0], [0.0, 1.0]])
    sol = solve_stage_exact(T, M, X, None, 41.0)
    assert sol.strategies == (0, 1) and sol.cost == 3.0 and sol.memory_bytes == 41.0
    assert solve_stage_exact(T, M, X, None, 40.0).strategies == (0, 0)
