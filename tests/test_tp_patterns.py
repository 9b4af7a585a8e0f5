"""Tensor-parallel pattern detection (no processes): which linears are column / row parallel, which
shape arguments carry head counts, what runs replicated, and the divisibility errors."""

from __future__ import annotations

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.errors import ConfigError
from galvatron_fx.ir import META_KEY, ShardInfo
from galvatron_fx.passes.tensor_parallel import (
    apply_tensor_parallel,
    shard_tensor,
    tensor_parallel_report,
    unshard,
)
from galvatron_fx.passes.tp_patterns import analyze, embedding_operands, linear_operands
from tests.test_tensor_parallel_dist import SMALL, build
from tests.toy_models import ToyLM


def _capture(name, method="fx", **overrides):
    if overrides or name not in SMALL and name != "fused-qkv":
        model, args = gfx.models.build(name, device="cpu", **{**SMALL.get(name, {}), **overrides})
    else:
        model, args = build(name)
    return gfx.capture(model, args, method=method)


def _fqn(gm, node_name):
    node = next(n for n in gm.graph.nodes if n.name == node_name)
    ops = linear_operands(node) or embedding_operands(node)
    w = ops[1]
    return w.meta[META_KEY].param.fqn.rsplit(".", 1)[0]


def _roles(gm, tp=2, sp=False, layers=None):
    info = gm.meta[META_KEY]
    res = analyze(gm, {i: (tp, sp) for i in (layers if layers is not None else range(len(info.layers)))})
    return res, {r.name: {"column": {_fqn(gm, n) for n in r.column}, "row": {_fqn(gm, n) for n in r.row},
                          "vocab": {_fqn(gm, n) for n in r.vocab_embeddings},
                          "replicated": {_fqn(gm, n) for n in r.replicated_linears}} for r in res.values()}


@pytest.mark.parametrize("method", ["fx", "dynamo", "export"])
def test_gpt_tiny_column_row_and_head_args(method):
    gm = _capture("gpt-tiny", method)
    res, roles = _roles(gm)
    for b in ("blocks.0", "blocks.1"):
        assert roles[b]["column"] == {f"{b}.attn.q", f"{b}.attn.k", f"{b}.attn.v", f"{b}.mlp.fc1"}
        assert roles[b]["row"] == {f"{b}.attn.o", f"{b}.mlp.fc2"}
        assert not roles[b]["replicated"]
    assert roles["pre"]["vocab"] == {"wte", "wpe"}
    assert roles["post"]["column"] == {"lm_head"}
    block = res[1]
    # three head splits (q, k, v): 4 heads -> 2 per rank
    assert sorted(v[1:] for v in block.shape_args.values()) == [(4, 2)] * 3
    assert block.replicated_params == sorted(f"blocks.0.{p}" for p in
                                             ("attn.o.bias", "ln1.bias", "ln1.weight", "ln2.bias", "ln2.weight", "mlp.fc2.bias"))
    assert "blocks.0.attn.q.weight" in block.sharded_params
    # logits are all-gathered before the loss
    assert any(op[0] == "gather" for op in res[3].conversions.values())


@pytest.mark.parametrize("method", ["fx", "export"])
def test_llama_gqa_swiglu(method):
    gm = _capture("llama-7b", method)
    res, roles = _roles(gm, sp=True)
    b = "blocks.0"
    assert roles[b]["column"] == {f"{b}.attn.{p}" for p in "qkv"} | {f"{b}.mlp.gate", f"{b}.mlp.up"}
    assert roles[b]["row"] == {f"{b}.attn.o", f"{b}.mlp.down"}
    # 4 query heads -> 2, 2 key/value heads -> 1
    assert sorted(v[1:] for v in res[1].shape_args.values()) == [(2, 1), (2, 1), (4, 2)]
    assert {op[0] for op in res[1].conversions.values()} == {"copy", "all_gather_seq"}
    assert set(res[1].reduce_after.values()) == {("reduce_scatter", 1)}


def test_bert_post_ln_and_tied_decoder():
    gm = _capture("bert-huge-32", "dynamo")
    res, roles = _roles(gm)
    b = "blocks.1"
    assert roles[b]["column"] == {f"{b}.attn.{p}" for p in "qkv"} | {f"{b}.mlp.fc1"}
    assert roles[b]["row"] == {f"{b}.attn.o", f"{b}.mlp.fc2"}
    # the MLM transform feeds a LayerNorm over its output features: it runs replicated
    assert roles["post"]["replicated"] == {"head_dense"}
    assert roles["post"]["column"] == {"word_embed"}   # decoder.weight: tied, named by its first fqn
    assert "decoder.bias" in res[3].sharded_params
    # decoder.weight is tied to word_embed.weight: both uses shard the vocab rows alike
    assert roles["pre"]["vocab"] == {"word_embed", "pos_embed"}
    assert "word_embed.weight" in res[3].sharded_params and "head_dense.weight" in res[3].replicated_params


