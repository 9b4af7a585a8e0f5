"""Tensor-parallel sharding analysis (no processes): which linears are column / row parallel, which
shape arguments carry head counts, what runs replicated, and the divisibility errors; then one test
per rule family of :mod:`galvatron_fx.sharding` on a tiny graph, and the rule registry itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import galvatron_fx as gfx
from galvatron_fx.errors import ConfigError
from galvatron_fx.ir import META_KEY, ShardInfo
from galvatron_fx.passes.tensor_parallel import apply_tensor_parallel, tensor_parallel_report
from galvatron_fx.sharding import (
    SEQ,
    TP,
    Sharded,
    Unsupported,
    analyze,
    default_rule,
    embedding_operands,
    linear_operands,
    lookup,
    register_rule,
    registered_ops,
    shard_tensor,
    unshard,
)
from galvatron_fx.sharding import registry as rule_registry
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
    # the loss runs on the vocabulary shards: the logits are never gathered
    assert len(res[3].vocab_losses) == 1
    assert not any(op[0] == "gather" for op in res[3].conversions.values())


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


def test_sequence_parallel_splits_a_length_tp_does_not_divide_unevenly():
    gm = _capture("gpt-tiny", seq_len=15)
    apply_tensor_parallel(gm, {1: (2, True)}, tp_rank_of=lambda i: 1, tp_group_of=lambda i: None)
    nodes = {n.name: n for n in gm.graph.nodes}
    # NOTE: without processes the chunk is rank 0's (8 of 15 tokens; rank 1 runs 7); the gather
    # carries the whole length
    assert tuple(nodes["layer_norm"].meta["val"].shape) == (2, 8, 64)
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "tp_all_gather_sequence"]
    assert gathers and all(n.args[-1] == 15 for n in gathers)


def test_shard_unshard_round_trip_with_blocks():
    full = torch.arange(64 * 3.0).reshape(64, 3)
    info = ShardInfo(dim=0, tp=4, rank=0, blocks=(32, 16, 16))
    shards = [shard_tensor(full, info, r) for r in range(4)]
    assert shards[1][:8].equal(full[8:16]) and shards[1][8:12].equal(full[36:40])
    assert unshard(shards, info).equal(full)


def test_sharding_sits_below_passes_cost_and_runtime():
    import ast
    import pathlib

    import galvatron_fx.sharding

    root = pathlib.Path(galvatron_fx.sharding.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                assert node.level == 1 or mod in ("..errors", "..ir", "__future__", "dataclasses",
                                                   "collections.abc", "typing"), (path.name, mod)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in ("torch", "operator") for a in node.names), (path.name, node.names)


def test_passes_tensor_parallel_still_exports_the_shard_math():
    from galvatron_fx.passes import tensor_parallel

    assert tensor_parallel.shard_tensor is shard_tensor and tensor_parallel.unshard is unshard


# ---------------------------------------------------------------------------------------------
# one tiny graph per rule family: two identical blocks (layers 0, 1) and a loss; blocks.0 analysed

B, S, D, H = 2, 8, 16, 4      # batch, sequence, hidden, heads
HD = D // H


class _Net(nn.Module):
    def __init__(self, block, vocab=None, pad=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, D, padding_idx=pad) if vocab else None
        self.blocks = nn.ModuleList(block() for _ in range(2))

    def forward(self, x, *mask):
        if self.emb is not None:
            x = self.emb(x)
        for b in self.blocks:
            x = b(x, *mask)
        return x.square().mean()


def _analyze_block(block, *args, tp=2, sp=False, vocab=None):
    """(analysis of blocks.0, its nodes by name, its nodes by op name) of ``_Net(block)``."""
    gm = gfx.capture(_Net(block, vocab), args, method="fx")
    layers = gm.meta[META_KEY].layers
    idx = next(r.index for r in layers if r.name == "blocks.0")
    res = analyze(gm, {idx: (tp, sp)})[idx]
    nodes = {n.name: n for n in gm.graph.nodes}
    return res, nodes, {r.name: r.index for r in layers}, gm


def _x():
    return torch.randn(B, S, D)


def _tp(dim, *origins):
    return Sharded(dim, TP, frozenset(origins))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.scale = nn.Parameter(torch.ones(4 * D))

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)) * self.scale * 0.5)


def test_pointwise_rule_mlp():
    res, nodes, _, _ = _analyze_block(_MLP, _x())
    assert res.column == ["linear"] and res.row == ["linear_1"] and not res.replicated_linears
    assert res.states["gelu"] == res.states["mul"] == res.states["mul_1"] == _tp(2, "linear")
    # a replicated full-width operand is scattered to this rank's features, the input copied (f)
    assert res.conversions == {("linear", "x"): ("copy",), ("mul", "blocks_0_scale"): ("scatter", 0)}
    assert res.reduce_after == {"linear_1": ("all_reduce",)}
    assert res.states["add"] is None and res.outputs == {"add": None}
    assert res.sharded_params == ["blocks.0.fc1.bias", "blocks.0.fc1.weight", "blocks.0.fc2.weight"]
    assert res.replicated_params == ["blocks.0.fc2.bias", "blocks.0.scale"]


class _FlatMLP(nn.Module):
    """The MLP on the flattened tokens, unflattened by the input's own leading sizes (fx records
    ``x.shape[:-1]`` as a node, not as ints)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        h = F.gelu(self.fc1(x.flatten(0, 1)))
        return x + self.fc2(h.unflatten(0, x.shape[:-1]))


