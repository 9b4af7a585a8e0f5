"""Process groups: every group a plan's program uses is made by ``transform`` (``_rank_sets``), and
``ProcessGroups.release()`` lets a process start over (the test pool releases them between tests,
so a group one test made cannot hide another's missing one)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def test_a_plan_makes_the_groups_its_input_shards_are_gathered_over():
    import galvatron_fx as gfx
    from galvatron_fx.parallelize import _rank_sets

    model, args = gfx.models.build("gpt-tiny", device="meta", layers=2, batch=8)
    gm = gfx.capture(model, args, method="fx")
    plan = gfx.Plan.uniform(gm, 4, tp=2, dp=2, global_batch_size=8)
    # NOTE: tp2 x dp2 hands each of the 4 ranks its own rows; a token loss gathers them over all 4
    # (this set was missing: the run failed in a fresh process, passing after another test)
    assert (0, 1, 2, 3) in _rank_sets(plan, 4)


def _release(rank, world):
    import torch.distributed as dist

    from galvatron_fx.errors import ConfigError
    from galvatron_fx.runtime.groups import GROUPS, group

    GROUPS.release()
    GROUPS.ensure([(0, 1), (2, 3)])
    t = torch.ones(1)
    dist.all_reduce(t, group=group((0, 1) if rank < 2 else (2, 3)))
    GROUPS.release()
    with pytest.raises(ConfigError, match="ensure"):
        group((0, 1))
    GROUPS.ensure([(0, 1), (2, 3)])   # made again, collectively
    dist.all_reduce(t, group=group((0, 1) if rank < 2 else (2, 3)))
    # NOTE: a group made with local synchronization is None on the ranks outside it: releasing it
    # there once destroyed the world group (the benchmarks' profiled clusters, ranks 2 and 3)
    GROUPS.release()
    GROUPS.ensure([(0, 1)], local=True)
    GROUPS.release()
    dist.all_reduce(t)
    return float(t)


@pytest.mark.dist
def test_released_groups_are_gone_and_can_be_made_again():
    assert run_distributed(_release, 4) == [16.0] * 4
