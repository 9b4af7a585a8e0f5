"""gfx.search end to end on captured zoo graphs: optimality against baselines, determinism,
re-estimation, infeasibility, explain, constraints."""

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.planner import BASELINES

TINY = dict(layers=4, hidden=64, heads=4, seq_len=32, vocab=128, batch=8)


def _gm(name="gpt-tiny", **over):
    model, args = gfx.models.build(name, device="meta", **{**(TINY if name == "gpt-tiny" else {}), **over})
    return gfx.capture(model, args, method="fx")


@pytest.fixture(scope="module")
def tiny():
    return _gm()


CASES = [("2xRTX-TITAN-24GB", "6MiB", 8), ("4xA100-80GB", "4MiB", 16), ("2x4xA100-40GB", "3MiB", 16),
         ("8xRTX-TITAN-24GB", "12MiB", 32)]


@pytest.mark.parametrize("preset,budget,gbs", CASES)
def test_searched_plan_is_at_least_every_baseline_and_a_real_plan(tiny, preset, budget, gbs, tmp_path):
    cluster = gfx.Cluster.preset(preset)
    plan = gfx.search(tiny, cluster, budget, gbs, reserve_bytes=0)
    base = gfx.baselines(tiny, cluster, budget, gbs, reserve_bytes=0)
    assert set(base) == set(BASELINES)
    fitting = {k: v for k, v in base.items() if v != "oom"}
    assert fitting, "at least one baseline should fit in these cases"
    for name, est in fitting.items():
        assert plan.estimate["throughput_samples_s"] >= est["throughput_samples_s"] * (1 - 1e-9), name
    assert max(plan.estimate["memory_bytes_per_device"]) <= gfx.parse_bytes(budget)
    # the JSON is a real plan: loading and re-estimating it reproduces its figures exactly
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = gfx.Plan.load(path)
    assert gfx.estimate(tiny, loaded, cluster) == loaded.estimate == plan.estimate


def test_same_inputs_give_byte_identical_plans():
    cluster = gfx.Cluster.preset("8xA100-80GB")
    a = gfx.search(_gm(), cluster, "12MiB", 32, reserve_bytes=0).to_json()
    b = gfx.search(_gm(), cluster, "12MiB", 32, reserve_bytes=0).to_json()
    assert a == b


def test_infeasible_budget_names_the_minimum_and_that_minimum_fits(tiny):
    cluster = gfx.Cluster.preset("2xRTX-TITAN-24GB")
    cons = {"granularity": 1024}
    with pytest.raises(gfx.InfeasibleError) as err:
        gfx.search(tiny, cluster, "256KiB", 8, constraints=cons, reserve_bytes=0)
    need = err.value.min_memory_bytes
    assert need > 256 * 1024
    assert "least memory any searched plan needs" in str(err.value) and "fix:" in str(err.value)
    plan = gfx.search(tiny, cluster, int(need * 1.01) + 16 * 1024, 8, constraints=cons, reserve_bytes=0)
    assert max(plan.estimate["memory_bytes_per_device"]) <= int(need * 1.01) + 16 * 1024


def test_memory_pressure_moves_the_plan_away_from_pure_dp(tiny):
    cluster = gfx.Cluster.preset("4xA100-80GB")
    roomy = gfx.search(tiny, cluster, "1GiB", 16, reserve_bytes=0)
    dp = gfx.baselines(tiny, cluster, "1GiB", 16, names=["dp"], reserve_bytes=0)["dp"]
    tight_budget = int(max(dp["memory_bytes_per_device"]) * 0.6)
    tight = gfx.search(tiny, cluster, tight_budget, 16, reserve_bytes=0)
    assert gfx.baselines(tiny, cluster, tight_budget, 16, names=["dp"], reserve_bytes=0)["dp"] == "oom"
    assert max(tight.estimate["memory_bytes_per_device"]) <= tight_budget
    assert roomy.estimate["throughput_samples_s"] >= tight.estimate["throughput_samples_s"]
    assert any(la.sdp != "none" or la.tp > 1 or la.ckpt for la in tight.layers) or tight.pp > 1


def test_constraints_pin_the_outer_loop_and_reject_unknown_keys(tiny):
    cluster = gfx.Cluster.preset("4xA100-80GB")
    plan = gfx.search(tiny, cluster, "1GiB", 16, constraints={"pp": 2, "micro_batches": 4, "tp": 2},
                      reserve_bytes=0)
    assert plan.pp == 2 and plan.micro_batches == 4 and all(la.tp == 2 for la in plan.layers)
    with pytest.raises(gfx.ConfigError, match="unknown search constraint"):
        gfx.search(tiny, cluster, "1GiB", 16, constraints={"pipeline": 2})


def test_tp_never_exceeds_what_the_heads_allow():
    from galvatron_fx import dims
    from galvatron_fx.planner import cost_model_for
    from galvatron_fx.solver.strategy import Strategy

    gm = _gm(heads=2, hidden=64)
    cluster = gfx.Cluster.preset("8xA100-80GB")
    admits, _ = dims.admission(cost_model_for(gm, cluster))
    block = [la.index for la in gfx.layers(gm) if la.kind == "block"][0]
    assert admits(block, Strategy(2, 4)) and not admits(block, Strategy(4, 2)) and not admits(block, Strategy(8, 1))
    # a budget only TP could meet on one stage: the search must still keep blocks at tp <= 2
    plan = gfx.search(gm, cluster, "2MiB", 32, reserve_bytes=0, constraints={"pp": 1})
    assert all(la.tp <= 2 for la in plan.layers if la.name.startswith("blocks."))


