"""Mixture-of-experts without processes: experts blocks found in the graph, ``ep`` in plans and the
strategy space, and the cost model's expert-parallel terms (``galvatron_fx/sharding/experts.py``,
``galvatron_fx/cost/model.py``). The runs themselves are in ``tests/test_training_loop_dist.py``
(``-k ep2``) and ``tests/test_expert_dispatch_dist.py``."""

from __future__ import annotations

import math

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.cost import CostModel
from galvatron_fx.errors import ConfigError
from galvatron_fx.sharding.experts import MoEBlock, expert_layers, layer_blocks
from galvatron_fx.solver.strategy import Strategy, strategy_space
from tests import loops

pytest.importorskip("transformers")


def _mixtral(method: str):
    return gfx.capture(loops.moe("mixtral"), (), kwargs=loops.collate(1)[0], method=method)


@pytest.fixture(scope="module")
def mixtral():
    return _mixtral("dynamo")


@pytest.fixture(scope="module")
def qwen():
    return gfx.capture(loops.moe("qwen2-moe"), (), kwargs=loops.collate(1)[0], method="dynamo")


@pytest.mark.parametrize("method", ["dynamo", "export"])
def test_experts_blocks_are_found_with_their_inputs(mixtral, method):
    blocks = layer_blocks(mixtral if method == "dynamo" else _mixtral(method))
    assert sorted(blocks) == [1, 2]   # the two decoder layers; embeddings and head have none
    for i, (b,) in blocks.items():
        assert isinstance(b, MoEBlock)
        assert b.num_experts == 8 and b.top_k == 2
        assert {p.target for p in b.params} == {f"model.layers.{i - 1}.mlp.experts.gate_up_proj",
                                                f"model.layers.{i - 1}.mlp.experts.down_proj"}
        assert len(b.grouped) == 2 and b.compactable()   # symbolic batch: sizes are inputs
        assert not b.index.meta["val"].is_floating_point()
        assert tuple(b.weights.meta["val"].shape) == tuple(b.index.meta["val"].shape)
        assert tuple(b.x.meta["val"].shape) == tuple(b.output.meta["val"].shape)
        assert [r.name for r in b.routers()], "the gate linear feeding top-k"


def test_shared_experts_stay_outside_the_block(qwen):
    (b,) = layer_blocks(qwen)[1]
    assert b.num_experts == 4
    names = {p.target for p in b.params}
    assert all(".mlp.experts." in n for n in names)   # shared_expert / its gate: dense, outside


@pytest.mark.matrix   # CI time: tests/test_training_loop_dist.py -k aux trains it exactly in CI
def test_a_load_balancing_loss_couples_the_batch():
    """A router's auxiliary loss multiplies two statistics of the whole batch (token fractions per
    expert x mean router probabilities): split over DP ranks or micro-batches it is another loss
    (measured: 3.5e-5 relative on this model at dp 2), so its layer is batch-coupled (runs on the
    gathered batch; tests/test_training_loop_dist.py -k aux trains it exactly)."""
    model = loops.moe("mixtral")
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5
    gm = gfx.capture(model, (), kwargs=loops.collate(1)[0], method="export")
    coupled = {r.name: r.batch_coupled for r in gm.meta["galvatron"].layers if r.batch_coupled}
    assert list(coupled) == ["post"] and "load-balancing" in coupled["post"][0]
    plain = gfx.capture(loops.moe("mixtral"), (), kwargs=loops.collate(1)[0], method="export")
    assert not any(r.batch_coupled for r in plain.meta["galvatron"].layers)


def test_ep_in_plans_applies_to_layers_with_experts(mixtral):
    plan = gfx.Plan.uniform(mixtral, 4, dp=4, ep=2, global_batch_size=8)
    assert [lp.ep for lp in plan.layers] == [1, 2, 2, 1]
    assert expert_layers(mixtral) == {"model.layers.0", "model.layers.1"}
    again = gfx.Plan.from_dict(plan.to_dict())
    assert [lp.ep for lp in again.layers] == [1, 2, 2, 1] and again.layers[1].strategy.label == "tp1·dp4·ep2"
    old = plan.to_dict()
    for layer in old["layers"]:
        del layer["ep"]
    assert all(lp.ep == 1 for lp in gfx.Plan.from_dict(old).layers)   # plans without ep load as before
    with pytest.raises(ConfigError, match="ep=3 does not divide dp=4"):
        gfx.Plan.uniform(mixtral, 4, dp=4, ep=3, global_batch_size=8)


def test_strategy_space_offers_ep_dividing_dp():
    space = strategy_space(8, ep=(1, 2, 4, 8), sp=False, ckpt=False, zero2=False, zero3=False)
    assert {(s.tp, s.dp, s.ep) for s in space} == {(1, 8, 1), (1, 8, 2), (1, 8, 4), (1, 8, 8), (2, 4, 1), (2, 4, 2),
                                                   (2, 4, 4), (4, 2, 1), (4, 2, 2), (8, 1, 1)}
    assert len(strategy_space(8)) == 81   # without experts the space is unchanged (offload included)
    with pytest.raises(ConfigError, match="must divide dp"):
        Strategy(1, 4, ep=8)


