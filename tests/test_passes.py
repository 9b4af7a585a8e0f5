"""The pass contract: each rewrite pass's requires / ensures on small graphs, and the PassManager.

One process, no process group: plans here need no communicator at build time (world size 1, or
pp = 2 over 2 ranks with one device per stage, seen from rank 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

import galvatron_fx as gfx
from galvatron_fx.errors import ConfigError
from galvatron_fx.parallelize import parallelize_passes
from galvatron_fx.passes.base import ContractError, GraphPass, PassError, PassManager
from galvatron_fx.passes.checkpointing import CheckpointingPass
from galvatron_fx.passes.codegen import CodegenPass
from galvatron_fx.passes.context import ParallelContext
from galvatron_fx.passes.data_parallel import DataParallelPass
from galvatron_fx.passes.local_batch import LocalBatchPass
from galvatron_fx.passes.resharding import ReshardingPass
from galvatron_fx.passes.split_layers import SplitLayersPass, layer_calls
from galvatron_fx.passes.stage_boundaries import StageInputsPass, StageOutputsPass
from galvatron_fx.passes.stage_split import StageSplitPass
from galvatron_fx.passes.tensor_parallel import TensorParallelPass
from galvatron_fx.runtime.checkpointing import checkpoint_layer, selective_checkpoint_layer
from galvatron_fx.runtime.module import DistributedModel
from galvatron_fx.runtime.pipeline_stage import pass_on


@pytest.fixture(scope="module")
def tiny():
    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=4)
    return model, args, gfx.capture(model, args, method="dynamo")


def _ctx(gm, world=1, **plan_kw):
    plan = gfx.Plan.uniform(gm, world, global_batch_size=4, **plan_kw)
    return ParallelContext(plan, 0, world, method="dynamo", global_batch=4)


def _split(gm, ctx):
    return PassManager([TensorParallelPass(ctx), SplitLayersPass()])(gm).graph_module


def test_pass_lists_read_like_the_plan(tiny):
    gm = tiny[2]
    names = [p.pass_name() for p in parallelize_passes(_ctx(gm))]
    assert names == ["token_loss", "tensor_parallel", "split_layers", "local_batch", "checkpointing",
                     "data_parallel", "resharding", "meta_device", "codegen", "bind_parameters"]
    names = [p.pass_name() for p in parallelize_passes(_ctx(gm, 2, pp=2, dp=1, micro_batches=2), bind={})]
    assert names == ["token_loss", "stage_split", "tensor_parallel", "split_layers", "local_batch",
                     "stage_outputs", "checkpointing", "data_parallel", "resharding", "stage_inputs", "meta_device",
                     "codegen", "bind_parameters"]


def test_tensor_parallel_contract(tiny):
    gm = tiny[2]
    ctx = _ctx(gm)
    assert TensorParallelPass(ctx)(gm).modified is False          # no tp > 1 layer: nothing to do
    top = SplitLayersPass()(gm).graph_module
    with pytest.raises(ConfigError, match="flat graph"):
        TensorParallelPass(ctx).requires(top)
    other = _ctx(gfx.capture(*gfx.models.build("gpt-tiny", device="cpu", layers=3, batch=4), method="fx"))
    with pytest.raises(ConfigError, match="layer-grouped graph of the plan's 5 layers"):
        TensorParallelPass(other).requires(gm)


def test_split_layers_contract(tiny):
    gm = tiny[2]
    top = SplitLayersPass()(gm).graph_module
    assert sorted(layer_calls(top)) == list(range(len(gfx.layers(gm))))
    with pytest.raises(ContractError, match="flat graph"):
        SplitLayersPass().requires(top)
    del top.layers_1
    with pytest.raises(ContractError, match="layers_1 is missing"):
        SplitLayersPass().ensures(top)


def test_local_batch_rewrites_baked_batch():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, 64, (4, 8))
    model = transformers.LlamaForCausalLM(cfg)
    gm = gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), symbolic_batch=False)
    ctx = _ctx(gm, micro_batches=2)
    with pytest.raises(ContractError, match="split top graph"):
        LocalBatchPass(ctx).requires(gm)
    p = LocalBatchPass(ctx)
    assert p(_split(gm, ctx)).modified and p.rewritten > 0         # dynamo baked B=4 into views
    symbolic = gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids))   # sizes computed: nothing to do
    ctx_sym = ParallelContext(ctx.plan, 0, 1, method="dynamo", global_batch=4, symbolic_batch=True)
    assert LocalBatchPass(ctx_sym)(_split(symbolic, ctx_sym)).modified is False
    ctx_fx = ParallelContext(ctx.plan, 0, 1, method="fx", global_batch=4)
    assert LocalBatchPass(ctx_fx)(_split(gm, ctx_fx)).modified is False   # fx: x.size(0), nothing baked


def test_checkpointing_contract(tiny):
    gm = tiny[2]
    ctx = _ctx(gm, ckpt=True)
    top = CheckpointingPass(ctx)(_split(gm, ctx)).graph_module
    calls = layer_calls(top)
    assert all(c.target is checkpoint_layer for c in calls.values())
    ctx.plan.layers[0].ckpt = False
    with pytest.raises(ContractError, match="layer 0: runs under checkpoint_layer but the plan says ckpt=False"):
        CheckpointingPass(ctx).ensures(top)
    ctx.plan.layers[0].ckpt = "selective"
    with pytest.raises(ContractError, match="layer 0: runs under checkpoint_layer but the plan says ckpt='selective'"):
        CheckpointingPass(ctx).ensures(top)
    ctx = _ctx(gm, ckpt="selective")
    calls = layer_calls(CheckpointingPass(ctx)(_split(gm, ctx)).graph_module)
    assert calls and all(c.target is selective_checkpoint_layer for c in calls.values())


def test_data_parallel_and_codegen_contract(tiny):
    gm = tiny[2]
    ctx = _ctx(gm, sdp="zero3")
    top = _split(gm, ctx)
    with pytest.raises(ContractError, match="output layout"):
        CodegenPass(ctx).requires(top)
    top = DataParallelPass(ctx)(top).graph_module
    assert len(ctx.stores) == len(gfx.layers(gm))                 # every layer has weights
    with pytest.raises(ContractError, match="ran already"):
        DataParallelPass(ctx).requires(top)
    top = ReshardingPass(ctx)(top).graph_module
    assert ctx.output_layout is not None and not ctx.output_layout.sp
    model = CodegenPass(ctx)(top).graph_module
    assert isinstance(model, DistributedModel) and model.stores == ctx.stores
    fresh = _ctx(gm)
    untouched = _split(gm, fresh)                                  # parameters still get_attr nodes
    with pytest.raises(ContractError, match="outside its flat buffer"):
        DataParallelPass(fresh).ensures(untouched)


def test_stage_passes_contract(tiny):
    gm = tiny[2]
    ctx = _ctx(gm, 2, pp=2, dp=1, micro_batches=2)
    with pytest.raises(ConfigError, match="contiguous"):
        StageSplitPass([(0, 1), (3, 3)], 0).requires(gm)
    with pytest.raises(ContractError, match="needs a pipeline stage"):
        StageOutputsPass(ctx).requires(gm)
    stage = StageSplitPass(ctx.plan.stages, 0, ctx)(gm).graph_module
    assert ctx.stage_info is stage.meta["galvatron"].stage and ctx.stage_info.index == 0
    top = StageOutputsPass(ctx)(_split(stage, ctx)).graph_module
    out = next(n for n in top.graph.nodes if n.op == "output")
    assert out.args[0] and all(x.target is pass_on for x in out.args[0])
    # rank 1 owns the last stage: its layers are renamed to their global indices
    ctx1 = ParallelContext(ctx.plan, 1, 2, method="dynamo", global_batch=4)
    stage1 = StageSplitPass(ctx.plan.stages, 1, ctx1)(gm).graph_module
    top1 = ReshardingPass(ctx1)(_split(stage1, ctx1)).graph_module
    top1 = StageInputsPass(ctx1)(top1).graph_module
    first, last = ctx.plan.stages[1]
    assert sorted(n for n, _ in top1.named_children()) == [f"layers_{i}" for i in range(first, last + 1)]


class _Breaks(GraphPass):
    name = "breaks_output"

    def call(self, gm):
        return PassResult(gm, False)

    def ensures(self, gm):
        raise ContractError("output node is gone")


class _Identity(GraphPass):
    name = "identity"

    def call(self, gm):
        return PassResult(gm, False)


def test_pass_manager_names_the_broken_pass(tiny):
    gm = tiny[2]
    pm = PassManager([_Identity(), _Breaks(), _Identity()])
    with pytest.raises(PassError, match=r"in pass 'breaks_output' \(after \['identity'\]\): contract broken: "
                                        "output node is gone"):
        pm(gm)
    assert pm.ran == ["identity"]
    ok = PassManager([_Identity(), _Identity()])
    assert ok(gm).graph_module is gm and ok.ran == ["identity", "identity"]


def test_pass_manager_keeps_user_errors_and_wraps_crashes(tiny):
    class Config(_Identity):
        name = "config"

        def call(self, gm):
            raise ConfigError("pick tp=1")

    class Crash(_Identity):
        name = "crash"

        def call(self, gm):
            raise RuntimeError("boom")

    with pytest.raises(ConfigError, match="pick tp=1") as info:
        PassManager([_Identity(), Config()])(tiny[2])
    assert "in pass 'config' (after ['identity'])" in "".join(getattr(info.value, "__notes__", [""]))
    with pytest.raises(PassError, match=r"in pass 'crash' \(after no pass\): RuntimeError: boom"):
        PassManager([Crash()])(tiny[2])


def test_bad_graph_is_caught_by_lint(tiny):
    class Dangling(_Identity):
        name = "dangling"

        def call(self, gm):
            other = torch.fx.Graph().placeholder("elsewhere")
            g = torch.fx.Graph()
            g.output(g.call_function(torch.relu, (other,)))   # reads a node of another graph
            return PassResult(torch.fx.GraphModule(torch.nn.Module(), g), True)

    with pytest.raises(PassError, match="in pass 'dangling'"):
        PassManager([Dangling()])(tiny[2])


def test_capture_side_pass_contracts(tiny):
    from galvatron_fx.passes.cost_annotation import CostAnnotationPass
    from galvatron_fx.passes.layer_grouping import LayerGroupingPass
    from galvatron_fx.passes.normalize import NormalizePass

    model, args, gm = tiny
    with pytest.raises(gfx.CaptureError, match="one name per input"):
        NormalizePass(model, list(args), ["only_one_name"] * (len(args) + 1)).requires(gm)
    broken = copy_graph(gm)
    next(n for n in broken.graph.nodes if n.op == "get_attr").meta["galvatron"].param = None
    with pytest.raises(ContractError, match="must hold a parameter or buffer"):
        NormalizePass(model, list(args), ["x"] * len(args)).ensures(broken)
    no_layer = copy_graph(gm)
    next(n for n in no_layer.graph.nodes if n.op == "call_function").meta["galvatron"].layer = None
    with pytest.raises(ContractError, match="has no layer"):
        LayerGroupingPass().ensures(no_layer)
    ungrouped = copy_graph(gm)
    ungrouped.meta["galvatron"].layers = []
    with pytest.raises(ContractError, match="layer-grouped graph"):
        CostAnnotationPass(gfx.Cluster.preset("1xA100-80GB")).requires(ungrouped)
    annotated = PassManager([CostAnnotationPass(gfx.Cluster.preset("1xA100-80GB"))])(copy_graph(gm)).graph_module
    assert len(annotated.meta["galvatron"].costs) == len(gfx.layers(gm))


def copy_graph(gm):
    """An independent copy of a captured graph (graph, node records, GraphInfo)."""
    from galvatron_fx.passes.split_layers import fresh_copy

    return fresh_copy(gm)


def test_local_batch_refuses_when_a_baked_batch_equals_a_sequence_length():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, 64, (4, 4))                                   # batch 4 == sequence 4
    gm = gfx.capture(transformers.LlamaForCausalLM(cfg), (), kwargs=dict(input_ids=ids, labels=ids),
                     symbolic_batch=False)   # NOTE: the static fallback (a symbolic batch needs no guess)
    ctx = _ctx(gm, micro_batches=2)
    with pytest.raises(ConfigError, match="also a length of its inputs"):
        LocalBatchPass(ctx)(_split(gm, ctx))


@pytest.mark.parametrize("method", ["dynamo", "export"])
def test_token_loss_rewrites_a_mean_cross_entropy(method):
    from galvatron_fx.passes.token_loss import SCALE_NAME, TokenLossPass

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (4, 8))
    labels = ids.clone()
    labels[:2, :5] = -100
    gm = gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=labels), method=method)
    ctx = _ctx(gm)
    out = TokenLossPass(ctx)(gm).graph_module
    assert out is not gm and ctx.token_loss is not None                       # a copy; the user's gm stays
    valid = (labels[:, 1:] != -100).sum().item()                              # HF shifts the labels
    assert ctx.token_loss.count(ids, labels).item() == valid
    ctx.token_loss.prepare([ids, labels])
    assert getattr(out, SCALE_NAME).item() == pytest.approx(1 / valid)
    loss = out(ids, labels)[0]
    assert loss.item() == pytest.approx(model(input_ids=ids, labels=labels).loss.item(), rel=1e-6)
    with pytest.raises(ContractError, match="flat captured graph"):
        TokenLossPass(ctx).requires(SplitLayersPass()(gm).graph_module)


def test_token_loss_leaves_other_losses_alone(tiny):
    class Mse(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

        def forward(self, x, y):
            for b in self.blocks:
                x = b(x)
            return torch.nn.functional.mse_loss(x, y)

    x = torch.randn(4, 4)
    gm = gfx.capture(Mse(), (x, x), method="fx")
    ctx = _ctx(gm)
    assert TokenLossPass_(ctx)(gm).modified is False and ctx.token_loss is None


def TokenLossPass_(ctx):
    from galvatron_fx.passes.token_loss import TokenLossPass

    return TokenLossPass(ctx)


def test_the_rewrite_order_is_declared_once_and_checked():
    """``passes.REWRITE_ORDER`` is the order: parallelize's docstring lists it, every plan's pass list
    follows it, and the pass manager refuses a list that breaks it."""
    import re

    import galvatron_fx.parallelize as par
    from galvatron_fx.passes import REWRITE_ORDER
    from galvatron_fx.passes.base import ContractError, GraphPass, PassManager

    listed = re.findall(r"^    (\w+) {2,}", par.__doc__, re.M)
    assert tuple(listed) == REWRITE_ORDER

    def named(name):
        def call(self, graph_module):
            raise AssertionError("never run: the order is checked on construction")
        return type(name, (GraphPass,), {"name": name, "call": call})()

    PassManager([named("tensor_parallel"), named("codegen")], order=REWRITE_ORDER)   # a subset, in order
    with pytest.raises(ContractError, match="must run before"):
        PassManager([named("data_parallel"), named("checkpointing")], order=REWRITE_ORDER)


def test_a_new_chunk_starts_with_no_products():
    """``for_chunk`` keeps the inputs and starts an empty products mapping; each product is a view
    of ``products[owner]`` (keyed by the dimension or pass that builds it, none reset by hand)."""
    import galvatron_fx as gfx
    from galvatron_fx.passes.context import ParallelContext, Product

    model, args = gfx.models.build("gpt-tiny", device="meta", layers=2)
    gm = gfx.capture(model, args, method="fx")
    ctx = ParallelContext(gfx.Plan.uniform(gm, 2, pp=2, micro_batches=2), rank=1, world_size=2, seq_len=7)
    products = {n: v.owner for n, v in vars(ParallelContext).items() if isinstance(v, Product)}
    assert products["tp_shards"] == "tensor" and products["stores"] == "data" and products["expert_params"] == "experts"
    for name in products:
        setattr(ctx, name, object())
    assert ctx.products["tensor"]["tp_shards"] is ctx.tp_shards
    assert set(ctx.products) == set(products.values())
    fresh = ctx.for_chunk(0)
    assert fresh.chunk == 0 and fresh.seq_len == 7 and fresh.rank == 1 and fresh.products == {}
    assert all(getattr(fresh, n) in (None, {}, []) for n in products)
    assert fresh.tp_shards is not ParallelContext(ctx.plan, 0, 2).tp_shards   # a new dict per context