def test_unflatten_by_sizes_the_graph_computes():
    """The split dim is not the sharded one: the features stay sharded through it, no size rewritten."""
    res, _, _, _ = _analyze_block(_FlatMLP, _x())
    assert res.column == ["linear"] and res.row == ["linear_1"] and not res.replicated_linears
    assert res.states["unflatten"] == _tp(2, "linear")
    assert "unflatten" not in res.shape_args


def test_linear_and_embedding_rules_sp_and_vocab():
    ids = torch.randint(0, 32, (B, S))
    gm = gfx.capture(_Net(_MLP, vocab=32), (ids,), method="fx")
    res = analyze(gm, {0: (2, True), 1: (2, True)})
    pre, block = res[0], res[1]
    assert pre.name == "pre" and pre.vocab_embeddings == ["embedding"]
    shard = pre.param_shards["emb_weight"]
    assert (shard.fqn, shard.dim, shard.tp, shard.blocks) == ("emb.weight", 0, 2, (32,))
    assert pre.reduce_after == {"embedding": ("reduce_scatter", 1)} and pre.outputs == {"embedding": Sharded(1, SEQ)}
    # under sp the column linear all-gathers the sequence, the row linear reduce-scatters it
    assert block.column == ["linear"] and block.row == ["linear_1"]
    assert block.conversions[("linear", "embedding")] == ("all_gather_seq", 1)
    assert block.reduce_after == {"linear_1": ("reduce_scatter", 1)}
    assert block.states["add"] == Sharded(1, SEQ)
    # 32 rows do not divide by 3: the table is replicated, not an error
    assert analyze(gm, {0: (3, False)})[0].replicated_linears == ["embedding"]


