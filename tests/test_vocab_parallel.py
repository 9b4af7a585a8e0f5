"""Vocabulary-parallel head and loss without processes: the cross-entropy rule, the rewrite, the
vocabulary-parallel cross entropy at tp = 1 against torch, and the cost model's head activations
(the LM head's bytes per sample at tp = 2 are at most 0.6 of tp = 1)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import galvatron_fx as gfx
from galvatron_fx.sharding import analyze
from galvatron_fx.sharding.losses import bind_cross_entropy
from tests.toy_models import Block

VOCAB, HIDDEN = 32, 16
CAUSAL_LMS = ["gpt2", "gpt-neox", "llama", "mistral", "qwen2", "gemma2", "phi", "phi3", "opt", "bloom", "falcon",
              "gptj"]


class HeadLM(nn.Module):
    """Embedding, two blocks, norm, an LM head and a cross entropy; returns ``(loss, logits)`` like HF models."""

    def __init__(self, weight=None, label_smoothing=0.0, tied=False, return_logits=True):
        super().__init__()
        self.return_logits = return_logits
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(HIDDEN) for _ in range(2)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.weight = weight
        self.label_smoothing = label_smoothing

    def forward(self, ids, labels):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), weight=self.weight, ignore_index=-100,
                               label_smoothing=self.label_smoothing)
        return (loss, logits) if self.return_logits else loss


def head_inputs(batch=4, seq=6):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels[:, ::3] = -100
    return ids, labels


def _post(gm):
    return next(la.index for la in gfx.layers(gm) if la.kind == "post")


@pytest.mark.parametrize("method", ["fx", "export"])
def test_cross_entropy_of_the_head_runs_on_vocabulary_shards(method):
    torch.manual_seed(0)
    gm = gfx.capture(HeadLM(label_smoothing=0.1), head_inputs(), method=method)
    post = _post(gm)
    res = analyze(gm, {post: (2, False)})[post]
    assert len(res.column) == 1 and not res.replicated_linears
    (loss,) = res.vocab_losses
    assert res.vocab_losses[loss].num_classes == VOCAB
    # no gather anywhere: neither before the loss nor at the logits output
    assert not any(op[0] == "gather" for op in res.conversions.values())
    assert len(res.sharded_outputs) == 1


def test_weighted_cross_entropy_gathers_the_logits_first():
    torch.manual_seed(0)
    gm = gfx.capture(HeadLM(weight=torch.rand(VOCAB), return_logits=False), head_inputs(), method="fx")
    post = _post(gm)
    res = analyze(gm, {post: (2, False)})[post]
    assert not res.vocab_losses and res.column   # the head still shards; its logits are all-gathered
    assert any(op[0] == "gather" for op in res.conversions.values())
    # returned beside such a loss, the logits still leave as this rank's slice (an output beside the
    # loss: eval_step(return_outputs=True) assembles it), the loss gathers its own copy
    gm = gfx.capture(HeadLM(weight=torch.rand(VOCAB)), head_inputs(), method="fx")
    res = analyze(gm, {post: (2, False)})[post]
    assert not res.vocab_losses and res.column and not res.replicated_linears
    assert len(res.sharded_outputs) == 1 and any(op[0] == "gather" for op in res.conversions.values())


def test_tied_head_and_embedding_shard_alike():
    torch.manual_seed(0)
    gm = gfx.capture(HeadLM(tied=True), head_inputs(), method="fx")
    pre, post = 0, _post(gm)
    res = analyze(gm, {pre: (2, False), post: (2, False)})
    assert res[pre].vocab_embeddings and res[post].vocab_losses
    assert {s.fqn for s in res[post].param_shards.values()} == {"emb.weight"}


def test_bind_cross_entropy_reads_every_flavour():
    torch.manual_seed(0)
    for method, aten in (("fx", False), ("export", True)):
        gm = gfx.capture(HeadLM(label_smoothing=0.25), head_inputs(), method=method)
        (ce,) = [b for b in map(bind_cross_entropy, gm.graph.nodes) if b is not None]
        assert (ce.aten, ce.ignore_index, ce.reduction, ce.label_smoothing, ce.weight) == (aten, -100, "mean", 0.25, None)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(12, 10), (3, 10, 4), (10,)])
def test_vocab_parallel_cross_entropy_on_one_shard_is_torch(reduction, smoothing, shape):
    from galvatron_fx.runtime import tp_ops
    from galvatron_fx.runtime.vocab_parallel import vocab_parallel_cross_entropy

    key = tp_ops.register_group(None, 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 10, shape[:1] + shape[2:] if len(shape) > 1 else (), generator=g)
    if t.dim():
        t.view(-1)[::3] = -100
    want = F.cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing)
    got = vocab_parallel_cross_entropy(x, t, 0, 10, key, -100, reduction, smoothing)
    torch.testing.assert_close(got, want)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad((got * w).sum(), x)[0], torch.autograd.grad((want * w).sum(), x)[0])


def test_out_of_range_target_is_an_error():
    from galvatron_fx.runtime import tp_ops
    from galvatron_fx.runtime.vocab_parallel import vocab_parallel_cross_entropy

    key = tp_ops.register_group(None, 1)
    with pytest.raises(IndexError, match="outside"):
        vocab_parallel_cross_entropy(torch.randn(3, 10), torch.tensor([1, 10, -100]), 0, 10, key)


def _hf():
    pytest.importorskip("transformers")
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)
    import hf_coverage

    return hf_coverage


def head_activation_ratio(name: str, method: str = "dynamo", sp: bool = False) -> float:
    """``benchmarks/hf_coverage.py``'s head column: the LM head's activation bytes per sample at tp = 2
    over tp = 1 (cost model), for the architecture's tiny config with a vocabulary of 32 x hidden."""
    return _hf().head_activation_ratio(name, method, sp=sp)


@pytest.mark.slow
def test_head_activations_halve_at_tp2():
    assert head_activation_ratio("gpt2") <= 0.6   # a tied head (the embedding's table), dynamo


@pytest.mark.matrix
@pytest.mark.parametrize("method", ["dynamo", "export"])
@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_every_causal_lm_head_activations_at_tp2(name, method):
    assert head_activation_ratio(name, method) <= 0.6
    assert head_activation_ratio(name, method, sp=True) <= 0.6


def test_cost_model_prices_the_loss_collectives():
    """The vocabulary-parallel loss all-reduces the max and the stacked sums of each token: two
    forward collectives of ``tokens`` and ``2 x tokens`` elements beside the head's backward one."""
    from galvatron_fx.cost import CostModel

    torch.manual_seed(0)
    ids, labels = head_inputs()
    gm = gfx.capture(HeadLM(), (ids, labels), method="fx")
    cm = CostModel(gm, gfx.Cluster.preset("2xA100-80GB"), precision="fp32")
    m = cm.measure(_post(gm))
    tokens = ids.numel() / ids.shape[0]
    assert sorted(f(1) for f in m.fwd_allreduce) == [tokens, 2 * tokens]
    assert [f(1) for f in m.bwd_allreduce] == [tokens * HIDDEN]
