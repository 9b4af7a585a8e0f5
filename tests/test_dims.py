"""The dimension registry (galvatron_fx/dims): the strategy, the space, the admission, the plan JSON
and explain() are read from it, so a dimension added to it reaches each of them."""

from __future__ import annotations

import dataclasses
import importlib
import types

import pytest

import galvatron_fx as gfx
from galvatron_fx import dims
from galvatron_fx.dims import Admission, Dimension, Field, SpaceOptions
from galvatron_fx.dims.base import a_bool, rule
from galvatron_fx.passes import REWRITE_ORDER
from galvatron_fx.plan import LayerPlan
from galvatron_fx.solver.strategy import Strategy, strategy_space


def test_the_strategy_is_the_registered_fields_in_order():
    names = [f.name for f in dataclasses.fields(Strategy)]
    assert names == [f.name for f in dims.fields()]
    assert names[:8] == ["tp", "dp", "sdp", "sp", "ckpt", "ep", "cp", "cp_kind"]   # positional order kept
    assert len({f.position for f in dims.fields()}) == len(names)


def test_every_dimension_names_passes_and_runtime_modules_that_exist():
    claimed = [p.name for d in dims.DIMENSIONS for p in d.passes]
    assert len(claimed) == len(set(claimed)), "a pass belongs to one dimension"
    for d in dims.DIMENSIONS:
        for p in d.passes:
            assert hasattr(importlib.import_module(f"galvatron_fx.passes.{p.name}"), p.class_name), p
            assert REWRITE_ORDER.index(p.name) > REWRITE_ORDER.index(p.after), (d.name, p)
        for r in d.runtime:
            importlib.import_module(f"galvatron_fx.{r}")
        assert all(r.doc for r in d.rules), d.name


def test_plan_json_keys_come_from_the_registry():
    lp = LayerPlan("blocks.0", 2, 4, "zero3", True, True, ep=2, cp=2, cp_kind="ulysses")
    d = lp.to_dict()
    assert {f.name for f in dims.json_fields() if f.complete is None and not f.omit_default} <= set(d) \
        and "expert_tp" not in d
    again = LayerPlan.from_dict(d, 0)
    assert again == lp and again.strategy == Strategy(2, 4, "zero3", True, True, 2, 2, "ulysses")
    old = {k: v for k, v in d.items() if k not in ("ep", "cp", "cp_kind")}   # a plan written before EP / CP
    assert LayerPlan.from_dict(old, 0).strategy == Strategy(2, 4, "zero3", True, True)
    with pytest.raises(gfx.ConfigError, match="missing key"):
        LayerPlan.from_dict({k: v for k, v in d.items() if k != "sdp"}, 0)


def _toy() -> Dimension:
    """A dimension the package does not have: ``spill`` (bool), offered when the constraint asks."""
    def _spill_needs_dp(s, o):
        """Spilling is offered with data parallelism only (a stand-in rule)."""
        return not s.spill or s.dp > 1

    def admission(cost_model, constraints):
        return Admission(admits=lambda layer, s: not s.spill or layer != 0)

    return Dimension(
        "spill", (Field("spill", bool, False, 95, check=a_bool,
                          values=lambda o, n, c: (False, True) if o.more.get("spill") else (False,)),),
        rules=(rule(_spill_needs_dp),), admission=admission,
        label=lambda s: [(80, "spill")] if s.spill else [],
        explain=lambda layers: [f"spill: {sum(bool(lp.value('spill')) for lp in layers)} layer(s)"],
        constraints=("spill",), space_options=lambda c: {"spill": bool(c.get("spill"))})


