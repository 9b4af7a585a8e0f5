"""Cost model: scaling rules, memory model, attention FLOPs, predicted vs real saved activations."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import galvatron_fx as gfx
from galvatron_fx.cluster import Cluster
from galvatron_fx.cost import CostModel, extract_layer, measure_layer, states_bytes
from galvatron_fx.cost.measure import saved_bytes
from galvatron_fx.cost.memory import StatesBytes
from galvatron_fx.models.layers import MLP, Attention
from galvatron_fx.solver.strategy import Strategy


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(self.ln(x))))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


CLUSTER = Cluster.preset("8xA100-80GB")


@pytest.fixture(scope="module")
def tiny():
    gm = gfx.capture(Tiny(), (torch.randn(4, 3, 8),), method="fx")
    return gm, [r.index for r in gfx.layers(gm) if r.kind == "block"][-1]


def test_tiny_param_split(tiny):
    gm, i = tiny
    cm = CostModel(gm, CLUSTER)
    # fc1 weight+bias (column) and fc2 weight (row) are sharded; LayerNorm and fc2's bias are not.
    p = cm.layer_params(i, 2)
    assert (p.sharded, p.replicated) == (128 + 16 + 128, 8 + 8 + 8)
    assert (cm.layer_params(i, 1).sharded, cm.layer_params(i, 1).replicated) == (0, 296)
    # the split is the tensor-parallel pass's own: a degree it rejects (16 ffn columns / 32) says so
    assert isinstance(cm.tp_analysis(i, 32), gfx.ConfigError)


@pytest.mark.parametrize("strategy, mixed, expect", [
    (Strategy(1, 1), False, (296 * 4, 296 * 4, 296 * 8)),
    (Strategy(2, 1), False, (160 * 4, 160 * 4, 160 * 8)),
    (Strategy(1, 2, "zero2"), False, (1184 + 592, 592, 1184)),   # the whole buffer + its shard (a copy)
    (Strategy(1, 2, "zero3"), False, (592, 592, 1184)),
    (Strategy(2, 2, "zero3"), False, (320, 320, 640)),
    # mixed: bf16 working copy (none under ZeRO-3), fp32 grads, fp32 moments, fp32 masters
    (Strategy(1, 1), True, (296 * 2, 296 * 4, 296 * 8, 296 * 4)),
    (Strategy(1, 2, "zero2"), True, (296 * 2, 148 * 4, 148 * 8, 148 * 4)),
    (Strategy(1, 2, "zero3"), True, (0, 148 * 4, 148 * 8, 148 * 4)),
])
def test_states_bytes_by_hand(tiny, strategy, mixed, expect):
    gm, i = tiny
    cm = CostModel(gm, CLUSTER, dtype="bf16" if mixed else "fp32", mixed_precision=mixed)
    st = cm.states_bytes(i, strategy)
    expect = expect if mixed else (*expect, 0)
    assert (st.params, st.grads, st.optimizer, st.masters) == expect
    c = cm.layer_cost(i, strategy, 2 * strategy.dp)
    assert (c.param_bytes, c.grad_bytes, c.optimizer_bytes, c.master_bytes) == expect


def test_states_bytes_sgd():
    st = states_bytes(10, 2, Strategy(2, 1), itemsize=4, optimizer="sgd")
    assert (st.params, st.grads, st.optimizer) == (28, 28, 0)


def test_states_bytes_follow_the_runtime_flat_buffer_padding():
    # 7 elements over dp=4: the flat buffer is padded to 8, each rank's shard holds 2 (ZeRO-2: a
    # copy); the optimizer keeps one state per parameter, without padding: 7 elements under DP, the
    # rows a rank holds under ZeRO (2, 2, 2, 1)
    for sdp, expect in (("none", (32, 32, 56)), ("zero2", (40, 8, 16)), ("zero3", (8, 8, 16))):
        st = states_bytes(0, 7, Strategy(1, 4, sdp), itemsize=4)
        assert (st.params, st.grads, st.optimizer) == expect, sdp
    assert states_bytes(0, 7, Strategy(1, 4, "zero3"), itemsize=4, dp_index=3).optimizer == 8


def test_frozen_parameters_hold_their_weights_only():
    # 8 trainable + 6 frozen elements over dp=2 (Adam): frozen weights whole under DP and ZeRO-2,
    # sharded under ZeRO-3; no gradient, no optimizer state; mixed: bf16 copy + fp32 masters
    kw = dict(itemsize=4, shapes=[(8,)], frozen_shapes=[(6,)])
    assert states_bytes(0, 0, Strategy(1, 2), **kw) == StatesBytes(4 * (8 + 6), 4 * 8, 4 * 16)
    assert states_bytes(0, 0, Strategy(1, 2, "zero2"), **kw) == StatesBytes(4 * (8 + 4 + 6), 4 * 4, 4 * 8)
    assert states_bytes(0, 0, Strategy(1, 2, "zero3"), **kw) == StatesBytes(4 * (4 + 3), 4 * 4, 4 * 8)
    mixed = states_bytes(0, 0, Strategy(1, 2), **dict(kw, itemsize=2), mixed_precision=True)
    assert mixed == StatesBytes(2 * (8 + 6), 4 * 8, 4 * 16, masters=4 * (8 + 6))


def test_tiny_scaling_rules(tiny):
    gm, i = tiny
    cm = CostModel(gm, CLUSTER, bucket_bytes=0)
    # per sample: fc1 2*3*8*16 + fc2 2*3*16*8 = 1536 forward FLOPs; backward twice that
    m = cm.measure(i)
    assert m.fwd_flops_sharded(1) == 1536 and m.fwd_flops_rep(1) == 0 and m.bwd_flops(1) == 3072
    # saved per sample (fp32): ln input 24 + stats 6 (replicated); ln out 24, saved by the
    # column-parallel fc1 (whole sequence under SP: the runtime gathers it first);
    # relu out 48, saved by relu and by fc2 (one storage, sharded)
    assert (m.saved_rep_elems(1), m.saved_gathered_elems(1), m.saved_sharded_elems(1)) == (30, 24, 48)
    one = cm.layer_cost(i, Strategy(1, 1), 4)
    tp2 = cm.layer_cost(i, Strategy(2, 1), 4)
    sp2 = cm.layer_cost(i, Strategy(2, 1, sp=True), 4)
    ck = cm.layer_cost(i, Strategy(1, 1, ckpt=True), 4)
    assert one.activation_bytes == 4 * (54 + 48) * 4
    assert tp2.activation_bytes == 4 * (54 + 24) * 4
    assert sp2.activation_bytes == 4 * (15 + 24 + 24) * 4
    # the backward's working set (its intermediate gradients, .backward_peak) is a transient of any
    # strategy; checkpointing adds the recomputed activations to it
    assert 0 < one.transient_bytes < one.activation_bytes
    assert ck.activation_bytes == 4 * 24 * 4 and ck.transient_bytes == one.activation_bytes + one.transient_bytes
    assert ck.bwd_s == pytest.approx(one.bwd_s + one.fwd_s)
    # at these widths the matmuls fill one 128-wide tile whatever TP splits: TP saves little time
    assert one.fwd_s / 2 < tp2.fwd_s < one.fwd_s
    # without tiles and memory traffic, time is FLOPs: TP halves it
    flat = CostModel(gm, dataclasses.replace(CLUSTER, gemm_tile=1, gemm_wave=0, copy_s_per_byte=0.0), bucket_bytes=0)
    assert flat.layer_cost(i, Strategy(2, 1), 4).fwd_s == pytest.approx(flat.layer_cost(i, Strategy(1, 1), 4).fwd_s / 2)
    # per-op launches (the layer's op count) do not shrink under TP; the recompute launches again,
    # and every op pays checkpointing's hooks
    ops = cm.op_counts[cm.layers[i].signature]
    launch = ops * (CLUSTER.op_launch_s + CLUSTER.op_launch_bwd_s)
    # every pass flattens the layer's gradients into one buffer: fc1 8x16+16, fc2 16x8+8 (split
    # by TP), the LayerNorm's 8+8 (replicated), fp32
    copy = CLUSTER.copy_s_per_byte * 4
    assert CLUSTER.copy_s_per_byte > 0
    # (the host's share, launches and bookkeeping, hides behind the layer's device seconds)
    def host(c, extra=0.0):
        return CLUSTER.layer_overhead_s + launch + extra - c.fwd_s - c.bwd_s
    assert ops > 0 and one.overhead_s == pytest.approx(host(one) + copy * (280 + 16))
    assert tp2.overhead_s == pytest.approx(host(tp2) + copy * (140 + 16))
    assert CLUSTER.checkpoint_op_s > 0
    assert ck.overhead_s == pytest.approx(host(ck, ops * (CLUSTER.op_launch_s + CLUSTER.checkpoint_op_s))
                                          + copy * (280 + 16))
    # TP: one all-reduce forward (fc2 out) + one backward (ln out), 3*8 fp32 per sample each, each
    # at a site of the runtime's (tp_ops): an autograd Function and a copy of the message
    site = CLUSTER.op_launch_s + CLUSTER.op_launch_bwd_s
    ar = CLUSTER.collective_time("all_reduce", 4 * 24 * 4, [0, 1]) + 384 * CLUSTER.copy_s_per_byte + site
    assert tp2.tp_comm_s == pytest.approx(2 * ar) and one.tp_comm_s == 0
    # SP: an all-gather and a reduce-scatter, each copying the chunk (192 B) and the whole (384 B)
    ag_rs = 2 * (CLUSTER.collective_time("all_gather", 384, [0, 1])
                 + CLUSTER.collective_time("reduce_scatter", 384, [0, 1]) + 2 * (384 + 192) * CLUSTER.copy_s_per_byte
                 + 2 * site)
    assert sp2.tp_comm_s == pytest.approx(ag_rs)
    # the ranks' drift: each TP collective waits c * (sqrt(S) - sqrt(S0)) after S seconds of the
    # layer's compute (one forward and one backward collective here: S = fwd_s, bwd_s)
    drifting = dataclasses.replace(CLUSTER, sync_drift_sqrt_s=0.01, sync_stretch_s=1e-9)
    assert drifting.sync_wait(4e-4) == pytest.approx(0.01 * (2e-2 - math.sqrt(1e-9)))
    assert drifting.sync_wait(1e-10) == 0.0 and CLUSTER.sync_wait(1.0) == 0.0
    tp2d = CostModel(gm, drifting, bucket_bytes=0).layer_cost(i, Strategy(2, 1), 4)
    assert tp2d.tp_comm_s == pytest.approx(tp2.tp_comm_s + drifting.sync_wait(tp2.fwd_s)
                                           + drifting.sync_wait(tp2.bwd_s))
    assert CostModel(gm, drifting, bucket_bytes=0).layer_cost(i, Strategy(1, 1), 4).tp_comm_s == 0
    dp = cm.layer_cost(i, Strategy(1, 4), 4)
    assert dp.grad_sync_s == pytest.approx(CLUSTER.collective_time("all_reduce", 296 * 4, [0, 1, 2, 3]))
    z3 = cm.layer_cost(i, Strategy(2, 2, "zero3"), 4)
    assert z3.zero3_gather_s == pytest.approx(2 * CLUSTER.collective_time("all_gather", 160 * 4, [0, 2]))
    # own buffer, the prefetched neighbour (buffer + [dp, S] staging), the gradient
    assert z3.transient_bytes == 4 * 160 * 4 + cm.backward_excess_bytes(cm.measure(i), 4 / 2, Strategy(2, 2, "zero3"))
    # each neighbour at its own size: before the first block no layer holds parameters, so its
    # peak is its forward's (its buffer and the next block's, prefetched with its staging)
    first = [r.index for r in gfx.layers(cm.gm) if r.kind == "block"][0]
    assert sum(cm._owned_params(first - 1).values()) == 0
    z3_first = cm.layer_cost(first, Strategy(2, 2, "zero3"), 4)
    assert z3_first.transient_bytes == 3 * 160 * 4 + cm.backward_excess_bytes(cm.measure(first), 4 / 2,
                                                                              Strategy(2, 2, "zero3"))
    # ZeRO-2/3: a reduce-scatter per micro-batch; ZeRO-2's updated shards all-gathered beside the next forward
    z2 = cm.layer_cost(i, Strategy(2, 2, "zero2"), 4)
    rs = CLUSTER.collective_time("reduce_scatter", 160 * 4, [0, 2])
    assert z2.reduce_scatter_s == pytest.approx(rs) == z3.reduce_scatter_s and dp.reduce_scatter_s == 0
    assert z2.grad_sync_s == z3.grad_sync_s == 0
    assert z2.regather_s == pytest.approx(CLUSTER.collective_time("all_gather", 160 * 4, [0, 2]))
    assert z3.regather_s == dp.regather_s == 0
    first = cm.layer_cost(0, Strategy(2, 2, "zero2"), 4)   # nothing before it to hide its re-gather
    assert first.regather_s == 0 and first.exposed_sync_s == first.grad_sync_s > 0
    # symbolic form agrees with direct evaluation
    f = cm.lambdified(i, Strategy(2, 1))
    assert f["activation_bytes"](4) == pytest.approx(tp2.activation_bytes)
    assert f["tp_comm_s"](4) == pytest.approx(tp2.tp_comm_s)


def test_reshard(tiny):
    gm, i = tiny
    cm = CostModel(gm, CLUSTER)
    a, b = Strategy(4, 2), Strategy(2, 4)
    assert cm.reshard_time(i, a, a, 8) == 0
    nbytes = cm.boundary_bytes(i, 8)
    assert nbytes == 8 * 24 * 4
    # tp2·dp4 -> tp4·dp2: forward all-gathers samples over 2 ranks; backward slices (free)
    expect = CLUSTER.collective_time("all_gather", nbytes / 2, [0, 2])
    assert cm.reshard_time(i, b, a, 8) == pytest.approx(expect)
    assert cm.reshard_time(i, a, b, 8) == pytest.approx(expect)


def test_attention_flops_counted():
    model, args = gfx.models.build("gpt-tiny", device="meta", layers=1)
    gm = gfx.capture(model, args, method="fx")
    rec = [r for r in gfx.layers(gm) if r.kind == "block"][0]
    m = CostModel(gm, CLUSTER).measure(rec.index)
    # without the TP analysis every FLOP counts as replicated
    replicated = measure_layer(extract_layer(gm, rec))
    assert replicated.fwd_flops_sharded(1) == 0 and replicated.fwd_flops_rep(1) == m.fwd_flops_sharded(1) + m.fwd_flops_rep(1)
    b, s, h, heads, ffn = 1, 32, 64, 4, 256
    linear = 2 * b * s * h * (4 * h + 2 * ffn)
    assert m.fwd_flops_sharded(1) == linear
    assert m.bwd_flops(1) == 2 * linear
    # the attention as the fused causal kernel runs it: the s (s + 1) / 2 entries on and below the
    # diagonal, 2 (d + d) FLOPs each forward, 2 (3 d + 2 d) backward (the scores recomputed)
    d = h // heads
    entries = b * heads * s * (s + 1) / 2
    assert m.kernels == ("efficient",)      # fp32 on CUDA: the memory-efficient kernel
    assert m.attn_fwd_flops(1) == 4 * d * entries
    assert m.attn_bwd_flops(1) == 10 * d * entries




class ShardedGPTBlock(nn.Module):
    """gpt-tiny's block as one rank of tp=2 holds it: half the heads and half the FFN."""

    def __init__(self, hidden=64, heads=4, ffn=256, tp=2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads // tp, head_dim=hidden // heads)
        self.mlp = MLP(hidden, ffn // tp, act="gelu_tanh")

    def forward(self, x):
        x = x + self.attn(self.ln1(x), is_causal=True)
        return x + self.mlp(self.ln2(x))


@pytest.mark.parametrize("name, kw", [
    ("gpt-tiny", {}),
    ("bert-huge-32", dict(layers=2, hidden=64, heads=4, seq_len=32, batch=2)),
])
def test_saved_activations_match_real_run(name, kw):
    model, args = gfx.models.build(name, device="cpu", **kw)
    gm = gfx.capture(model, args, method="dynamo")
    cm = CostModel(gm, CLUSTER)
    block = model.blocks[0]
    x = torch.randn(3, 32, 64, requires_grad=True)
    extra = {"is_causal": True} if name == "gpt-tiny" else {}
    real = saved_bytes(lambda: block(x, **extra), list(block.parameters()))
    predicted = cm.activation_bytes(1, Strategy(1, 1), 3)
    assert abs(predicted - real) <= 0.05 * real
    if name == "gpt-tiny":
        shard = ShardedGPTBlock()
        real2 = saved_bytes(lambda: shard(x), list(shard.parameters()))
        predicted2 = cm.activation_bytes(1, Strategy(2, 1), 3)
        assert abs(predicted2 - real2) <= 0.05 * real2


def test_overhead_terms(tiny):
    """Per-layer / per-micro-batch framework overhead and the optimizer step (cluster fields)."""
    gm, i = tiny
    c = Cluster(memory_bytes="16GiB", peak_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12},
                intra_bandwidth=1e9, intra_latency=0.0, devices_per_node=4, layer_overhead_s=1e-4,
                microbatch_overhead_s=1e-3, optimizer_s_per_byte=1e-9, optimizer_overhead_s=1e-5,
                collective_latency_s=1e-4)
    cm = CostModel(gm, c, mode="analytic", bucket_bytes=0)
    dp = cm.layer_cost(i, Strategy(1, 4), 4)
    z3 = cm.layer_cost(i, Strategy(1, 4, "zero3"), 4)
    first = cm.layer_cost(0, Strategy(1, 4), 4)
    # a GPU's host runs ahead of the device: the layer's device seconds hide as much overhead
    device = dp.fwd_s + dp.bwd_s
    assert 0 < device < 1e-6 and dp.overhead_s == pytest.approx(1e-4 - device)
    assert first.overhead_s == pytest.approx(1.1e-3 - first.fwd_s - first.bwd_s)
    # the user's optimizer steps one tensor per parameter (6: two norms' and two linears' weights and biases)
    assert dp.optimizer_s == pytest.approx(296 * 4 * 1e-9 + 6 * 1e-5)      # whole layer
    assert z3.optimizer_s == pytest.approx(74 * 4 * 1e-9 + 6 * 1e-5)       # this rank's shard
    # one call latency per collective, on top of the ring
    assert dp.grad_sync_s == pytest.approx(2 * 3 / 4 * 296 * 4 / 1e9 + 1e-4)
    bucketed = CostModel(gm, c, mode="analytic", bucket_bytes=296 * 4 * 2).layer_cost(i, Strategy(1, 4), 4)
    assert bucketed.grad_sync_s == pytest.approx(dp.grad_sync_s - 0.5e-4)  # half a bucket: half a call
    assert dp.exposed_sync_s == 0 and bucketed.exposed_sync_s == pytest.approx(bucketed.grad_sync_s)  # one bucket