def test_module_with_example_inputs_and_free_global_batch():
    model, args = gfx.models.build("gpt-tiny", device="meta", **TINY)
    cluster = gfx.Cluster.preset("4xA100-80GB")
    free = gfx.search(model, cluster, "64MiB", example_inputs=args, method="fx", reserve_bytes=0)
    fixed = gfx.search(model, cluster, "64MiB", 8, example_inputs=args, method="fx", reserve_bytes=0)
    assert free.global_batch_size & (free.global_batch_size - 1) == 0
    assert free.estimate["throughput_samples_s"] >= fixed.estimate["throughput_samples_s"]


def test_explain_lists_every_layer_with_its_memory_against_the_budget(tiny):
    plan = gfx.search(tiny, gfx.Cluster.preset("4xA100-80GB"), "4MiB", 16, reserve_bytes=0)
    text = plan.explain()
    for la in plan.layers:
        assert la.name in text and la.strategy.label in text
    assert "budget" in text and "states" in text and "activations" in text
    assert text.count("stage ") >= plan.pp


def test_uniform_plan_is_estimated_by_the_same_model(tiny):
    cluster = gfx.Cluster.preset("4xA100-80GB")
    plan = gfx.Plan.uniform(tiny, world_size=4, tp=2, dp=2, global_batch_size=8)
    est = gfx.estimate(tiny, plan, cluster, reserve_bytes=0)
    assert est["per_device"]["states_bytes"][0] > 0 and est["per_device"]["activation_bytes"][0] > 0
    assert est["step_time_s"] > 0 and len(est["layers"]) == len(plan.layers)


def test_meta_175b_search_allocates_nothing():
    model, args = gfx.models.build("gpt3-175b", device="meta", layers=4)
    gm = gfx.capture(model, args, method="fx")
    plan = gfx.search(gm, gfx.Cluster.preset("4x8xA100-80GB"), "80GB", 64)
    assert plan.world_size == 32 and all(p.device.type == "meta" for p in model.parameters())
    assert torch.isfinite(torch.tensor(plan.estimate["step_time_s"]))


def test_searched_plan_beats_the_limited_variants_where_the_partition_heuristic_once_lost():
    # swin-huge-32 on 2x8 RTX TITAN at 8 GB in fp32 (the paper table's cell): the old heuristic
    # partition lost to the DP+PP sub-space (151.8 vs 153.4 samples/s), and a lower bound of the
    # exact partition once exceeded, by round-off, the very stage time it bounded (same loss)
    model, args = gfx.models.build("swin-huge-32", device="meta")
    gm = gfx.capture(model, args, method="fx")
    cluster = gfx.Cluster.preset("2x8xRTX-TITAN-24GB")
    cons = {"max_global_batch_size": 256}
    plan = gfx.search(gm, cluster, "8GB", None, constraints=cons, precision="fp32")
    for name in ("dp+tp", "dp+pp", "3d"):
        base = gfx.search(gm, cluster, "8GB", None, constraints={**BASELINES[name], **cons}, precision="fp32")
        assert plan.estimate["throughput_samples_s"] >= base.estimate["throughput_samples_s"], name


def test_pipelined_plans_keep_tied_weight_layers_whole():
    # gpt3-* ties the LM head to the embedding: with pp > 1 the runtime sends that weight between
    # stages whole, so its layers must be tp=1 and not ZeRO-3 with checkpointing
    from galvatron_fx.planner import _engine
    from galvatron_fx.solver.strategy import Strategy

    model, args = gfx.models.build("gpt3-125m", device="meta", layers=4, hidden=64, heads=4, seq_len=32,
                                   vocab=128, batch=8)
    gm = gfx.capture(model, args, method="fx")
    cluster = gfx.Cluster.preset("8xA100-80GB")
    engine = _engine(gm, cluster, 8, 2**30, 32, None, {"reserve_bytes": 0}, None)
    last = len(gfx.layers(gm)) - 1
    assert engine.tied_layers == {0, last}
    for p in (1, 2):
        space = engine.space(p, 32)
        t = engine._layer_tables(p, 4, 8, space, 4 + p - 1)[0]
        for j, s in enumerate(space):
            whole = s.tp == 1 and not (s.sdp == "zero3" and s.ckpt)
            for i in (0, last):
                assert (t[i, j] < float("inf")) == (p == 1 or whole), (p, i, s)
            assert t[1, j] < float("inf") or s.tp > 2, (p, s)  # blocks keep every admissible strategy
    plan = gfx.search(gm, cluster, "2MiB", 32, constraints={"pp": 2}, reserve_bytes=0)
    assert all(plan.layers[i].tp == 1 for i in (0, last))
    assert Strategy(1, 4) in set(engine.space(2, 32))