@pytest.mark.parametrize("method", ["fx", "dynamo", "export"])
def test_fused_qkv_sharded_per_block(method):
    gm = _capture("fused-qkv", method)
    res, roles = _roles(gm)
    assert roles["blocks.0"]["column"] == {"blocks.0.qkv", "blocks.0.fc"}
    assert roles["blocks.0"]["row"] == {"blocks.0.proj", "blocks.0.out"}
    shard = next(s for s in res[1].param_shards.values() if s.fqn == "blocks.0.qkv.weight")
    assert shard.blocks == (32, 16, 16) and shard.dim == 0
    assert list(res[1].split_sizes.values()) == [((32, 16, 16), (16, 8, 8))]
    # view(b, s, 4, 8) -> view(b, s, 2, 8); view(b, s, 2, 8) (kv) -> view(b, s, 1, 8); reshape(b, s, 32) -> 16
    assert sorted(v[1:] for v in res[1].shape_args.values()) == [(2, 1), (2, 1), (4, 2), (32, 16)]


def test_linear_feeding_the_residual_runs_replicated():
    model = ToyLM(n=2, d=16, vocab=32)
    ids = torch.randint(0, 32, (2, 8))
    gm = gfx.capture(model, (ids, ids), method="fx")
    res, roles = _roles(gm, layers=[1])
    # blocks.0.attn is Linear(d, d) added straight to the residual: no row partner, so replicated
    assert roles["blocks.0"]["replicated"] == {"blocks.0.attn"}
    assert roles["blocks.0"]["column"] == {"blocks.0.mlp.0"}
    assert roles["blocks.0"]["row"] == {"blocks.0.mlp.2"}
    assert "blocks.0.attn.weight" in res[1].replicated_params


class _MatmulBlock(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(d, 4 * d) * 0.1)    # [in, out]: x @ w
        self.w_out = torch.nn.Parameter(torch.randn(4 * d, d) * 0.1)

    def forward(self, x):
        return x + torch.nn.functional.silu(x @ self.w_in) @ self.w_out


class _MatmulNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MatmulBlock() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.mark.filterwarnings("ignore:galvatron_fx found no repeated layers")
def test_matmul_with_parameter_weight():
    gm = gfx.capture(_MatmulNet(), (torch.randn(2, 4, 16),), method="fx")
    layer = next(r.index for r in gm.meta[META_KEY].layers if "blocks.0.w_in" in r.params)
    res = analyze(gm, {layer: (2, False)})[layer]
    shards = {s.fqn: s.dim for s in res.param_shards.values() if s.fqn.startswith("blocks.0.")}
    assert shards == {"blocks.0.w_in": 1, "blocks.0.w_out": 0}   # column: W[in, out] by columns


def test_vocab_not_divisible_is_replicated_not_an_error():
    gm = _capture("gpt-tiny", vocab=130)
    res, roles = _roles(gm, tp=4)
    assert roles["pre"]["vocab"] == {"wpe"} and roles["pre"]["replicated"] == {"wte"}
    assert roles["post"]["replicated"] == {"lm_head"}


@pytest.mark.parametrize("name, overrides, tp, sp, message", [
    ("gpt-tiny", dict(hidden=96, heads=6), 4, False, "layer blocks.0: 6 attention heads are not divisible by tp=4; use tp in {1, 2, 3, 6}"),
    ("llama-7b", dict(kv_heads=2), 4, False, "layer blocks.0: 2 key/value heads are not divisible by tp=4; use tp in {1, 2}"),
    ("gpt-tiny", dict(ffn_hidden=66), 4, False, "layer blocks.0: ffn width 66"),
    ("gpt-tiny", dict(seq_len=15), 2, True, "sequence length 15 is not divisible by tp=2"),
])
def test_not_divisible_raises_config_error(name, overrides, tp, sp, message):
    gm = _capture(name, **overrides)
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        analyze(gm, {1: (tp, sp), 2: (tp, sp)})


def test_apply_without_processes_updates_shapes_and_report():
    gm = _capture("gpt-tiny")
    apply_tensor_parallel(gm, {1: (2, True), 3: (2, True)}, tp_rank_of=lambda i: 1, tp_group_of=lambda i: None)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert tuple(nodes["blocks_0_attn_q_weight"].meta["val"].shape) == (32, 64)
    assert tuple(nodes["unflatten"].meta["val"].shape) == (2, 16, 2, 16)
    assert tuple(nodes["layer_norm"].meta["val"].shape) == (2, 8, 64)   # sequence shard
    assert gm.get_parameter("blocks.0.attn.q.weight").shape == (32, 64)
    assert "tp_all_gather_sequence" in gm.code and "tp_reduce_scatter_sequence" in gm.code
    report = tensor_parallel_report(gm)
    assert set(report) == {1, 3} and "blocks.0.mlp.fc1.weight" in report[1]["sharded"]
    layer_nodes = set(gm.meta[META_KEY].layers[1].nodes)
    assert any(n.startswith("tp_all_gather_sequence") for n in layer_nodes)


def test_shard_unshard_round_trip_with_blocks():
    full = torch.arange(64 * 3.0).reshape(64, 3)
    info = ShardInfo(dim=0, tp=4, rank=0, blocks=(32, 16, 16))
    shards = [shard_tensor(full, info, r) for r in range(4)]
    assert shards[1][:8].equal(full[8:16]) and shards[1][8:12].equal(full[36:40])
    assert unshard(shards, info).equal(full)
