"""Context parallelism in the cost model and the search: the attention exchanges (ring vs Ulysses
bytes, intra- vs inter-node), boundary gathers, activations at fractional samples per rank, the
strategy space and its rules, constraints, the command line, and the meta-device acceptance
(Llama-3-8B at 128k / 256k tokens on 8 H100s: context parallelism wins)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import galvatron_fx as gfx
from galvatron_fx.cost.context import (
    GRAD_ITEMSIZE,
    RING_TENSORS,
    LayerAttention,
    attention_backward_flops,
    attention_flops,
    core_attention_flops,
    cp_attention_ops,
    cp_attention_time,
    cp_compute_time,
    cp_group,
    cp_messages,
    cp_transient_bytes,
    ring_shift_time,
)
from galvatron_fx.cost.ring import (
    RING_BLOCK_OPS,
    RING_CALL_OPS,
    RING_CAST_OPS,
    RING_MASK_OPS,
    RING_MERGE_WRITES,
    RING_ROWS_OPS,
    RING_SHIFT_OPS,
    ring_blocks,
    ring_work,
)
from galvatron_fx.errors import ConfigError
from galvatron_fx.planner import CP_MIN_SEQ, cost_model_for, cp_degrees
from galvatron_fx.solver.strategy import Strategy, rejecting_rules, strategy_space

S, HEADS, KV, D = 1024, 32, 8, 128
ATT = LayerAttention(calls=1, heads=HEADS, kv_heads=KV, head_dim=D, v_head_dim=D, seq=S, kv_seq=S)


@pytest.fixture(scope="module")
def tiny():
    """gpt-tiny (2 blocks, 4 heads, sequence 32) and its bf16 cost model on 4 A100s."""
    model, args = gfx.models.build("gpt-tiny", device="meta", layers=2, hidden=64, heads=4, seq_len=32, vocab=128,
                                   batch=8)
    gm = gfx.capture(model, args, method="fx")
    cluster = gfx.Cluster.preset("4xA100-80GB")
    return gm, cluster, cost_model_for(gm, cluster, precision="bf16-mixed")


# ------------------------------------------------------------------------------- exchanges
def test_ring_sends_key_value_shards_cp_minus_one_times():
    n, s = 0.25, Strategy(2, 8, cp=4)       # a quarter sample's tokens per rank: 256 positions
    shard = n * S * KV / 2 * D              # [b, S/cp, kv_heads/tp, d] with b = n * cp
    msgs = cp_messages(ATT, n, s, 2)
    assert msgs["fwd"] == [2 * shard * 2] * 3                        # k and v, bf16, cp - 1 shifts
    # backward: k and v again (cp - 1), then after each step the fp32 gradients (cp: back home)
    assert msgs["bwd"] == [2 * shard * 2] * 3 + [2 * shard * GRAD_ITEMSIZE] * 4


def test_ulysses_moves_query_key_value_and_output_each_way():
    n, s = 0.25, Strategy(1, 8, cp=4, cp_kind="ulysses")
    q, kv = n * S * HEADS * D, n * S * KV * D
    msgs = cp_messages(ATT, n, s, 2)
    assert msgs["fwd"] == [2 * q, 2 * kv, 2 * kv, 2 * q] and msgs["bwd"] == msgs["fwd"]
    # 8 key / value heads over tp 2 leave 4, which cp 8 cannot split: repeated to the query heads
    rep = cp_messages(ATT, n, Strategy(2, 8, cp=8, cp_kind="ulysses"), 2)["fwd"]
    assert rep[1] == rep[0] == 2 * n * S * HEADS / 2 * D
    # ring's total bytes grow with cp, Ulysses' do not
    ring = [sum(cp_messages(ATT, 1 / c, Strategy(1, 8, cp=c), 2)["fwd"]) for c in (2, 4, 8)]
    uly = [sum(cp_messages(ATT, 1 / c, Strategy(1, 8, cp=c, cp_kind="ulysses"), 2)["fwd"]) for c in (2, 4, 8)]
    assert ring[0] < ring[1] < ring[2] and uly[0] > uly[1] > uly[2]


def test_no_exchange_without_attention_or_cp():
    assert cp_messages(ATT, 1.0, Strategy(1, 8), 2) == {"fwd": [], "bwd": []}
    none = LayerAttention(0, 0, 0, 0, 0, 0, 0)
    assert cp_attention_time(gfx.Cluster.preset("8xH100-80GB"), none, 1.0, Strategy(1, 8, cp=8), 2) == 0.0


def test_exchanges_pay_the_cp_groups_link():
    cluster = gfx.Cluster.preset("2x8xH100-80GB")
    inside, across = Strategy(4, 4, cp=2), Strategy(8, 2, cp=2)   # CP ranks 4 apart (one node) / 8 apart
    assert cp_group(inside) == [0, 4] and cp_group(across) == [0, 8]
    assert cluster.node_of(8) == 1
    for kind in ("ring", "ulysses"):   # NVLink vs one NIC's share: bandwidth-bound messages
        a = cp_attention_time(cluster, ATT, 32.0, Strategy(4, 4, cp=2, cp_kind=kind), 2)
        b = cp_attention_time(cluster, ATT, 32.0, Strategy(8, 2, cp=2, cp_kind=kind), 2) * 2   # per-tp bytes halve
        assert b > 5 * a, kind
    nbytes = 1e8   # a shift on an unmeasured link: the slowest hop's one-way time (full duplex)
    assert ring_shift_time(cluster, nbytes, [0, 8]) == pytest.approx(cluster.p2p_time(nbytes, 0, 8))
    assert ring_shift_time(cluster, nbytes, [0, 4, 8]) == pytest.approx(cluster.p2p_time(nbytes, 0, 8))
    assert ring_shift_time(cluster, nbytes, [0]) == 0.0


def test_ring_shift_is_two_way_as_the_cluster_measures_it():
    """Every rank sends and receives at once: the two-rank all-to-all fit (both directions of the
    pair) prices a shift, not the one-way point-to-point fit."""
    fits = {"all_to_all": {"2": {"bandwidth": 1e9, "latency": 1e-4}}, "p2p": {"2": {"bandwidth": 4e9, "latency": 1e-5}}}
    cluster = gfx.Cluster(memory_bytes="16GiB", peak_flops={"fp32": 1e11, "bf16": 1e11, "fp16": 1e11},
                          intra_bandwidth=1e10, intra_latency=1e-6, devices_per_node=2, fits=fits,
                          collective_latency_s=3e-5)
    nbytes = 256 * 1024
    two_way = nbytes / 1e9 + 1e-4 + 2 * 3e-5
    assert ring_shift_time(cluster, nbytes, [0, 1], calls=RING_TENSORS) == pytest.approx(two_way)
    assert ring_shift_time(cluster, nbytes, [0, 1]) > cluster.p2p_time(nbytes, 0, 1)
    s = Strategy(1, 2, cp=2)
    msgs = cp_messages(ATT, 1.0, s, 4)
    assert cp_attention_time(cluster, ATT, 1.0, s, 4) == pytest.approx(
        sum(ring_shift_time(cluster, b, [0, 1], RING_TENSORS) for b in msgs["fwd"] + msgs["bwd"]))


def test_checkpointing_repeats_the_forward_exchanges():
    cluster = gfx.Cluster.preset("8xH100-80GB")
    for kind in ("ring", "ulysses"):
        s = Strategy(1, 8, cp=8, cp_kind=kind)
        plain = cp_attention_time(cluster, ATT, 1 / 8, s, 2)
        ckpt = cp_attention_time(cluster, ATT, 1 / 8, Strategy(1, 8, ckpt=True, cp=8, cp_kind=kind), 2)
        group = cp_group(s)
        fwd = sum(ring_shift_time(cluster, x, group, RING_TENSORS) if kind == "ring" else
                  cluster.collective_time("all_to_all", x, group) for x in cp_messages(ATT, 1 / 8, s, 2)["fwd"])
        assert plain < ckpt < 2 * plain
        assert ckpt - plain == pytest.approx(fwd)


# ------------------------------------------------------------------------- attention compute
CAUSAL = dataclasses.replace(ATT, causal=True)


def test_ring_blocks_follow_the_runtime_plan():
    from galvatron_fx.runtime.context_parallel import ring_block_pairs
    from galvatron_fx.runtime.ring_attention import TILE_ROWS

    for cp in (2, 4, 8):
        c, s = S // (2 * cp), S // cp   # zig-zag chunk, shard
        blocks = ring_blocks(S, cp, True)
        # the own shard with the kernel's is_causal, then s x c (earlier sources) or c x s (later)
        assert len(blocks) == cp and blocks[0] == (s, s, True)
        assert all((r, k) in ((s, c), (c, s)) and not z for r, k, z in blocks[1:])
        # the kernel's entries: the causal square's lower half, the rest whole: the 2 cp + 1 chunk pairs
        entries = s * (s + 1) / 2 + (cp - 1) * 2 * c * c
        assert entries == pytest.approx(ring_block_pairs(S, cp, 0, True) * c * c - c * c + s / 2)
        assert ring_blocks(S, cp, False) == ((s, s, False),) * cp    # the whole shard per source
    # an explicit mask: tiles of TILE_ROWS query rows of one chunk against each key chunk
    long = 8 * TILE_ROWS
    tiles = ring_blocks(long, 2, True, masked=True)
    assert max(r for r, _, _ in tiles) == TILE_ROWS and max(k for _, k, _ in tiles) == long // 4
    assert sum(r * (r + 1) / 2 if z else r * k for r, k, z in tiles) == pytest.approx(
        sum(r * (r + 1) / 2 if z else r * k for r, k, z in ring_blocks(long, 2, True)), rel=0.01)


def test_ring_work_is_fused_kernel_blocks():
    s, n = Strategy(1, 8, cp=4), 0.5
    w = ring_work(CAUSAL, n, s, 2)
    # the blocks' kernel FLOPs: the causal kernel's at cp = 1 (half the square), per (sample, head)
    core = core_attention_flops(CAUSAL, n, 1)
    assert core == attention_flops(CAUSAL, n, 1) / 2
    assert sum(f for f, _ in w.blocks) == pytest.approx(core, rel=1e-3)
    assert attention_backward_flops(CAUSAL, 1.0) == 2.5                  # FlashAttention-2's count
    bh, rows = n * 4 * HEADS, S // 4
    merge = sum(bh * r * (RING_MERGE_WRITES[0] * D + RING_MERGE_WRITES[1]) * 4 for r, _, _ in ring_blocks(S, 4, True))
    assert merge < w.copy_bytes["fwd"] < merge + bh * rows * (D + 1) * 4 + bh * rows * D * 2 + 1
    h100 = gfx.Cluster.preset("8xH100-80GB")
    fwd, bwd = cp_compute_time(h100, CAUSAL, n, s, 2, "bf16")

    def kernel(f, keys, backward):
        f = attention_backward_flops(CAUSAL, f) if backward else f
        return h100.attention_time(f, "bf16", backward=backward, seq=keys, head_dim=D)
    # each kernel call at its own key count in the compute dtype, the merge's bytes, less the cores
    assert fwd == pytest.approx(sum(kernel(f, k, False) for f, k in w.blocks) + w.copy_bytes["fwd"] * h100.copy_s_per_byte
                                - kernel(core, S, False))
    assert bwd == pytest.approx(sum(kernel(f, k, True) for f, k in w.blocks) + w.copy_bytes["bwd"] * h100.copy_s_per_byte
                                - kernel(core, S, True))
    # no eager fp32 score blocks any more: at a long context a few percent of the attention itself
    long = dataclasses.replace(CAUSAL, seq=65536, kv_seq=65536)
    lf, lb = cp_compute_time(h100, long, n, s, 2, "bf16")
    lcore = core_attention_flops(long, n, 1)
    assert 0 < lf < 0.1 * kernel(lcore, 65536, False) and 0 < lb < 0.1 * kernel(lcore, 65536, True)
    uly = cp_compute_time(h100, CAUSAL, n, Strategy(1, 8, cp=4, cp_kind="ulysses"), 2, "bf16")
    assert 0 < uly[0] and 0 < uly[1]
    # launches: per block (backward: the blocks not spanning all rows make their LSE contiguous),
    # per shift, per call (bf16: the casts)
    partial = sum(r < rows for r, _, _ in ring_blocks(S, 4, True))
    assert cp_attention_ops(CAUSAL, s, 2) == (
        4 * RING_BLOCK_OPS["fwd"] + 3 * RING_SHIFT_OPS + RING_CALL_OPS["fwd"] + RING_CAST_OPS["fwd"],
        4 * RING_BLOCK_OPS["bwd"] + partial * RING_ROWS_OPS + 7 * RING_SHIFT_OPS + RING_CALL_OPS["bwd"]
        + RING_CAST_OPS["bwd"])
    masked = dataclasses.replace(CAUSAL, masked=True)
    assert cp_attention_ops(masked, s, 2)[0] - cp_attention_ops(CAUSAL, s, 2)[0] >= 4 * RING_MASK_OPS["fwd"]
    # memory: the shifts' buffers and the accumulators / one block's outputs: linear in S / cp
    kv = cp_messages(CAUSAL, n, s, 2)
    assert cp_transient_bytes(CAUSAL, n, s, 2) == pytest.approx(2 * (kv["fwd"][0] + max(kv["bwd"]))
                                                                + max(w.buffers.values()))
    assert max(w.buffers.values()) < bh * rows * (3 * D + 2) * 4                    # no rows x keys term
    big = ring_work(dataclasses.replace(CAUSAL, seq=4 * S, kv_seq=4 * S), n, s, 2)
    assert max(big.buffers.values()) == pytest.approx(4 * max(w.buffers.values()))


def test_ulysses_copies_around_its_all_to_alls():
    cluster = gfx.Cluster.preset("8xH100-80GB")
    s, n = Strategy(1, 8, cp=4, cp_kind="ulysses"), 0.5
    q, k, v, out = cp_messages(ATT, n, s, 2)["fwd"]
    fwd, bwd = cp_compute_time(cluster, ATT, n, s, 2, "bf16")
    assert fwd == pytest.approx((2 * (q + k + v) + 3 * out) * cluster.copy_s_per_byte)
    assert bwd == pytest.approx((3 * (q + k + v) + 2 * out) * cluster.copy_s_per_byte)
    f, b = cp_attention_ops(ATT, s)
    assert f == 3 * 3 + 2 + 2 * 4 + 4 and b == 3 * (2 + 2 * 4) + 3 + 4


def test_overlap_option_hides_the_ring_behind_attention(tiny):
    gm, cluster, _cm = tiny
    cm = cost_model_for(gm, cluster, precision="bf16-mixed", cp_overlap=True)
    s = Strategy(1, 4, cp=4)
    plain = cost_model_for(gm, cluster, precision="bf16-mixed").cp_terms(1, 1.0, s)[0]
    assert 0.0 <= cm.cp_terms(1, 1.0, s)[0] <= plain
    with pytest.raises(ConfigError):
        cost_model_for(gm, cluster, precision="bf16-mixed", cp_overlap="yes")


# ------------------------------------------------------------------------------ layer costs
def test_attention_found_in_the_graph(tiny):
    _gm, _cluster, cm = tiny
    att = [cm.attention(i) for i in range(len(cm.layers))]
    assert [a.calls for a in att] == [0, 1, 1, 0]
    assert (att[1].heads, att[1].kv_heads, att[1].head_dim, att[1].seq) == (4, 4, 16, 32)
    assert att[1].causal and not att[1].masked          # is_causal, no explicit mask
    assert cm.sequence_length() == 32
    # the post layer shifts labels along the sequence: the context-parallel pass refuses it
    assert cm.cp_refuses(3, 2) and not cm.cp_refuses(1, 2) and not cm.cp_refuses(0, 4)
    assert "Ulysses" in cm.cp_refuses(1, 4, "ulysses", 2) and not cm.cp_refuses(1, 4, "ulysses", 1)
    assert "does not split" in cm.cp_refuses(1, 3)


def test_grouped_query_heads_as_sdpa_receives_them():
    from tests.hf_meta import meta_llama

    gm = meta_llama(32, batch=2, method="dynamo", vocab_size=128, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2)
    cm = cost_model_for(gm, gfx.Cluster.preset("8xH100-80GB"))
    att = cm.attention(1)
    # without a mask transformers' SDPA path hands SDPA the 2 key / value heads with enable_gqa (as
    # eager does: capture keeps its mask decisions, galvatron_fx/hf_capture.py): the ring ships 2
    assert (att.calls, att.heads, att.kv_heads, att.seq) == (1, 8, 2, 32)


def test_cp_layer_cost_is_cp1_at_the_same_tokens_plus_exchanges(tiny):
    _gm, _cluster, cm = tiny
    b = 4
    base, cp = Strategy(1, 4), Strategy(1, 4, cp=4)
    c0, c1 = cm.layer_cost(1, base, b), cm.layer_cost(1, cp, b)
    # compute: cp = 1's, the ring's kernel calls and merge in place of the attention cores
    extra = cm.cp_compute(1, b / 4, cp)
    assert (c1.fwd_s, c1.bwd_s) == pytest.approx((c0.fwd_s + extra[0], c0.bwd_s + extra[1]))
    uly = Strategy(1, 4, cp=4, cp_kind="ulysses")
    assert cm.layer_cost(1, uly, b).fwd_s == pytest.approx(c0.fwd_s + cm.cp_compute(1, b / 4, uly)[0])
    # activations: the same per sample, the part shared by the batch (sequence-long) split over cp
    m = cm.measure(1)
    shared = (m.saved_sharded_elems.c + m.saved_rep_elems.c + m.saved_gathered_elems.c) * 2 + m.saved_other_bytes.c
    assert c1.activation_bytes == pytest.approx(c0.activation_bytes - shared * 3 / 4)
    assert c1.states_bytes == c0.states_bytes and c1.grad_sync_s == c0.grad_sync_s   # states: as DP
    assert c1.tp_comm_s - c0.tp_comm_s == pytest.approx(cm.cp_terms(1, b / 4, cp)[0])
    assert c1.tp_comm_s > c0.tp_comm_s and c1.overhead_s > c0.overhead_s and c1.transient_bytes > c0.transient_bytes
    # a layer without attention pays nothing inside (only its boundaries)
    assert cm.layer_cost(0, cp, b).tp_comm_s == cm.layer_cost(0, base, b).tp_comm_s


def test_fractional_samples_per_rank_scale_activations(tiny):
    """One sample over 4 ranks (cp 4): a quarter sample's activations each, which cp = 1 cannot run."""
    gm, cluster, cm = tiny
    quarter = cm.layer_cost(1, Strategy(1, 4, cp=4), 1)
    whole = cm.layer_cost(1, Strategy(1, 4), 4)          # one sample per rank
    assert quarter.activation_bytes == pytest.approx(whole.activation_bytes / 4)
    assert cm.activation_bytes(1, Strategy(1, 4, cp=4), 1) == quarter.activation_bytes
    # time: a quarter of the work, priced as FLOPs (these widths fill a fraction of one GEMM tile,
    # which a quarter sample fills no less)
    flat = cost_model_for(gm, dataclasses.replace(cluster, gemm_tile=1, gemm_wave=0, copy_s_per_byte=0.0), precision="bf16-mixed")
    quarter, whole = flat.layer_cost(1, Strategy(1, 4, cp=4), 1), flat.layer_cost(1, Strategy(1, 4), 4)
    own = flat.cp_compute(1, 0.25, Strategy(1, 4, cp=4))[0]   # the ring's blocks beyond the cores
    assert quarter.fwd_s - own == pytest.approx(whole.fwd_s / 4, rel=0.02)


