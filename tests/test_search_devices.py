"""Any device count: DP and PP degrees are any divisors (DP 3, 6, 24 ...), TP divides the node's
devices and the model's heads; when a restriction rather than memory excludes every plan, the error
says which."""

from __future__ import annotations

import json

import pytest

import galvatron_fx as gfx
from galvatron_fx.cli import main
from galvatron_fx.planner import _engine
from galvatron_fx.solver.configs import divisors, free_batch_sizes


@pytest.fixture(scope="module")
def llama7b():
    model, args = gfx.models.build("llama-7b", device="meta")
    return gfx.capture(model, args, method="fx")


@pytest.fixture(scope="module")
def tiny():
    model, args = gfx.models.build("gpt-tiny", device="meta", layers=2, hidden=64, heads=4, seq_len=32, vocab=128)
    return gfx.capture(model, args, method="fx")


@pytest.mark.parametrize("preset, devices", [("6xA100-80GB", 6), ("3x8xA100-80GB", 24), ("12x8xA100-80GB", 96)])
def test_llama_7b_plans_on_non_power_of_two_clusters(llama7b, preset, devices):
    cluster = gfx.Cluster.preset(preset)
    plan = gfx.search(llama7b, cluster, "80GiB", 48)
    assert plan.world_size == devices and devices % plan.pp == 0 and 48 % plan.micro_batches == 0
    for la in plan.layers:
        assert la.tp * la.dp * plan.pp == devices
        assert cluster.devices_per_node % la.tp == 0 and 32 % la.tp == 0  # node size, 32 heads
    assert max(plan.estimate["memory_bytes_per_device"]) <= gfx.parse_bytes("80GiB")
    assert gfx.estimate(llama7b, plan, cluster) == plan.estimate


def test_cli_plans_llama_7b_on_24_devices(tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "llama-7b", "--cluster", "3x8xA100-80GB", "--memory-budget", "80GiB",
                 "--global-batch-size", "48", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["world_size"] == 24 and data["global_batch_size"] == 48 and data["precision"] == "bf16-mixed"


def test_the_space_has_every_divisor(tiny):
    engine = _engine(tiny, gfx.Cluster.preset("3x8xA100-80GB"), 24, 2**30, 48, None, {"reserve_bytes": 0}, None)
    configs = engine.configs()
    assert {p for p, *_ in configs} == {1, 2, 3, 4}  # divisors of 24 up to the 4 layers
    assert {m for p, m, *_ in configs if p == 1} == set(divisors(48))
    assert all(m >= p for p, m, *_ in configs if p > 1)
    dps = {s.dp for s in engine.space(1, 48)}
    assert {3, 6, 12, 24} <= dps and {s.tp for s in engine.space(1, 48)} == {1, 2, 4, 8}
    assert {s.dp for s in engine.space(3, 48)} >= {2, 4, 8}  # 8 devices per stage
    assert free_batch_sizes(24, 64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert divisors(1536)[-3:] == [512, 768, 1536]


@pytest.mark.parametrize("gbs, constraints, needle", [
    (7, {"pp": 1, "max_tp": 2}, "no data-parallel degree on 6 devices divides the micro-batch"),
    (7, {"pp": 1, "tp": 1}, "constraints exclude every strategy on 6 devices"),
    (8, {"pp": 5}, "pp=5 must divide the 6 devices"),
    (8, {"tp": 3}, "admits none of the strategies"),
    (8, {"micro_batches": 3}, "micro_batches=3 must divide the global batch 8"),
])
def test_a_restriction_that_excludes_everything_is_named(tiny, gbs, constraints, needle):
    with pytest.raises(gfx.InfeasibleError) as err:
        gfx.search(tiny, "6xA100-80GB", "80GiB", gbs, constraints=constraints)
    msg = str(err.value)
    assert "satisfies the restrictions" in msg and needle in msg, msg
    assert "least memory" not in msg


def test_memory_not_restrictions_names_the_least_memory(tiny):
    with pytest.raises(gfx.InfeasibleError) as err:
        gfx.search(tiny, "6xA100-80GB", "64KiB", 12, reserve_bytes=0)
    assert "least memory any searched plan needs" in str(err.value) and err.value.min_memory_bytes > 64 * 1024
    plan = gfx.search(tiny, "6xA100-80GB", int(err.value.min_memory_bytes), 12, reserve_bytes=0)
    assert max(plan.estimate["memory_bytes_per_device"]) <= err.value.min_memory_bytes
