"""Vocabulary-parallel head and loss on gloo ranks.

* the vocabulary-parallel cross entropy on two vocabulary shards equals ``F.cross_entropy`` of the
  whole logits (value and gradient; reductions, ``ignore_index``, label smoothing, extra dims);
* transformers causal LMs (tiny configs, keyword inputs ``input_ids=..., labels=...`` with -100
  labels) train 3 AdamW steps under TP2 and TP2+SP to the single-device losses (relative error
  <= 1e-4) with the LM head column parallel over the vocabulary and the loss on the shards (the
  exact token mean); ``eval_step(return_outputs=True)`` assembles the whole logits; the head's
  saved activations are the cost model's; a toy LM with label smoothing trains likewise.

CI runs all of it in one 2-rank world (GPT-2: tied head, dynamo, TP2+SP; Llama: export, TP2); the matrix runs every
causal LM of ``benchmarks/hf_coverage.py`` through dynamo and export, and pp = 2 x tp = 2 on 4 ranks.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.test_vocab_parallel import CAUSAL_LMS

pytestmark = pytest.mark.dist

STEPS, TOL = 3, 1e-4


# --------------------------------------------------------------------------- the loss alone

def _loss_on_shards(rank, world):
    from galvatron_fx.runtime import tp_ops
    from galvatron_fx.runtime.vocab_parallel import vocab_parallel_cross_entropy

    key = tp_ops.register_group(None, world)
    out = []
    g = torch.Generator().manual_seed(0)
    for shape in [(12, 10), (3, 10, 4)]:
        for reduction in ("mean", "sum", "none"):
            for smoothing in (0.0, 0.1):
                x = torch.randn(*shape, generator=g, dtype=torch.float64)
                t = torch.randint(0, shape[1], shape[:1] + shape[2:], generator=g)
                t.view(-1)[::4] = -100
                w = torch.randn(t.shape if reduction == "none" else (), generator=g, dtype=torch.float64)
                full = x.clone().requires_grad_(True)
                want = F.cross_entropy(full, t, reduction=reduction, label_smoothing=smoothing)
                (want * w).sum().backward()
                n = shape[1] // world
                local = x.narrow(1, rank * n, n).clone().requires_grad_(True)
                got = vocab_parallel_cross_entropy(local, t, rank * n, shape[1], key, -100, reduction, smoothing)
                (got * w).sum().backward()
                out.append(((got - want).abs().max().item(),
                            (local.grad - full.grad.narrow(1, rank * n, n)).abs().max().item()))
    return out


def _ci_world(rank, world):
    """Everything CI checks, in one 2-rank world (a spawn costs seconds on a small machine)."""
    return {"loss": _loss_on_shards(rank, world), "smoothing": _toy(rank, world, "fx"),
            "hf": _train(rank, world, CI_CASES)}


@pytest.fixture(scope="module")
def ci_world():
    pytest.importorskip("transformers")
    return run_distributed(_ci_world, 2, timeout=300)


def test_vocab_parallel_cross_entropy_equals_torch_on_two_shards(ci_world):
    for per_rank in ci_world:
        for value_err, grad_err in per_rank["loss"]:
            assert value_err < 1e-12 and grad_err < 1e-12, (value_err, grad_err)


# --------------------------------------------------------------------------- training

def _hf():
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)
    import hf_coverage

    return hf_coverage


def _lm(name):
    """``hf_coverage``'s seeded tiny model of ``name`` and its keyword inputs, a fifth of the labels -100."""
    model, kw = _hf().build(name)
    kw["labels"][:, ::5] = -100
    return model, kw


def _reference(name):
    """Single-device losses of ``STEPS`` AdamW steps, then the eval loss and logits."""
    from tests.training import EPS, reference

    model, kw = _lm(name)
    losses = reference(_hf()._KeywordLoss(model, kw), (), steps=STEPS, eps=EPS)[0]
    with torch.no_grad():
        out = model(**kw)
    return losses, out.loss.item(), out.logits