# ------------------------------------------------------------------------------- boundaries
def test_boundary_gathers_and_slices(tiny):
    _gm, cluster, cm = tiny
    b = 4
    nbytes = cm.boundary_bytes(1, b)
    cp, plain = Strategy(1, 4, cp=2), Strategy(1, 4)
    ag = cluster.collective_time("all_gather", nbytes * 2 / 4, [0, 1])
    # out of a cp layer into cp = 1 at the same (tp, dp): the sequence all-gathered over the CP group
    # in forward, the batch slices' gradient gathered back in backward (and the other way into it)
    assert cm.reshard_time(1, cp, plain, b) == pytest.approx(2 * ag)
    assert cm.reshard_time(1, plain, cp, b) == pytest.approx(2 * ag)
    # the same (tp, dp, cp): nothing moves, whatever the attention kind
    assert cm.reshard_time(1, cp, Strategy(1, 4, cp=2, cp_kind="ulysses"), b) == 0.0
    assert cm.reshard_time(1, cp, Strategy(1, 4, "zero3", ckpt=True, cp=2), b) == 0.0
    # from a layout already holding a CP group's samples (tp 4 = tp * cp): a slice forward, the
    # gradient's sequence gathered backward
    whole = Strategy(4, 1)
    into = cm.reshard_time(1, whole, Strategy(1, 4, cp=4), b)
    assert into == pytest.approx(cluster.collective_time("all_gather", nbytes, [0, 1, 2, 3]))


