"""torch's async TP priced (``async_tp=True``, for runs that use torchtitan's
``enable_async_tensor_parallel``; this runtime's collectives block): each sequence-parallel site's
all-gather and reduce-scatter pipelined against the matmuls of its Megatron region in ``tp`` row
chunks. Checked by hand on a transformers Llama block of Llama-3-8B's widths (meta device): the
regions are the attention's q / k / v then o, and the MLP's gate / up then down; the exposed time of
each collective is ``(tp - 1) max(0, comm / (tp - 1) - matmul / tp)``; a site with no matmul (the
embedding, the loss) and a plan without SP are priced as before; the option is validated and
recorded in a searched plan; dynamo and export capture price it alike.
"""

from __future__ import annotations

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.cost.time_terms import micro_pipelined
from galvatron_fx.planner import cost_model_for
from galvatron_fx.solver.strategy import Strategy
from tests.cost_options import check_cost_option

tf = pytest.importorskip("transformers")

HIDDEN, FFN, HEADS, KV_HEADS, SEQ = 4096, 14336, 32, 8, 8192


def test_a_transfer_shorter_than_a_chunk_matmul_hides_entirely():
    assert micro_pipelined(3.0, 8.0, 4) == 0.0                 # transfer chunks of 1 beside matmul chunks of 2
    assert micro_pipelined(12.0, 8.0, 4) == pytest.approx(6.0)  # 3 transfer chunks of 4, each 2 beyond its matmul
    assert micro_pipelined(5.0, 8.0, 1) == 0.0


def _capture(method: str = "dynamo"):
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method=method)


@pytest.fixture(scope="module")
def llama_block():
    return _capture()


def _block(cm) -> int:
    return next(i for i in range(len(cm.layers)) if cm.attention(i).calls)


def test_each_site_overlaps_the_matmuls_of_its_region(llama_block):
    cluster = gfx.Cluster.preset("8xH100-80GB")
    blocking = cost_model_for(llama_block, cluster, precision="bf16-mixed")
    pipelined = cost_model_for(llama_block, cluster, precision="bf16-mixed", async_tp=True)
    i, tp, n = _block(blocking), 8, 2.0
    s = Strategy(tp=tp, dp=1, sp=True)
    m = blocking.measure(i)
    tokens, head = n * SEQ, HIDDEN // HEADS

    def gemm(rows, cols, depth):
        return cluster.gemm_time(1, rows, cols, depth, "bf16")

    def chunked(cols, depth):   # the matmul as tp row chunks, less the matmul whole
        return tp * gemm(tokens / tp, cols, depth) - gemm(tokens, cols, depth)

    qkv = [(HIDDEN / tp, HIDDEN), (KV_HEADS * head / tp, HIDDEN), (KV_HEADS * head / tp, HIDDEN)]
    mlp = [(FFN / tp, HIDDEN), (FFN / tp, HIDDEN)]
    hand = [(sum(gemm(tokens, c, d) for c, d in qkv), gemm(tokens, HIDDEN, HIDDEN / tp),
             sum(chunked(c, d) for c, d in qkv) + chunked(HIDDEN, HIDDEN / tp)),
            (sum(gemm(tokens, c, d) for c, d in mlp), gemm(tokens, HIDDEN, FFN / tp),
             sum(chunked(c, d) for c, d in mlp) + chunked(HIDDEN, FFN / tp))]
    regions = blocking._tp_regions(m, n, s)
    assert [t for r in regions for t in r] == pytest.approx([t for r in hand for t in r], rel=1e-12)

    group = list(range(tp))
    nbytes = tokens * HIDDEN * 2
    gather = cluster.collective_time("all_gather", nbytes, group)
    scatter = cluster.collective_time("reduce_scatter", nbytes, group)
    saved = sum(gather + scatter - micro_pipelined(gather, col, tp) - micro_pipelined(scatter, row, tp) - extra
                for col, row, extra in hand)
    # forward and backward: two sites each, one per region
    assert blocking.tp_comm_time(m, n, s) - pipelined.tp_comm_time(m, n, s) == pytest.approx(2 * saved, rel=1e-9)
    # the MLP's matmuls outlast its transfers; the attention's projections do not (grouped k / v)
    assert micro_pipelined(gather, hand[1][0], tp) == 0.0
    assert micro_pipelined(gather, hand[0][0], tp) > 0.0
    assert 0.0 < pipelined.tp_comm_time(m, n, s) < blocking.tp_comm_time(m, n, s)


def test_sites_without_a_matmul_and_plans_without_sp_block_as_before(llama_block):
    cluster = gfx.Cluster.preset("8xH100-80GB")
    blocking = cost_model_for(llama_block, cluster, precision="bf16-mixed")
    pipelined = cost_model_for(llama_block, cluster, precision="bf16-mixed", async_tp=True)
    block = _block(blocking)
    for i in range(len(blocking.layers)):
        m = blocking.measure(i)
        no_sp = Strategy(tp=8, dp=1, sp=False)
        assert pipelined.tp_comm_time(m, 2.0, no_sp) == blocking.tp_comm_time(m, 2.0, no_sp)
        if i != block:   # the embedding's and the head's collectives feed or follow no matmul region
            sp = Strategy(tp=8, dp=1, sp=True)
            assert pipelined._tp_regions(m, 2.0, sp) is None
            assert pipelined.tp_comm_time(m, 2.0, sp) == blocking.tp_comm_time(m, 2.0, sp)


def test_the_option_is_validated_and_recorded_in_the_plan(llama_block):
    plan = gfx.Plan.uniform(llama_block, 8, precision="bf16-mixed", tp=8, sp=True, dp=1, global_batch_size=2)
    check_cost_option(llama_block, plan, "8xH100-80GB", "async_tp", global_batch_size=8)


def test_export_capture_finds_the_same_regions(llama_block):
    cluster = gfx.Cluster.preset("8xH100-80GB")
    s = Strategy(tp=8, dp=1, sp=True)
    by_method = []
    for gm in (llama_block, _capture("export")):
        cm = cost_model_for(gm, cluster, precision="bf16-mixed", async_tp=True)
        i = _block(cm)
        by_method.append((cm._tp_regions(cm.measure(i), 2.0, s), cm.tp_comm_time(cm.measure(i), 2.0, s)))
    assert by_method[0][0] is not None and by_method[0] == by_method[1]


def test_a_pipelined_plan_prices_its_stages_with_the_option(llama_block):
    # 2 stages (embedding + block | head) of tp 4 with SP: only the block's sites are pipelined
    plan = gfx.Plan.uniform(llama_block, 8, precision="bf16-mixed", tp=4, sp=True, dp=1, pp=2, micro_batches=4,
                            global_batch_size=8)
    blocking = gfx.estimate(llama_block, plan, "8xH100-80GB")
    pipelined = gfx.estimate(llama_block, plan, "8xH100-80GB", async_tp=True)
    assert pipelined["stage_time_s"][0] < blocking["stage_time_s"][0]
    assert pipelined["stage_time_s"][1] == blocking["stage_time_s"][1]
    assert pipelined["step_time_s"] <= blocking["step_time_s"]