class _Dims(nn.Module):
    """unsqueeze / permute / transpose / squeeze / getitem / movedim / t on a feature-sharded value."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.w = nn.Linear(4 * D, 4 * D)

    def forward(self, x):
        h = self.fc1(x).unsqueeze(1).permute(0, 1, 3, 2).transpose(-1, -2).squeeze(1)   # [B, S, 4D]
        h = h[..., :].movedim(2, 0).movedim(0, 2)
        g = h.flatten(0, 1).t()                                    # [4D, B*S]
        return x + self.fc2(h + g.t().view(B, S, 4 * D) * 0)


def test_dim_rules_follow_the_sharded_dim():
    res, _, _, _ = _analyze_block(_Dims, _x())
    st = res.states
    assert res.column == ["linear"] and res.row == ["linear_1"]
    assert [st[n].dim for n in ("unsqueeze", "permute", "transpose", "squeeze", "getitem",
                                 "movedim", "movedim_1", "flatten", "t", "t_1", "view")] == \
        [3, 2, 3, 2, 2, 0, 2, 1, 0, 1, 2]
    assert {s.origins for s in st.values() if s is not None} == {frozenset({"linear"})}
    # view(B, S, 4D) of a sharded width: its size argument is halved
    assert res.shape_args == {"view": (2, 64, 32)}


class _FusedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, S, H, HD).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(o.transpose(1, 2).reshape(B, S, D))


def test_view_and_split_rules_heads_and_fused_qkv():
    res, _, _, _ = _analyze_block(_FusedQKV, _x())
    assert res.column == ["linear"] and res.row == ["linear_1"]
    # the fused output is split along its sharded dim: the weight is sharded per q / k / v block
    assert res.split_sizes == {"split": ((16, 16, 16), (8, 8, 8))}
    assert res.param_shards["blocks_0_qkv_weight"].blocks == (16, 16, 16)
    assert res.param_shards["blocks_0_qkv_bias"].blocks == (16, 16, 16)
    assert res.states["split"] == (_tp(2, "linear"),) * 3
    # view(B, S, H, HD): 4 heads -> 2 per rank; reshape(B, S, D): 16 -> 8
    assert res.shape_args == {"view": (2, 4, 2), "view_1": (2, 4, 2), "view_2": (2, 4, 2),
                              "reshape": (2, 16, 8)}
    assert res.states["transpose"] == _tp(1, "linear")


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, mask):
        q, k, v = (p(x).view(B, S, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.o(o.transpose(1, 2).reshape(B, S, D))


@pytest.mark.parametrize("mask_shape, conversion", [((S, S), ("copy",)), ((1, H, S, S), ("scatter", 1))])
def test_attention_rule_sdpa_with_mask(mask_shape, conversion):
    res, _, _, _ = _analyze_block(_Attention, _x(), torch.zeros(mask_shape))
    assert res.column == ["linear", "linear_1", "linear_2"] and res.row == ["linear_3"]
    assert res.states["scaled_dot_product_attention"] == _tp(1, "linear", "linear_1", "linear_2")
    # a mask without a heads dim is copied; one with heads is scattered to this rank's heads
    assert res.conversions[("scaled_dot_product_attention", "mask")] == conversion


class _ExpandedMQA(nn.Module):
    """Falcon's multi-query attention as transformers >= 5.25 writes it: one fused projection to H
    query heads and a single key and value head, which are expanded to H heads before attention."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, D + 2 * HD), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, S, H + 2, HD).split([H, 1, 1], dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t[:, :, None].expand(B, 1, H, S, HD).reshape(B, H, S, HD) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(o.transpose(1, 2).reshape(B, S, D))


