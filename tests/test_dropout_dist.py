"""Dropout follows the step (issue "A training run, not a step", part 6): a graph captured in
training mode drops in ``train_step`` and not in ``eval_step``, and a compiled model follows
``model.eval()`` / ``model.train()``, as eager does. HF Llama (attention dropout inside SDPA) and
GPT-2 (``F.dropout`` on embeddings and residuals), 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests import loops
from tests.dist_utils import run_distributed

pytest.importorskip("transformers")


def _model(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=loops.V, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=32, attention_dropout=0.5))
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=loops.V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                            resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5))


def _run(rank, world, kind):
    import galvatron_fx as gfx

    batch = loops.collate(1)[0]
    model = _model(kind)
    gm = gfx.capture(model, (), kwargs=batch, method="export")
    dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, dp=2, sdp="zero3", global_batch_size=loops.B))
    out = {"train": float(dm.train_step(**batch)), "eval": float(dm.eval_step(**batch))}
    rng = torch.get_rng_state()   # the measured selection's dropping steps leave the random state alone
    gfx.search(gm, "2xA100-80GB", global_batch_size=loops.B, precision="fp32", measure=1,
               measure_options={"warmup": 0, "steps": 1, "rounds": 1})
    out["rng_kept"] = torch.equal(rng, torch.get_rng_state())
    compiled = torch.compile(model, backend="galvatron", options={"cluster": "2xA100-80GB", "precision": "fp32"})
    compiled(**batch).loss.backward()
    model.eval()
    with torch.no_grad():
        out["compiled_eval"] = float(compiled(**batch).loss)
    model.train()
    out["compiled_train"] = float(compiled(**batch).loss)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.matrix)])   # CI time
def test_dropout_is_off_in_eval_and_on_in_training(kind):
    model, batch = _model(kind), loops.collate(1)[0]
    model.eval()
    with torch.no_grad():
        want = float(model(**batch).loss)
    for r in run_distributed(_run, 2, kind):
        assert abs(r["eval"] - want) < 1e-5 * want and abs(r["compiled_eval"] - want) < 1e-5 * want, (r, want)
        assert abs(r["train"] - want) > 1e-4 and abs(r["compiled_train"] - want) > 1e-4, (r, want)   # it drops
        assert r["rng_kept"]
