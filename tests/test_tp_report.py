"""The per-layer tensor-parallel report (galvatron_fx/sharding/report.py) on real transformers models:
what TP shards and why the rest stays whole, in ``galvatron-fx layers --tp``, ``plan.explain()``, the
search (no TP degree for a layer where it shards nothing) and the pass's warning."""

import os
import sys

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.cli import main
from galvatron_fx.planner import _engine
from galvatron_fx.sharding.report import tp_report
from galvatron_fx.solver.strategy import Strategy

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import hf_coverage  # noqa: E402


def vit_factory():
    """``package.module:factory`` for the CLI: a tiny HF ViT and its keyword inputs."""
    return hf_coverage.build("vit", device="meta")


@pytest.fixture(scope="module")
def vit():
    return hf_coverage.capture("vit", "dynamo", device="meta")


@pytest.fixture(scope="module")
def bert():
    return hf_coverage.capture("bert", "export", device="meta")


def test_vit_report_says_what_is_sharded_and_why_not(vit):
    pre, block, _, post = tp_report(vit, 2)
    assert pre.shards_nothing and pre.error is None and pre.sharded_fraction == 0
    assert "conv2d" in pre.replicated["vit.embeddings.patch_embeddings.projection.weight"]
    assert block.sharded_fraction > 0.9 and not block.shards_nothing
    assert block.sharded["vit.layers.0.attention.q_proj.weight"] == "column-parallel, dim 0"
    assert block.sharded["vit.layers.0.mlp.fc2.weight"] == "row-parallel, dim 1"
    assert "row-parallel" in block.replicated["vit.layers.0.mlp.fc2.bias"]
    assert not block.notable_whole()       # norms and row biases are whole by design
    assert post.sharded_fraction > 0.5
    assert tp_report(vit, 3)[1].error      # 4 heads do not divide by 3: rejected, with the reason


def test_a_demoted_linear_names_the_op_that_forced_it(bert):
    post = tp_report(bert, 2)[-1]
    notable = post.notable_whole()
    assert notable and all("runs replicated" in why for why in notable.values())
    assert any("layer_norm cannot run on tensor-parallel shards" in why for why in notable.values()), notable


def test_cli_layers_tp_prints_the_report(capsys):
    assert main(["layers", "tests.test_tp_report:vit_factory", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp=2" in out and "shards nothing" in out and "98% of params sharded" in out
    assert "patch_embeddings.projection.weight: not a linear or embedding weight (read by conv2d)" in out


def test_search_does_not_offer_tp_where_it_shards_nothing(vit):
    cluster = gfx.Cluster.preset("8xA100-80GB")
    args = (vit, cluster, 2, 80e9, 8)
    eng = _engine(*args, {"pp": 1}, {}, False)
    tp1, tp2, tp2_sp = Strategy(1, 2), Strategy(2, 1), Strategy(2, 1, sp=True)
    assert eng._admissible(0, (tp1, tp2)).tolist() == [True, False]     # pre: patch conv, cls, positions
    assert eng._admissible(1, (tp1, tp2)).tolist() == [True, True]
    # ViT's 17 tokens split unevenly (9 + 8) under sequence parallelism: admitted, as the pass runs it
    assert eng._admissible(1, (tp1, tp2_sp)).tolist() == [True, True]
    uniform = _engine(*args, {"pp": 1, "uniform": True}, {}, False)
    assert uniform._admissible(0, (tp1, tp2)).tolist() == [True, True]  # a uniform tp plan stays possible
    # pinned tp=2: nothing else is left for pre, so it keeps tp=2, and explain() says what that shards
    plan = gfx.search(vit, cluster, "80GB", 8, world_size=2, constraints={"pp": 1, "tp": 2})
    assert [la.tp for la in plan.layers] == [2, 2, 2, 2]
    text = plan.explain()
    assert "tp=2 shards nothing (4 parameter(s) stay whole): layers 0" in text
    assert "tp=2 98% of params sharded: layers 1, 2" in text
    assert gfx.Plan.from_dict(plan.to_dict()).explain() == text


def test_pinning_tp_on_a_layer_that_shards_nothing_warns():
    from galvatron_fx.passes.tensor_parallel import apply_tensor_parallel

    gm = hf_coverage.capture("vit", "dynamo", device="cpu")
    with pytest.warns(UserWarning, match=r"layer pre: tp=2 shards none of its parameters \(vit\.embeddings"):
        apply_tensor_parallel(gm, {0: (2, False), 1: (2, False)}, tp_rank_of=lambda layer: 0,
                              tp_group_of=lambda layer: None)
    torch._dynamo.reset()


def test_a_layer_tp_shards_nothing_is_priced_replicated(vit):
    """Pinned tp=2 on ViT's ``pre`` (patch conv, cls token, positions): the layer repeats whole on
    both TP ranks, so every figure equals tp=1's at the same DP degree (its ZeRO group)."""
    import dataclasses

    from galvatron_fx.cost.model import CostModel
    from galvatron_fx.solver.strategy import Strategy

    cm = CostModel(vit, gfx.Cluster.preset("8xA100-80GB"))
    assert cm.layer_params(0, 2).sharded == 0
    for sdp in ("none", "zero2", "zero3"):
        one, two = cm.layer_cost(0, Strategy(1, 4, sdp), 8), cm.layer_cost(0, Strategy(2, 4, sdp), 8)
        assert dataclasses.asdict(one) == dataclasses.asdict(two), sdp


def _vit_states(rank, world):
    import warnings

    from galvatron_fx.cost import CostModel
    from galvatron_fx.runtime.groups import Layout

    model, model_inputs = hf_coverage.build("vit", device="cpu")
    gm = gfx.capture(model, (), kwargs=model_inputs, method="dynamo")
    batch = next(iter(model_inputs.values())).shape[0]
    cm = CostModel(gm, gfx.Cluster.preset(f"{world}xA100-80GB"), reserve_bytes=0)
    out = []
    for tp in (1, 2):
        plan = gfx.Plan.uniform(gm, world, global_batch_size=batch, sdp="zero3")
        plan.layers[0].tp, plan.layers[0].dp = tp, world // tp
        plan.validate()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # tp=2 on pre shards nothing: the warning is the point above
            dm = gfx.transform(gm, plan=plan)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        dm.train_step(**model_inputs)
        opt.step()
        predicted = sum(cm.states_bytes(i, s, dp_index=Layout(s.tp, s.dp).batch_index(rank)).total
                        for i, s in enumerate(plan.layer_strategies()))
        out.append((dm.states_bytes(opt)["total"], predicted))
    return out


@pytest.mark.dist
def test_live_states_of_a_layer_tp_shards_nothing_equal_the_estimate():
    from tests.dist_utils import run_distributed

    for rank, pairs in enumerate(run_distributed(_vit_states, 2, timeout=240)):
        for measured, predicted in pairs:
            assert measured == predicted, (rank, measured, predicted)