# ---------------------------------------------------------------------------------- space
def test_strategy_space_with_cp():
    assert len(strategy_space(8)) == 81                            # default: no context parallelism
    assert len(strategy_space(8, cp=(2, 4, 8))) == 261             # CPU offload doubles the ZeRO ones
    space = strategy_space(8, cp=(2, 4, 8), more={"offload": ("none",)})
    assert len(space) == 159 and len(space) == len(set(space))   # 36 of them cp > 1 with sp (no selective)
    cps = [s for s in space if s.cp > 1]
    assert all(s.ep == 1 and s.dp % s.cp == 0 for s in cps) and sum(s.sp for s in cps) == 36
    assert {s.cp_kind for s in space if s.cp == 1} == {"ring"}
    assert Strategy(1, 8, cp=8, cp_kind="ulysses") in space
    assert [s for s in strategy_space(8, cp=(2,), cp_kinds=("ulysses",)) if s.cp > 1][0].cp_kind == "ulysses"
    assert Strategy(2, 4, cp=4, cp_kind="ulysses") not in strategy_space(8, cp=(4,), heads=4)
    # deterministic order: cp ascending, then kinds in CP_KINDS order, after ckpt
    tp1 = [s for s in space if s.tp == 1 and s.sdp == "none" and not s.ckpt]
    assert [(s.cp, s.cp_kind) for s in tp1] == [(1, "ring"), (2, "ring"), (2, "ulysses"), (4, "ring"),
                                                (4, "ulysses"), (8, "ring"), (8, "ulysses")]
    with pytest.raises(ConfigError):
        strategy_space(8, cp=(2,), cp_kinds=("zigzag",))