def test_expanded_single_key_value_head_expands_to_this_ranks_heads():
    res, _, _, _ = _analyze_block(_ExpandedMQA, _x())
    # the query heads are sharded, the single key / value head's block is whole on every rank
    assert res.column == ["linear"] and res.row == ["linear_1"]
    assert res.param_shards["blocks_0_qkv_weight"].blocks == (D, HD, HD)
    # each rank expands the duplicated head to its own H / 2 heads, sharded like the query's
    assert res.shape_args["expand"] == (2, H, H // 2) and res.shape_args["expand_1"] == (2, H, H // 2)
    assert res.states["expand"] == _tp(2, "linear")
    assert res.states["scaled_dot_product_attention"] == _tp(1, "linear")


class _ManualAttention(nn.Module):
    """qk-norm over the head dim, scores by matmul, softmax, amax, cat along the sequence."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.qn = nn.LayerNorm(HD)

    def forward(self, x):
        q, k, v = (p(x).view(B, S, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = torch.matmul(self.qn(q), k.transpose(-2, -1)).softmax(dim=-1)
        a = a - a.amax(dim=-1, keepdim=True) + a.sum(dim=(2, 3)).unsqueeze(-1).unsqueeze(-1) * 0
        o = torch.cat([torch.matmul(a[:, :, : S // 2], v), torch.matmul(a[:, :, S // 2:], v)], dim=2)
        return x + self.o(o.transpose(1, 2).reshape(B, S, D))


def test_norm_reduction_cat_and_matmul_rules():
    res, _, _, _ = _analyze_block(_ManualAttention, _x())
    st = res.states
    qkv = ("linear", "linear_1", "linear_2")
    assert res.column == list(qkv) and res.row == ["linear_3"] and not res.replicated_linears
    assert st["layer_norm"] == _tp(1, "linear")          # normalises the head dim, not the heads
    assert res.conversions[("layer_norm", "blocks_0_qn_weight")] == ("copy",)
    assert st["matmul"] == st["softmax"] == st["amax"] == _tp(1, "linear", "linear_1")
    assert st["sum_1"] == _tp(1, "linear", "linear_1")   # sum over (2, 3) keeps the heads dim 1
    assert st["cat"] == _tp(1, *qkv)


class _LNOverFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.ln = nn.LayerNorm(4 * D)

    def forward(self, x):
        return x + self.fc2(self.ln(self.fc1(x)))


class _Flip(_LNOverFeatures):
    def forward(self, x):
        return x + self.fc2(self.fc1(x).flip(1))


@pytest.mark.parametrize("block", [_LNOverFeatures, _Flip])
def test_ops_that_cannot_run_on_shards_demote_the_linears(block):
    # a norm over the sharded features, or an op without a rule (flip): fc1 runs replicated, then fc2
    # (column parallel on a replicated input, its output would leave the layer sharded) too
    res, _, _, _ = _analyze_block(block, _x())
    assert res.column == [] and res.row == [] and res.replicated_linears == ["linear", "linear_1"]
    assert res.param_shards == {} and all(s is None for s in res.states.values())


def test_a_registered_rule_is_used(monkeypatch):
    monkeypatch.setattr(rule_registry, "_RULES", dict(rule_registry._RULES))

    @register_rule("flip")
    def flip(an, node, ins, states):   # flipping dims other than the sharded one keeps the shards
        s, dims = states[0], node.args[1:]
        if s.dim in [d % node.args[0].meta["val"].dim() for d in dims]:
            raise Unsupported
        return s

    res, _, _, _ = _analyze_block(_Flip, _x())
    assert res.column == ["linear"] and res.row == ["linear_1"] and res.states["flip"] == _tp(2, "linear")


# ---------------------------------------------------------------------------------------------
# the registry

# every op name the if-chain of the former passes/tp_patterns.py LayerAnalyzer.rule handled, by the
# module of its rule now
OLD_OPS = {
    "pointwise": [
        "add", "sub", "rsub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid",
        "relu", "gelu", "silu", "erf", "abs", "reciprocal", "square", "clamp", "where", "masked_fill",
        "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone", "detach",
        "alias", "dropout", "native_dropout", "softplus", "mish", "cos", "sin", "floor_divide", "mul_scalar",
    ],
    "linear": ["linear", "addmm", "embedding", "matmul", "bmm"],
    "views": [
        "view", "reshape", "unflatten", "flatten", "view_as", "reshape_as", "expand",
        "transpose", "t", "permute", "unsqueeze", "squeeze", "movedim", "repeat_interleave",
        "assert_tensor_metadata", "getattr", "size", "dim",
    ],
    "selections": ["select", "getitem", "split", "chunk", "split_with_sizes", "unbind", "slice", "narrow"],
    "attention": ["sdpa"],
    "losses": ["cross_entropy", "cross_entropy_loss"],
    "reductions": [
        "layer_norm", "rms_norm", "group_norm", "cat",
        "mean", "sum", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod",
        "softmax", "log_softmax", "cumsum", "argmax", "argmin",
    ],
}
# the rules added for real architectures (tests/test_sharding_rules_hf.py)
NEW_OPS = {
    "linear": ["baddbmm", "einsum", "grouped_mm_fallback", "grouped_mm", "_grouped_mm", "float8_matmul"],
    "selections": ["index"],
    "reductions": ["stack"],
    "pointwise": ["autograd_function_apply"],
    "views": ["sym_size"],   # a symbolic batch's size reads
}
# ops whose rule also sees non-tensor values (tuples of a split, sizes) or that are sources
NON_TENSOR_OPS = {"linear", "addmm", "embedding", "matmul", "bmm", "getitem", "split", "chunk",
                  "split_with_sizes", "unbind", "assert_tensor_metadata", "getattr", "size", "dim",
                  "baddbmm", "einsum", "grouped_mm_fallback", "grouped_mm", "_grouped_mm", "autograd_function_apply",
                  "sym_size", "float8_matmul"}


def test_registry_maps_every_op_of_the_old_dispatch():
    rules = registered_ops()
    for family, names in [*OLD_OPS.items(), *NEW_OPS.items()]:
        for name in names:
            assert name in rules, name
            assert rules[name].__module__ == f"galvatron_fx.sharding.{family}", (name, rules[name].__module__)
            assert lookup(name).fn is rules[name] and lookup(name).fn is not default_rule
            assert lookup(name).tensor_output == (name not in NON_TENSOR_OPS), name
    assert set(rules) == {n for names in [*OLD_OPS.values(), *NEW_OPS.values()] for n in names}
    assert lookup("flip").fn is default_rule and lookup("nll_loss").fn is default_rule


def test_register_rule_rejects_a_second_rule_for_an_op(monkeypatch):
    monkeypatch.setattr(rule_registry, "_RULES", dict(rule_registry._RULES))
    with pytest.raises(ValueError, match="sharding rule for 'gelu' registered twice"):
        register_rule("gelu")(lambda an, node, ins, states: None)
    with pytest.raises(ValueError):
        register_rule()