def test_a_registered_dimension_reaches_the_space_the_admission_the_label_and_explain(monkeypatch):
    toy = _toy()
    monkeypatch.setattr(dims, "DIMENSIONS", dims.DIMENSIONS + (toy,))
    make = types.SimpleNamespace
    opts = SpaceOptions(4, more=dims.space_options({"spill": True}))
    tree = list(dims.enumerate_strategies(make, opts))
    plain = list(dims.enumerate_strategies(make, SpaceOptions(4)))
    assert len(tree) == 2 * len(plain) and {s.spill for s in tree} == {False, True}
    kept = [s for s in tree if all(r.allows(s, opts) for r in dims.rules())]
    assert kept and all(not s.spill or s.dp > 1 for s in kept)
    assert "spill_needs_dp" in [r.name for r in dims.rules()] and "spill" in dims.constraint_keys()
    s = make(tp=2, dp=2, sdp="zero3", sp=False, ckpt=True, ep=1, cp=1, cp_kind="ring", expert_tp=True, spill=True)
    assert dims.label(s) == "tp2·dp2·zero3·ckpt·spill"

    class _Model:   # the cost model's analyses, as the admissions read them
        def tp_analysis(self, layer, tp, sp=False):
            return types.SimpleNamespace(sharded_params=["w"])

        def experts(self, layer):
            return None

        def cp_refuses(self, layer, cp, kind, tp):
            return None
    admits, _ = dims.admission(_Model())
    assert admits(1, s) and not admits(0, s)
    assert dims.explain_lines([LayerPlan("a", 1, 2, extra={"spill": True})])[-1] == "spill: 1 layer(s)"
    assert dims.extra_fields(s, frozenset({"tp", "dp", "sdp", "sp", "ckpt", "ep", "cp", "cp_kind"})) == {"spill": True}


def test_the_space_is_the_product_the_rules_filter():
    for n in (1, 2, 4, 8, 16):
        space = strategy_space(n, ep=(1, 2), cp=(1, 2))
        o = SpaceOptions(n, ep=(1, 2), cp=(1, 2))
        product = [s for s in dims.enumerate_strategies(Strategy, o) if all(r.allows(s, o) for r in dims.rules())]
        assert space == product and len(set(space)) == len(space)


def test_a_dimensions_cost_terms_add_to_the_layer_cost(monkeypatch):
    """layer_cost is the base terms plus each registered dimension's: a dimension adding forward
    seconds, overhead and transient bytes moves exactly those (and what they feed)."""
    from galvatron_fx.dims import CostTerms
    from galvatron_fx.planner import cost_model_for

    model, args = gfx.models.build("gpt-tiny", device="meta", layers=1)
    gm = gfx.capture(model, args, method="fx")
    cm = cost_model_for(gm, gfx.Cluster.preset("8xA100-80GB"), precision="fp32")
    s = Strategy(2, 4, "zero2")
    before = cm.layer_cost(1, s, 8)
    extra = Dimension("extra", (), compute_terms=lambda cm, i, n, s: (1e-3, 0.0),
                      cost_terms=lambda cm, i, n, s, work: CostTerms(overhead_s=0.5, transient_bytes=100.0))
    monkeypatch.setattr(dims, "DIMENSIONS", dims.DIMENSIONS + (extra,))
    after = cm.layer_cost(1, s, 8)
    assert after.fwd_s == pytest.approx(before.fwd_s + 1e-3) and after.bwd_s == before.bwd_s
    assert after.overhead_s == pytest.approx(before.overhead_s + 0.5, rel=1e-3)   # its launches grow with fwd
    assert after.transient_bytes == before.transient_bytes + 100.0
    assert after.param_bytes == before.param_bytes and after.grad_sync_s == before.grad_sync_s


def test_the_rewrite_order_places_each_dimensions_passes(monkeypatch):
    """The order is the skeleton with each dimension's passes after the one it names: a registered
    dimension's pass lands there (and the plan's pass list builds it from its module by name)."""
    from galvatron_fx.dims import PassSpec
    from galvatron_fx.passes import REWRITE_ORDER, REWRITE_SKELETON

    assert dims.rewrite_order(REWRITE_SKELETON) == REWRITE_ORDER
    extra = Dimension("extra", (), passes=(PassSpec("offload", after="data_parallel"),))
    monkeypatch.setattr(dims, "DIMENSIONS", dims.DIMENSIONS + (extra,))
    order = dims.rewrite_order(REWRITE_SKELETON)
    assert order[order.index("data_parallel") + 1] == "offload" and len(order) == len(REWRITE_ORDER) + 1
    assert PassSpec("context_parallel", after="local_batch").class_name == "ContextParallelPass"


