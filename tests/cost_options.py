"""A boolean cost-model option's contract, checked alike for each (``fused_pointwise``,
``async_tp``): it moves the estimated step time, not the memory; a searched plan records it and
re-estimates to the same figure without being told again; any other value is one ConfigError naming
the option."""

from __future__ import annotations

import pytest

import galvatron_fx as gfx


def check_cost_option(gm, plan, cluster: str, option: str, global_batch_size: int) -> None:
    plain = gfx.estimate(gm, plan, cluster)
    opted = gfx.estimate(gm, plan, cluster, **{option: True})
    assert opted["step_time_s"] < plain["step_time_s"]
    assert opted["memory_bytes_per_device"] == plain["memory_bytes_per_device"]
    searched = gfx.search(gm, cluster, global_batch_size=global_batch_size, **{option: True})
    assert searched.extra["cost_model"][option] is True
    again = gfx.estimate(gm, searched, cluster)
    assert again["step_time_s"] == pytest.approx(searched.estimate["step_time_s"], rel=1e-9)
    with pytest.raises(gfx.ConfigError, match=f"{option} must be true or false"):
        gfx.estimate(gm, plan, cluster, **{option: "yes"})
