"""Activation offload (``act_offload``, galvatron_fx/dims/activation_offload.py): the space offers
it where asked, the estimate moves a layer's saved activations to the host and prices the copies,
the search uses it where memory needs it, plans carry it through JSON, bad plans name the fix.
The runtime (numerics, live host bytes) is tested on gloo ranks in test_activation_offload_dist.py."""

from __future__ import annotations

import json

import pytest

import galvatron_fx as gfx
from galvatron_fx.solver.schedules import step_slots
from galvatron_fx.solver.strategy import Strategy, strategy_space
from tests.hf_meta import meta_llama

LLAMA = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4)


@pytest.fixture(scope="module")
def llama():
    return meta_llama(2048, batch=8, **LLAMA)


def test_the_space_offers_it_only_where_asked():
    assert not any(s.act_offload for s in strategy_space(8))
    asked = strategy_space(8, cp=(1, 2), more={"act_offload": (False, True)})
    moved = [s for s in asked if s.act_offload]
    assert moved and all(not s.ckpt and s.cp == 1 and s.ep == 1 for s in moved)
    assert len(asked) == len(strategy_space(8, cp=(1, 2))) + len(moved)
    assert Strategy(1, 8, act_offload=True).label == "tp1·dp8·aoff"
    with pytest.raises(gfx.ConfigError, match="not combined with checkpointing"):
        Strategy(1, 8, ckpt=True, act_offload=True)


def test_the_estimate_moves_the_saved_activations_to_the_host(llama):
    from galvatron_fx.planner import cost_model_for

    cluster = gfx.Cluster.preset("8xA100-80GB")
    kw = dict(pp=2, micro_batches=4, global_batch_size=32, schedule="1f1b")
    base = gfx.Plan.uniform(llama, 8, **kw)
    plain = gfx.estimate(llama, base, cluster)
    moved = gfx.estimate(llama, gfx.Plan.uniform(llama, 8, act_offload=True, **kw), cluster)
    acts = plain["per_device"]["activation_bytes"]
    assert moved["per_device"]["activation_bytes"] == [0, 0] and min(acts) > 2**20
    assert [m - p for m, p in zip(moved["host_bytes_per_device"], plain["host_bytes_per_device"])] == acts
    # the copies: every kept byte down and back per micro-batch over the host link, exposed
    cm = cost_model_for(llama, cluster, precision=base.precision)
    slots = step_slots("1f1b", 2, 1, 4)
    for k, (a, b) in enumerate(base.stages):
        kept = sum(cm.layer_cost(i, base.layers[i].strategy, 8).activation_bytes for i in range(a, b + 1))
        extra = moved["stage_time_s"][k] - plain["stage_time_s"][k]
        assert extra == pytest.approx(slots * 2 * kept / cluster.host_bandwidth, rel=1e-9)
        moved_layers = moved["layers"][a:b + 1]
        assert max(x["transient_bytes"] for x in moved_layers) >= max(
            cm.layer_cost(i, base.layers[i].strategy, 8).activation_bytes for i in range(a, b + 1))


def test_the_search_offloads_where_memory_needs_it(llama):
    cluster = gfx.Cluster.preset("8xA100-80GB")
    fixed = dict(pp=1, micro_batches=1, ckpt=False, offload=False, tp=1, sdp="zero3")
    plain = gfx.search(llama, cluster, "80GiB", 64, constraints=fixed)
    need = max(plain.estimate["memory_bytes_per_device"])
    with pytest.raises(gfx.InfeasibleError):
        gfx.search(llama, cluster, need - 2**20, 64, constraints=fixed)
    plan = gfx.search(llama, cluster, need - 2**20, 64, constraints=dict(fixed, act_offload=True))
    assert any(la.strategy.act_offload for la in plan.layers)
    assert max(plan.estimate["memory_bytes_per_device"]) <= need - 2**20
    assert plan.estimate == gfx.estimate(llama, plan, cluster)
    assert "activation offload" in plan.explain()
    again = gfx.Plan.from_dict(json.loads(plan.to_json()))
    assert [la.strategy for la in again.layers] == [la.strategy for la in plan.layers]


def test_a_cluster_without_a_host_refuses_it_by_name(llama):
    cpu = gfx.Cluster(memory_bytes="16GiB", peak_flops={"fp32": 1e11, "bf16": 1e11, "fp16": 1e11},
                      intra_bandwidth=1e10, intra_latency=1e-6, devices_per_node=8)
    with pytest.raises(gfx.ConfigError, match="constraint act_offload=True: cluster .* has no host memory"):
        gfx.search(llama, cpu, "16GiB", 8, constraints={"act_offload": True})
    with pytest.raises(gfx.ConfigError, match="constraint act_offload must be true, false or \"all\""):
        gfx.search(llama, gfx.Cluster.preset("8xA100-80GB"), "80GiB", 8, constraints={"act_offload": "some"})


def test_plans_carry_it_and_refuse_it_beside_checkpointing(llama, tmp_path):
    plan = gfx.Plan.uniform(llama, 8, act_offload=True, global_batch_size=8)
    data = json.loads(plan.to_json())
    assert all(la["act_offload"] is True for la in data["layers"])
    assert [la.strategy.act_offload for la in gfx.Plan.from_dict(data).layers] == [True] * len(plan.layers)
    for la in data["layers"]:
        del la["act_offload"]            # a plan written before the dimension: the default
    assert not any(la.strategy.act_offload for la in gfx.Plan.from_dict(data).layers)
    data["layers"][1].update(ckpt=True, act_offload=True)
    with pytest.raises(gfx.ConfigError, match=r"plan layers\[1\].act_offload is not combined with checkpointing"):
        gfx.Plan.from_dict(data).validate_for(8)