def test_expert_flops_and_states(mixtral):
    cm = CostModel(mixtral, gfx.Cluster.preset("8xA100-80GB"), reserve_bytes=0, precision="fp32")
    S, H, inter, k, E = loops.S, 32, 64, 2, 8
    m = cm.measure(1)
    experts = S * k * (2 * H * 2 * inter + 2 * inter * H)   # per sample: top-k share of the grouped matmuls
    assert m.fwd_flops_sharded(1) + m.fwd_flops_rep(1) >= experts
    ex = cm.experts(1)
    assert ex.tokens_per_sample == S and ex.hidden == H and ex.top_k == k
    assert ex.needing_fraction(2) == pytest.approx(1 - math.comb(4, 2) / math.comb(8, 2))
    assert ex.needing_fraction(8) == pytest.approx(1 - math.comb(7, 2) / math.comb(8, 2))
    weights = E * (2 * inter * H + H * inter)
    one, two = (cm.states_bytes(1, Strategy(1, 4, ep=e)) for e in (1, 2))
    assert one.params - two.params == 4 * weights // 2   # fp32: half the experts on each rank
    assert cm.ep_of(0, Strategy(1, 4, ep=2)) == 1 and cm.ep_of(1, Strategy(1, 4, ep=2)) == 2
    dispatch, seconds = cm.ep_dispatch(1, 4, Strategy(1, 4, ep=4))
    assert dispatch in ("allgather", "alltoall") and seconds > 0
    # a measured load imbalance: the busiest EP rank's expert work x 1.5; ep = 1 unchanged
    skew = CostModel(mixtral, gfx.Cluster.preset("8xA100-80GB"), reserve_bytes=0, precision="fp32", moe_imbalance=1.5)
    share = m.fwd_flops_expert(4) / (m.fwd_flops_sharded(4) + m.fwd_flops_rep(4))
    assert 0.3 < share < 1
    s = Strategy(1, 4, ep=2)
    assert skew.layer_cost(1, s, 16).fwd_s == pytest.approx(cm.layer_cost(1, s, 16).fwd_s * (1 + 0.5 * share))
    assert skew.layer_cost(1, Strategy(1, 4), 16).fwd_s == cm.layer_cost(1, Strategy(1, 4), 16).fwd_s
    with pytest.raises(ConfigError, match="moe_imbalance"):
        CostModel(mixtral, gfx.Cluster.preset("8xA100-80GB"), moe_imbalance=0.5)


def test_search_shards_experts_where_states_decide():
    """Real widths, 2 decoder layers: on one 8-GPU node the experts' states decide, and the search
    picks ep > 1 over the best ep = 1 plan (the benchmark plans the whole models). The budget is
    what the whole 24-layer model leaves these two: its other 22 layers hold ~53 GiB of states
    under ZeRO-2 at dp 8."""
    import transformers as tf

    cfg = tf.Qwen2MoeConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                            num_key_value_heads=16, intermediate_size=5632, moe_intermediate_size=1408,
                            shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                            decoder_sparse_step=1, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = tf.Qwen2MoeForCausalLM(cfg)
    ids = torch.zeros(2, 4096, dtype=torch.long, device="meta")
    gm = gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method="dynamo")
    plan = gfx.search(gm, cluster="8xH100-80GB", memory_budget="24GiB", global_batch_size=64)
    base = gfx.search(gm, cluster="8xH100-80GB", memory_budget="24GiB", global_batch_size=64, constraints={"ep": 1})
    assert max(lp.ep for lp in plan.layers) > 1 and all(lp.ep == 1 for lp in base.layers)
    assert plan.estimate["throughput_samples_s"] >= base.estimate["throughput_samples_s"]


def test_a_cost_model_cached_in_the_graph_survives_the_rewrites_copy(mixtral):
    """search / estimate cache their cost model in the graph's metadata, which transform's passes
    deep-copy: it must hold no fx nodes (an MoE graph crashed in gfx.transform after gfx.search)."""
    import copy

    plan = gfx.Plan.uniform(mixtral, 4, dp=4, ep=2, global_batch_size=8)
    gfx.estimate(mixtral, plan, gfx.Cluster.preset("4xA100-80GB"))
    copy.deepcopy(mixtral.meta)


def test_grouped_expert_matmuls_are_priced_by_shape_and_regrouped_under_ep(mixtral):
    """The experts' grouped GEMM is recorded as one GEMM per expert (rows: the tokens' top-k share
    over the experts) and priced by shape like every matmul; under ``ep`` a rank runs 1/ep of the
    experts on ep x the rows each: the same FLOPs, and never slower on a GPU's tile roofline."""
    cm = CostModel(mixtral, gfx.Cluster.preset("8xH100-80GB"), reserve_bytes=0, precision="bf16-mixed")
    S, k, E = loops.S, 2, 8
    expert = [(split, dims) for split, dims in cm.measure(1).fwd_gemms if split.startswith("e")]
    assert expert, "the experts' grouped matmuls are recorded as GEMMs"
    for _, (b, rows, _cols, _depth) in expert:
        assert b(4) == E and rows(4) == pytest.approx(4 * S * k / E)
    one, two = (cm.layer_cost(1, Strategy(1, 4, ep=e), 16) for e in (1, 2))
    assert two.fwd_s <= one.fwd_s and two.bwd_s <= one.bwd_s
