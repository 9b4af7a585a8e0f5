"""A tied weight read by a pipeline chunk that does not own it (GPT-2's LM head, tied to the
embedding on the first stage) leaves its owner's chunk as a copy with every micro-batch and
reaches the reader's (``passes/stage_split.py``); both chunks hold their copy until the
micro-batch's backward: the estimate counts it per micro-batch in flight on both, and the search's
exact stage solve counts it alike (a plan is never chosen under a budget its estimate exceeds)."""

from __future__ import annotations

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.cost import CostModel
from galvatron_fx.solver.schedules import chunk_peaks

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=2048, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight   # tied
    ids = torch.randint(0, 2048, (8, 16))
    return gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method="export")


def test_the_chunks_on_both_sides_of_a_tied_weight_hold_a_copy(gpt2):
    cm = CostModel(gpt2, gfx.Cluster.preset("4xA100-80GB"))
    last = len(cm.layers) - 1
    wte = 2048 * 32 * 4
    assert cm.tied_copy_bytes(0, last) == 0            # one chunk owns and reads it
    assert cm.tied_copy_bytes(last, last) == wte       # the LM head's chunk alone
    assert cm.tied_copy_bytes(1, last) == wte
    assert cm.tied_copy_bytes(1, last - 1) == 0        # the blocks do not read it
    assert cm.tied_copy_bytes(0, last - 1) == wte      # the embedding's chunk sends it to the head's
    assert cm.tied_copy_bytes(0, 0) == wte


def test_the_estimate_holds_one_copy_per_micro_batch_in_flight(gpt2):
    cluster = gfx.Cluster.preset("4xA100-80GB")
    plan = gfx.Plan.uniform(gpt2, 4, pp=2, micro_batches=4, global_batch_size=8, schedule="1f1b")
    est = gfx.estimate(gpt2, plan, cluster)
    (a0, b0), (a1, b1) = plan.stages
    peaks = chunk_peaks("1f1b", 2, 1, 4)
    acts = est["per_device"]["activation_bytes"]
    layers = est["layers"]
    assert acts[1] == sum(x["activation_bytes"] for x in layers[a1:b1 + 1])
    cm = CostModel(gpt2, cluster)
    received = cm.tied_copy_bytes(a1, b1)
    assert received == 2048 * 32 * 4
    own = sum(peaks[1] * cm.layer_cost(i, plan.layers[i].strategy, 2).activation_bytes for i in range(a1, b1 + 1))
    assert acts[1] == pytest.approx(own + peaks[1] * received, abs=len(range(a1, b1 + 1)))
    assert cm.tied_copy_bytes(a0, b0) == received    # the owner's copy, sent with each micro-batch
    assert acts[0] == pytest.approx(sum(peaks[0] * cm.layer_cost(i, plan.layers[i].strategy, 2).activation_bytes
                                        for i in range(a0, b0 + 1)) + peaks[0] * received, abs=b0 - a0 + 1)


def test_the_search_counts_the_received_weight_against_the_budget(gpt2):
    # GPipe holds every micro-batch on both stages: the LM head's stage holds 8 copies of the tied
    # weight, more than the embedding stage's ZeRO-3 shard of its states
    cluster = gfx.Cluster.preset("8xA100-80GB")
    fixed = dict(pp=2, micro_batches=8, schedule="gpipe", sdp="zero3", tp=1, cp=1, ep=1)
    roomy = gfx.search(gpt2, cluster, memory_budget="4GiB", global_batch_size=32, constraints=fixed)
    memory = gfx.estimate(gpt2, roomy, cluster)["memory_bytes_per_device"]
    assert memory[1] > memory[0]
    need = max(memory)
    # a byte less than that plan needs: the exact stage solve finds the plan that fits (checkpointing
    # blocks on the LM head's stage), counting the copies as the estimate does
    tight = gfx.search(gpt2, cluster, memory_budget=need - 1, global_batch_size=32, constraints=fixed)
    assert max(gfx.estimate(gpt2, tight, cluster)["memory_bytes_per_device"]) <= need - 1
    assert tight.estimate == gfx.estimate(gpt2, tight, cluster)
