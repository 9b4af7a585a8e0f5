"""One rank layout for the cost model and the runtime: on every (tp, dp, ep, cp, expert-TP) layout of
8 and 16 devices, the groups the cost model prices for rank 0 are the process groups the runtime
creates for a plan with that layout (:func:`galvatron_fx.parallelize._rank_sets`), and both are
:class:`galvatron_fx.layout.Layout`'s."""

from __future__ import annotations

import itertools

import pytest

from galvatron_fx.cost.context import cp_block, cp_group
from galvatron_fx.cost.records import dp_group, ep_group, expert_dp_group, tp_group
from galvatron_fx.layout import Layout
from galvatron_fx.parallelize import _rank_sets
from galvatron_fx.plan import Plan
from galvatron_fx.solver.strategy import Strategy


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(world: int):
    for tp in _divisors(world):
        dp = world // tp
        for ep, cp, etp in itertools.product(_divisors(dp), _divisors(dp), (False, True)):
            if etp and ep == 1:
                continue
            yield tp, dp, ep, cp, etp


@pytest.mark.parametrize("world", [8, 16])
def test_cost_groups_are_the_runtime_groups(world):
    checked = 0
    for tp, dp, ep, cp, etp in _layouts(world):
        s = Strategy(tp, dp, ep=ep, cp=cp)
        lay = Layout(tp, dp, ep=ep, cp=cp, etp=etp)
        assert tuple(tp_group(s)) == lay.tp_ranks(0) and tuple(dp_group(s)) == lay.dp_ranks(0)
        assert tuple(ep_group(s)) == lay.ep_ranks(0) and tuple(cp_group(s)) == lay.cp_ranks(0)
        assert tuple(expert_dp_group(s, etp)) == lay.expert_dp_ranks(0)
        assert tuple(cp_block(s)) == lay.batch_slices().tp_ranks(0)
        plan = Plan.uniform_from_layer_names(["pre", "block", "post"], world, tp=tp, dp=dp, global_batch_size=dp)
        plan.layers[1].ep, plan.layers[1].cp = ep, cp
        plan.layers[1].extra["expert_tp"] = etp
        runtime = _rank_sets(plan, world)
        priced = [tp_group(s), dp_group(s)] + ([ep_group(s), expert_dp_group(s, etp)] if ep > 1 else []) \
            + ([cp_group(s)] if cp > 1 else [])
        for ranks in priced:
            if len(ranks) > 1:
                assert tuple(ranks) in runtime, (tp, dp, ep, cp, etp, ranks)
        checked += 1
    assert checked > 20
