"""The per-stage DP solver against exhaustive enumeration (same memory discretisation)."""

from __future__ import annotations

import numpy as np
import pytest

from galvatron_fx.errors import ConfigError, InfeasibleError
from galvatron_fx.solver.dp import memory_units, solve_stage


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
