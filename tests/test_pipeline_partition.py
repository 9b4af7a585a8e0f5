"""Pipeline partition against brute force, and the pipeline timing formulas."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from galvatron_fx.errors import ConfigError, InfeasibleError
from galvatron_fx.solver.pipeline import (
    balanced_split,
    even_split,
    in_flight_microbatches,
    partition_min_max,
    partition_stages,
    pipeline_step_time,
)


def _splits(L, p):
    for cuts in itertools.combinations(range(1, L), p - 1):
        b = (0, *cuts, L)
        yield tuple((b[k], b[k + 1] - 1) for k in range(p))


def _brute(L, p, cost):
    best = None
    for split in _splits(L, p):
        times = [cost[k, i, j] for k, (i, j) in enumerate(split)]
        if any(t == math.inf for t in times):
            continue
        sq = 0.0
        for t in times:
            sq = sq + t * t
        key = (max(times), sq, tuple(i for i, _ in reversed(split)))
        if best is None or key < best[0]:
            best = (key, split)
    return best


def _random_cost(rng, L, p, integer):
    layer = rng.integers(1, 4, L).astype(float) if integer else rng.uniform(0.1, 1.0, L)
    cost = np.full((p, L, L), np.inf)
    for k in range(p):
        for i in range(L):
            for j in range(i, L):
                cost[k, i, j] = layer[i:j + 1].sum() + (k if integer else 0.05 * k)
    cost[rng.random(cost.shape) < 0.2] = np.inf  # "does not fit"
    return cost


@pytest.mark.parametrize("integer", [False, True])
def test_partition_matches_brute_force(integer):
    rng = np.random.default_rng(7 + integer)
    n_inf = 0
    for _ in range(150):
        L = int(rng.integers(1, 8))
        p = int(rng.integers(1, min(L, 4) + 1))
        cost = _random_cost(rng, L, p, integer)
        ref = _brute(L, p, cost)
        got = partition_stages(L, p, cost)
        if ref is None:
            n_inf += 1
            assert not got.feasible and got.bottleneck_s == math.inf
            continue
        assert got.feasible
        assert got.bottleneck_s == ref[0][0]
        sq = 0.0
        for t in got.stage_times_s:
            sq = sq + t * t
        assert sq == ref[0][1]
        if integer:
            assert got.stages == ref[1]
        assert got.cost_calls <= p * L * (L + 1) // 2
    assert n_inf >= 5


def test_minimises_max_not_even_split():
    # layer 0 is heavy: the best 2-stage split isolates it rather than splitting 3/3.
    t = [10.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    got = partition_stages(6, 2, lambda i, j, k: sum(t[i:j + 1]))
    assert got.stages == ((0, 0), (1, 5)) and got.bottleneck_s == 10.0


def test_balanced_split_is_the_min_max_split():
    # against every contiguous split: the largest chunk sum is the least any split has, and the
    # ranges cover the layers in order, none empty
    rng = np.random.default_rng(0)
    for L, parts in [(6, 4), (7, 3), (9, 4), (10, 5), (8, 8), (5, 1)]:
        for _ in range(30):
            t = rng.choice([0.1, 0.5, 1.0, 2.0, 3.7], size=L) * rng.uniform(0.9, 1.1)
            got = balanced_split(t, parts)
            assert [i for i, _ in got] == [0] + [j + 1 for _, j in got[:-1]] and got[-1][1] == L - 1
            assert all(j >= i for i, j in got)
            best = min(max(t[i:j + 1].sum() for i, j in s) for s in _splits(L, parts))
            assert max(t[i:j + 1].sum() for i, j in got) <= best * (1 + 1e-9)


def test_balanced_split_of_a_gpt_with_light_ends():
    # embedding, four blocks, LM head into 4 chunks: the light ends join the outer blocks, where
    # the even split leaves the head alone and puts two blocks in one chunk
    t = [0.1, 1.0, 1.0, 1.0, 1.0, 0.2]
    assert even_split(6, 4) == [(0, 1), (2, 3), (4, 4), (5, 5)]
    assert balanced_split(t, 4) == [(0, 1), (2, 2), (3, 3), (4, 5)]
    assert balanced_split([1.0] * 6, 4) == even_split(6, 4)   # equal layers: the even split
    assert balanced_split([0.0] * 6, 4) == even_split(6, 4)   # no times: the even split
    with pytest.raises(ConfigError, match="cannot split 3 layers into 4"):
        balanced_split([1.0] * 3, 4)


def test_ties_prefer_most_balanced():
    # uniform layers, 7 layers on 3 stages: bottleneck 3; (3,2,2) permutations tie on squares;
    # (3,3,1) is less balanced. Tie rule: last stage starts earliest, then the one before.
    got = partition_stages(7, 3, lambda i, j, k: float(j - i + 1))
    assert got.bottleneck_s == 3.0
    assert sorted(j - i + 1 for i, j in got.stages) == [2, 2, 3]
    assert got.stages == ((0, 1), (2, 3), (4, 6))


def test_memory_infeasible_stage_and_raise():
    # stage 0 cannot hold more than one layer; stage 1 any.
    got = partition_stages(4, 2, lambda i, j, k: math.inf if (k == 0 and j > i) else float(j - i + 1))
    assert got.stages == ((0, 0), (1, 3))
    bad = partition_stages(4, 2, lambda i, j, k: math.inf)
    assert not bad.feasible
    with pytest.raises(InfeasibleError):
        bad.raise_if_infeasible()


def test_memoised_calls():
    calls = []

    def cost(i, j, k):
        calls.append((i, j, k))
        return float(j - i + 1)

    partition_stages(12, 4, cost)
    assert len(calls) == len(set(calls)) <= 4 * 12 * 13 // 2


def test_bad_arguments():
    with pytest.raises(ConfigError):
        partition_stages(3, 4, lambda i, j, k: 1.0)
    with pytest.raises(ConfigError):
        partition_stages(3, 1, lambda i, j, k: -1.0)


def test_even_split():
    assert even_split(7, 3) == [(0, 2), (3, 4), (5, 6)]
    assert even_split(4, 4) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    with pytest.raises(ConfigError):
        even_split(2, 3)


def test_formulas():
    assert pipeline_step_time(0.5, micro_batches=8, pp=4, grad_sync_s=0.25, p2p_s=0.1) == pytest.approx(
        (8 + 3) * 0.5 + 0.35)
    assert pipeline_step_time(1.0, 1, 1) == 1.0
    assert [in_flight_microbatches("1f1b", 8, 4, k) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches("1f1b", 2, 4, k) for k in range(4)] == [2, 2, 2, 1]
    assert [in_flight_microbatches("gpipe", 8, 4, k) for k in range(4)] == [8] * 4
    with pytest.raises(ConfigError):
        in_flight_microbatches("zb", 8, 4, 0)
    with pytest.raises(ConfigError):
        in_flight_microbatches("1f1b", 8, 4, 4)


@pytest.mark.parametrize("integer", [False, True])
def test_pruned_partition_matches_brute_force(integer):
    """partition_min_max (lazy, pruned by lower bounds, windows and a cutoff) has the full DP's optimum."""
    rng = np.random.default_rng(17 + integer)
    least = 1.0 if integer else 0.1  # every layer costs at least this on any stage (_random_cost)
    for _ in range(200):
        L = int(rng.integers(1, 8))
        p = int(rng.integers(1, min(L, 4) + 1))
        cost = _random_cost(rng, L, p, integer)
        ref = _brute(L, p, cost)
        lower = np.where(np.isfinite(cost), cost * rng.uniform(0, 1, cost.shape), 0.0)  # any bound <= cost
        cutoff = np.inf if rng.random() < 0.5 else (ref[0][0] * rng.uniform(0.9, 1.5) if ref else 1.0)
        got = partition_min_max(L, p, lambda i, j, k, cut: float(cost[k, i, j]),
                                lower=lambda i, j, k: float(lower[k, i, j]),
                                window_lower=lambda i, j: (j - i + 1) * least, cutoff=cutoff)
        if ref is None or ref[0][0] >= cutoff:
            assert not got.feasible
            continue
        assert got.feasible and got.bottleneck_s == ref[0][0]
        assert got.stages[0][0] == 0 and got.stages[-1][1] == L - 1
        assert max(cost[k, i, j] for k, (i, j) in enumerate(got.stages)) == got.bottleneck_s