@pytest.mark.parametrize("strategy, kwargs, rule", [
    (Strategy(1, 8, cp=2), {}, "cp_degrees"),
    (Strategy(1, 8, cp=2, cp_kind="ulysses"), {"cp": (2,), "cp_kinds": ("ring",)}, "cp_degrees"),
    (Strategy(1, 8, cp_kind="ulysses"), {}, "cp_kind_needs_cp"),
    (Strategy(1, 8, ep=2, cp=2), {"cp": (2,), "ep": (2,)}, "cp_without_ep"),
    (Strategy(2, 4, cp=4, cp_kind="ulysses"), {"cp": (4,), "heads": 4}, "ulysses_divides_heads"),
])
def test_each_cp_rule_prunes(strategy, kwargs, rule):
    assert rejecting_rules(strategy, **kwargs) == [rule]


def test_default_search_offers_cp_only_for_long_sequences():
    class Stub:
        def __init__(self, seq):
            self.seq = seq

        def sequence_length(self):
            return self.seq

    assert cp_degrees(Stub(CP_MIN_SEQ // 2), 8) == [1]
    assert cp_degrees(Stub(CP_MIN_SEQ), 8) == [1, 2, 4, 8]
    assert cp_degrees(Stub(CP_MIN_SEQ + 2), 8) == [1, 2]            # only degrees dividing the sequence
    assert cp_degrees(Stub(64), 8, {"cp": 4}) == [4]
    assert cp_degrees(Stub(64), 8, {"cp": [1, 2]}) == [1, 2]


# ---------------------------------------------------------------------------- constraints
def test_constraints_pin_and_limit_cp(tiny):
    gm, cluster, _cm = tiny
    default = gfx.search(gm, cluster, "80GB", 4)
    assert all(lp.cp == 1 for lp in default.layers)                  # a 32-position sequence: no CP offered
    pinned = gfx.search(gm, cluster, "80GB", 4, constraints={"cp": 2, "cp_kind": "ulysses"})
    assert [lp.cp for lp in pinned.layers] == [2, 2, 2, 1]           # the post layer refuses cp: whole
    assert {lp.cp_kind for lp in pinned.layers if lp.cp > 1} == {"ulysses"}
    assert all(lp.dp % lp.cp == 0 and lp.tp == 1 for lp in pinned.layers if lp.cp > 1)
    assert "context parallelism: cp 2 (ulysses" in pinned.explain()
    assert all(lp.extra["cp_exchange_s"] >= 0 for lp in pinned.layers if lp.cp > 1)
    free = gfx.search(gm, cluster, "80GB", 4, constraints={"cp": [1, 2, 4]})
    assert free.estimate["throughput_samples_s"] >= pinned.estimate["throughput_samples_s"] * (1 - 1e-9)
    again = gfx.Plan.from_dict(json.loads(pinned.to_json()))
    assert gfx.estimate(gm, again, cluster)["step_time_s"] == pytest.approx(pinned.estimate["step_time_s"])
    with pytest.raises(ConfigError):
        gfx.search(gm, cluster, "80GB", 4, constraints={"cp_kind": "zigzag"})
    with pytest.raises(ConfigError):
        gfx.search(gm, cluster, "80GB", 4, constraints={"cp": "two"})


def test_one_sample_on_four_devices_needs_cp_or_tp(tiny):
    """Global batch 1 on 4 devices: cp = 1 layers need dp = 1 (tp 4 or a pipeline); cp 4 splits the
    sequence of the one sample over the 4 ranks."""
    gm, cluster, cm = tiny
    plan = gfx.search(gm, cluster, "80GB", 1, constraints={"cp": [1, 4], "pp": 1})
    for lp in plan.layers:
        assert lp.dp // lp.cp == 1
    est = gfx.estimate(gm, gfx.Plan.uniform(gm, 4, tp=1, dp=4, cp=4, global_batch_size=1), cluster)
    assert est["step_time_s"] > 0
    with pytest.raises(ConfigError):   # cp = 1 at dp 4 would need 4 samples
        gfx.Plan.uniform(gm, 4, tp=1, dp=4, global_batch_size=1)


def test_cli_cp_flags(tmp_path, capsys):
    from galvatron_fx.cli import main

    path = tmp_path / "plan.json"
    argv = ["plan", "gpt-tiny", "--set", "layers=2", "--set", "hidden=32", "--set", "heads=4", "--set", "seq_len=16",
            "--cluster", "4xA100-80GB", "--global-batch-size", "4", "--json", str(path)]
    assert main([*argv, "--cp", "4", "--cp-kind", "ring"]) == 0
    assert "context parallelism: cp 4 (ring" in capsys.readouterr().out
    layers = json.loads(path.read_text())["layers"]
    assert [lp["cp"] for lp in layers] == [4, 4, 4, 1] and {lp["cp_kind"] for lp in layers[:3]} == {"ring"}
    with pytest.raises(SystemExit):
        main([*argv, "--cp-kind", "zigzag"])
    assert main([*argv, "--cp", "x"]) != 0
    assert "--cp takes degrees" in capsys.readouterr().err


# ------------------------------------------------------------------------- meta acceptance
def llama3_8b(seq: int, layers: int = 32):
    """Llama-3-8B on the meta device, causal SDPA without a materialised mask (what flash attention
    runs), captured with dynamo at ``seq`` positions."""
    pytest.importorskip("transformers")
    import torch
    import transformers as tf
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
    cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seq,
                         rope_theta=500000.0, use_cache=False, attn_implementation="sdpa_causal")
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method="dynamo")