def _head_saved_bytes(dm, post: int, run) -> int:
    """Bytes autograd saves inside the head layer's submodule while ``run()`` runs (parameters excluded)."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in dm.parameters()}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    mod = getattr(dm, f"layers_{post}")
    handles = [mod.register_forward_pre_hook(lambda m, a: hooks.__enter__()),
               mod.register_forward_hook(lambda m, a, o: hooks.__exit__(None, None, None))]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return sum(seen.values())


def _train(rank, world, cases):
    """Per case ``(name, method, plan keywords)``: the largest relative loss error over the steps, the
    eval loss error, the largest logits error, whether the head's loss ran on the shards and never
    gathered, and the head's saved bytes (measured, cost model)."""
    import galvatron_fx as gfx
    from galvatron_fx.planner import cost_model_for
    from tests.training import EPS, LR

    out = []
    refs = {}
    for name, method, plan_kw in cases:
        if name not in refs:
            refs[name] = _reference(name)
        ref_losses, ref_eval, ref_logits = refs[name]
        model, kw = _lm(name)
        try:
            gm = gfx.capture(model, (), kwargs=kw, method=method)
        finally:
            torch._dynamo.reset()
        plan = gfx.Plan.uniform(gm, world, global_batch_size=kw["input_ids"].shape[0], **plan_kw)
        dm = gfx.transform(gm, plan=plan)
        post = next(la.index for la in gfx.layers(gm) if la.kind == "post")
        # the loss runs on the shards and the logits leave as this rank's slice (never gathered)
        codes = [m.code for m in dm.modules() if isinstance(m, torch.fx.GraphModule)]
        on_shards = any("vocab_parallel_cross_entropy" in c and "vocab_shard_output" in c for c in codes)
        if plan.pp > 1 and rank < world // plan.pp:
            on_shards = True   # the first stage holds no head
        opt = torch.optim.AdamW(dm.parameters(), lr=LR, eps=EPS)
        losses, saved = [], None
        for step in range(STEPS):
            if step == 0 and plan.pp == 1:
                saved = _head_saved_bytes(dm, post, lambda: losses.append(float(dm.train_step(**kw))))
            else:
                losses.append(float(dm.train_step(**kw)))
            opt.step()
        loss, outs = dm.eval_step(**kw, return_outputs=True)
        predicted = None
        if saved is not None:
            cm = cost_model_for(gm, gfx.Cluster.preset(f"{world}xA100-80GB"), precision="fp32")
            predicted = cm.activation_bytes(post, plan.layer_strategies()[post], plan.micro_batch_size)
        logits = outs[1]
        out.append(dict(
            loss_err=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            eval_err=abs(float(loss) - ref_eval) / abs(ref_eval),
            logits_err=(logits - ref_logits).abs().max().item() if logits.shape == ref_logits.shape else float("inf"),
            on_shards=on_shards, saved=saved, predicted=predicted))
    return out


def _check(results, cases):
    for per_rank in results:
        for case, r in zip(cases, per_rank):
            assert r["loss_err"] <= TOL and r["eval_err"] <= TOL, (case, r)
            assert r["logits_err"] <= 1e-5, (case, r)
            assert r["on_shards"], (case, "the head's loss does not run on vocabulary shards")
            if r["saved"] is not None:   # NOTE: a few scalars apart (the token-loss scale, torch's total weight)
                assert abs(r["saved"] - r["predicted"]) <= 0.005 * r["predicted"], (case, r)


CI_CASES = [
    ("gpt2", "dynamo", dict(tp=2, dp=1, sp=True)),   # tied head (the embedding's table)
    ("llama", "export", dict(tp=2, dp=1)),
]


@pytest.mark.slow
def test_hf_lms_train_with_a_vocabulary_parallel_loss(ci_world):
    _check([r["hf"] for r in ci_world], CI_CASES)


@pytest.mark.matrix
@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_every_causal_lm_trains_with_a_vocabulary_parallel_loss(name):
    pytest.importorskip("transformers")
    cases = [(name, method, dict(tp=2, dp=1, sp=sp)) for method in ("dynamo", "export") for sp in (False, True)]
    _check(run_distributed(_train, 2, cases, timeout=600), cases)


@pytest.mark.matrix
@pytest.mark.parametrize("name", ["llama", "gpt-neox"])
def test_pipeline_of_tp2_stages_trains_with_a_vocabulary_parallel_loss(name):
    pytest.importorskip("transformers")
    cases = [(name, method, dict(tp=2, dp=1, pp=2, micro_batches=2)) for method in ("dynamo", "export")]
    _check(run_distributed(_train, 4, cases, timeout=600), cases)


# --------------------------------------------------------------------------- label smoothing (toy LM)

def _toy(rank, world, method):
    import galvatron_fx as gfx
    from tests.test_vocab_parallel import HeadLM, head_inputs
    from tests.training import EPS, LR

    args = head_inputs()
    losses = {}
    for label in ("ref", "tp2"):
        torch.manual_seed(0)
        model = HeadLM(label_smoothing=0.1)
        if label == "ref":
            opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
            seq = []
            for _ in range(STEPS):
                opt.zero_grad()
                loss = model(*args)[0]
                loss.backward()
                opt.step()
                seq.append(loss.item())
        else:
            gm = gfx.capture(model, args, method=method)
            dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, tp=2, dp=1, global_batch_size=4))
            opt = torch.optim.AdamW(dm.parameters(), lr=LR, eps=EPS)
            seq = []
            for _ in range(STEPS):
                seq.append(float(dm.train_step(*args)))
                opt.step()
            assert any("vocab_parallel_cross_entropy" in m.code for m in dm.modules()
                       if isinstance(m, torch.fx.GraphModule))
        losses[label] = seq
    return max(abs(a - b) / abs(b) for a, b in zip(losses["tp2"], losses["ref"]))


def test_label_smoothing_trains_on_vocabulary_shards(ci_world):
    for per_rank in ci_world:
        assert per_rank["smoothing"] <= 1e-5, per_rank["smoothing"]