def test_a_dimension_moving_activations_to_the_host(monkeypatch):
    """A dimension's ``activation_bytes`` / ``host_activation_bytes`` move what a layer keeps for
    its backward from the device to the host: the estimate's device activations drop by those bytes
    per micro-batch in flight, its host bytes grow by them, and the search's host tables count them
    per stage (a host budget below them leaves no plan)."""
    from galvatron_fx.dims import CostTerms

    model, args = gfx.models.build("gpt-tiny", device="meta", layers=2)
    gm = gfx.capture(model, args, method="fx")
    cluster = gfx.Cluster.preset("8xA100-80GB")
    plan = gfx.Plan.uniform(gm, 8, pp=2, micro_batches=4, global_batch_size=32, schedule="1f1b")
    before = gfx.estimate(gm, plan, cluster)
    moved = Dimension("moved", (), cost_terms=lambda cm, i, n, s, work: CostTerms(
        activation_bytes=-work.kept_bytes, host_activation_bytes=work.kept_bytes))
    monkeypatch.setattr(dims, "DIMENSIONS", dims.DIMENSIONS + (moved,))
    after = gfx.estimate(gm, plan, cluster)
    acts = before["per_device"]["activation_bytes"]
    assert after["per_device"]["activation_bytes"] == [0, 0] and min(acts) > 0
    assert [a - b for a, b in zip(after["host_bytes_per_device"], before["host_bytes_per_device"])] == acts
    assert after["memory_bytes_per_device"] == [m - a for m, a in zip(before["memory_bytes_per_device"], acts)]
    fixed = dict(pp=2, micro_batches=4, schedule="1f1b", tp=1, sdp="none", ckpt=False, offload=False)
    cluster.host_memory_bytes = 8 * (max(acts) - 1)   # each device's share: a byte short of the hungrier stage
    plan = gfx.search(gm, cluster, "80GiB", 32, constraints=fixed)
    assert max(plan.estimate["host_bytes_per_device"]) <= max(acts) - 1 < max(acts)
    cluster.host_memory_bytes = 8
    with pytest.raises(gfx.InfeasibleError, match="host memory"):
        gfx.search(gm, cluster, "80GiB", 32, constraints=fixed)


def test_a_dimensions_constraint_and_field_need_no_flag_of_their_own(tmp_path):
    """A registered dimension's search constraint reaches the command line as ``--constrain
    KEY=VALUE`` and its plan field ``Plan.uniform`` as a keyword: CPU offload through both."""
    import json

    from galvatron_fx.cli import main
    from galvatron_fx.cli_args import dimension_constraints

    assert dimension_constraints(["offload=optimizer", "hsdp=2,4"]) == {"offload": "optimizer", "hsdp": [2, 4]}
    assert dimension_constraints(["offload=false"]) == {"offload": False}
    with pytest.raises(gfx.ConfigError, match="--constrain 'nosuch=1': use KEY=VALUE with KEY one of"):
        dimension_constraints(["nosuch=1"])
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", "8xA100-80GB", "--global-batch-size", "16", "--pp", "1",
                 "--constrain", "offload=optimizer", "--json", str(path)]) == 0
    layers = json.loads(path.read_text())["layers"]
    assert all(la.get("offload", "none") == ("optimizer" if la["sdp"] != "none" else "none") for la in layers)
    from galvatron_fx.cli_args import build_parser, pipeline_constraints

    def constraints(*flags):
        return pipeline_constraints(build_parser().parse_args(["plan", "gpt-tiny", "--cluster", "8xA100-80GB", *flags]))
    assert constraints("--constrain", "offload=optimizer") == constraints("--offload") == {"offload": "optimizer"}
    names = ["a", "b"]
    plan = gfx.Plan.uniform_from_layer_names(names, 8, sdp="zero2", **{"offload": "optimizer"})
    assert [la.value("offload") for la in plan.layers] == ["optimizer"] * 2
    with pytest.raises(gfx.ConfigError, match="unknown keyword"):
        gfx.Plan.uniform_from_layer_names(names, 8, nosuch=1)


def test_a_field_marked_omit_default_is_written_only_where_set(monkeypatch):
    """A dimension most plans never use keeps their JSON as it was: its field, marked
    ``omit_default``, is written only where a layer sets it (absent, it reads as the default)."""
    from galvatron_fx.plan import LayerPlan

    extra = Dimension("extra", (Field("knob", bool, False, 130, omit_default=True),))
    monkeypatch.setattr(dims, "DIMENSIONS", dims.DIMENSIONS + (extra,))
    layer = LayerPlan("a", 1, 8, "none", False, False)
    assert "knob" not in layer.to_dict() and "offload" in layer.to_dict()
    layer.extra["knob"] = True
    assert layer.to_dict()["knob"] is True