def _acceptance(seq: int, layers: int) -> None:
    gm = llama3_8b(seq, layers)
    cluster = gfx.Cluster.preset("8xH100-80GB")
    att = cost_model_for(gm, cluster).attention(1)
    assert (att.heads, att.kv_heads, att.head_dim, att.seq) == (32, 8, 128, seq)   # enable_gqa: 8 kv heads
    assert att.causal and not att.masked
    plan = gfx.search(gm, cluster, global_batch_size=8)
    assert any(lp.cp > 1 for lp in plan.layers)
    try:
        cp1 = gfx.search(gm, cluster, global_batch_size=8, constraints={"cp": 1})
    except gfx.InfeasibleError:
        return
    assert plan.estimate["throughput_samples_s"] > cp1.estimate["throughput_samples_s"]


def test_llama3_8b_long_context_prefers_cp_small():
    """4 of the 32 blocks at 131072 tokens (seconds): context parallelism wins already."""
    _acceptance(131072, 4)


@pytest.mark.matrix
@pytest.mark.parametrize("seq", [131072, 262144])
def test_llama3_8b_long_context_prefers_cp(seq):
    _acceptance(seq, 32)


LLAMA3_8B_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-05, "hidden_act": "silu",
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("seq, gbs", [(131072, 2), (262144, 1)])
def test_llama3_8b_config_plans_long_context_within_the_device(tmp_path, seq, gbs):
    """The command a user runs on Llama-3-8B's config.json: 128k tokens (batch 2) and 256k (batch 1)
    on 8 H100-80GB find a plan within the 80 GiB (before the fused kernels were priced: none below
    390 GiB); it names flash attention and uses context parallelism."""
    pytest.importorskip("transformers")
    from galvatron_fx.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B_CONFIG))
    out = tmp_path / "plan.json"
    assert main(["plan", str(config), "--cluster", "8xH100-80GB", "--global-batch-size", str(gbs),
                 "--seq-len", str(seq), "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert max(plan["estimate"]["memory_bytes_per_device"]) <= 80 * 2**30
    assert any(lp["cp"] > 1 for lp in plan["layers"])
    assert {lp.get("attention_kernel") for lp in plan["layers"]} >= {"flash"}
