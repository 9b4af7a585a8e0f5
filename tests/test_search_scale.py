"""GPT-3 175B at scale: the ``megatron`` baseline fits where the paper's limited baselines do not,
the searched plan is at least as fast, and 1536 devices (192 nodes of 8) plan fine."""

from __future__ import annotations

import pytest

import galvatron_fx as gfx
from galvatron_fx.planner import BASELINES, speedups


@pytest.fixture(scope="module")
def gpt3():
    model, args = gfx.models.build("gpt3-175b", device="meta")
    return gfx.capture(model, args, method="fx")


@pytest.mark.matrix   # 38 s on 2 cores: the 1536-device search below keeps the scale in the default suite
def test_megatron_baseline_fits_and_the_search_is_at_least_it(gpt3):
    cluster = gfx.Cluster.preset("128x8xA100-80GB")
    budget = gfx.parse_bytes("80GiB")
    base = gfx.baselines(gpt3, cluster, budget, 1536, precision="bf16-mixed")
    meg = base["megatron"]
    assert meg != "oom" and max(meg["memory_bytes_per_device"]) <= budget
    plan = gfx.search(gpt3, cluster, budget, 1536, precision="bf16-mixed")
    assert plan.precision == "bf16-mixed"
    ups = speedups(plan, base)
    assert ups["megatron"] >= 1 - 1e-12
    assert all(v is None or v >= 1 - 1e-12 for v in ups.values())
    # the baseline is Megatron-LM's shape: uniform TP (within a node) x PP x DP, with or without the
    # distributed optimizer (ZeRO-2), 1F1B or interleaved, 1..8 samples per device per micro-batch
    mp = gfx.search(gpt3, cluster, budget, 1536, constraints=BASELINES["megatron"], precision="bf16-mixed")
    assert mp.estimate == {k: v for k, v in meg.items() if k != "config"}
    assert meg["config"] == gfx.planner.plan_config(mp) and f"pp{mp.pp}" in meg["config"]
    assert len({la.strategy for la in mp.layers}) == 1 and mp.schedule in ("1f1b", "interleaved-1f1b")
    la = mp.layers[0]
    assert la.sdp in ("none", "zero2") and la.tp <= 8 and 1 <= mp.micro_batch_size // la.dp <= 8


def test_1536_devices(gpt3):
    plan = gfx.search(gpt3, "192x8xA100-80GB", "80GiB", 1536)
    assert plan.world_size == 1536 and plan.precision == "bf16-mixed"
    assert all(la.tp * la.dp * plan.pp == 1536 for la in plan.layers)
    assert max(plan.estimate["memory_bytes_per_device"]) <= gfx.parse_bytes("80GiB")
