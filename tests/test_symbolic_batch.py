"""A symbolic batch (issue "A training run, not a step", part 1): capture keeps the batch a symbol.

HF Llama with global batch 16 = sequence length = head_dim (the constants a static capture cannot
tell apart): the captured graphs compute every batch size from their inputs, each layer from its
own activations, so they run on any number of rows; DP2, ZeRO-3, PP2 and PP2xDP2 (export and
dynamo graphs) train like one device, and so does a last, smaller batch. A model that branches on
its batch falls back to a static capture with a one-line note.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests import loops
from tests.dist_utils import run_distributed

pytest.importorskip("transformers")

B = 16   # = loops.S = head_dim below


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=loops.V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return tf.LlamaForCausalLM(cfg)


def _batches():
    """Three global batches of 16, then a last one of 8 (a dataloader with drop_last=False)."""
    return loops.collate(3, batch=B) + loops.collate(1, batch=B // 2, seed=9)


@pytest.mark.parametrize("method", ["export", "dynamo"])
def test_every_layer_computes_its_own_batch_size(method):
    import galvatron_fx as gfx
    from galvatron_fx.ir import META_KEY

    model = _llama()
    batch = loops.collate(1, batch=B)[0]
    assert model.config.hidden_size // model.config.num_attention_heads == B == loops.S
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no note: the batch stayed symbolic
        gm = gfx.capture(model, (), kwargs=batch, method=method)
    info = gm.meta[META_KEY]
    assert info.symbolic_batch and not info.static_batch_reason
    sizes = [n for n in gm.graph.nodes if n.meta[META_KEY].batch_factor is not None]
    assert sizes
    for n in sizes:   # no batch size crosses a layer boundary
        assert all(u.meta[META_KEY].layer == n.meta[META_KEY].layer for u in n.users), n.format_node()
    blocks = [rec for rec in info.layers if rec.kind == "block"]
    assert len({rec.signature for rec in blocks}) == 1   # the blocks still look alike
    for rows in (B, 5):   # the same graph on another number of rows
        small = {k: v[:rows] for k, v in batch.items()}
        assert torch.allclose(gm(*small.values())[0], model(**small).loss, rtol=1e-6, atol=0)


def test_a_model_that_branches_on_its_batch_is_captured_static_with_a_note():
    import galvatron_fx as gfx

    class Picky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            if x.shape[0] == 4:
                return self.lin(x).sum()
            return self.lin(x).mean()

    with pytest.warns(UserWarning, match="the batch stays baked in") as rec:
        gm = gfx.capture(Picky(), (torch.randn(4, 8),), method="export")
    assert len([r for r in rec if "baked in" in str(r.message)]) == 1 and "\n" not in str(rec[0].message)
    assert not gm.meta["galvatron"].symbolic_batch and gm.meta["galvatron"].static_batch_reason


CASES = {   # "matrix": CI time (--run-matrix runs them)
    "dp2-export": dict(matrix=True, method="export", plan=dict(dp=2)),
    "zero3-dynamo": dict(method="dynamo", plan=dict(dp=2, sdp="zero3")),
    "pp2-export": dict(method="export", plan=dict(pp=2, dp=1, micro_batches=2)),
    "pp2xdp2-dynamo": dict(matrix=True, world=4, method="dynamo",
                           plan=dict(pp=2, dp=2, micro_batches=2, sdp="zero3")),
    "t5-pp2-gpipe": dict(matrix=True, model="t5", method="dynamo",
                         plan=dict(pp=2, dp=1, micro_batches=2, schedule="gpipe")),
    "t5-pp2-1f1b": dict(model="t5", method="export", plan=dict(pp=2, dp=1, micro_batches=2, schedule="1f1b")),
}


def _t5():
    import transformers as tf

    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=loops.V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                     num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                                     decoder_start_token_id=0, pad_token_id=0))


def _t5_batches():
    """Global batch 8 = label length 8 (the static capture's T5 failure), then a last batch of 4."""
    g = torch.Generator().manual_seed(4)
    return [dict(input_ids=torch.randint(1, loops.V, (b, 12), generator=g),
                 labels=torch.randint(1, loops.V, (b, 8), generator=g)) for b in (8, 8, 4)]


def _run(rank, world, name):
    import galvatron_fx as gfx

    case = CASES[name]
    model, batches = (_t5(), _t5_batches()) if case.get("model") == "t5" else (_llama(), _batches())
    gm = gfx.capture(model, (), kwargs=batches[0], method=case["method"])
    plan = gfx.Plan.uniform(gm, world, global_batch_size=len(batches[0]["labels"]), precision="fp32", **case["plan"])
    dm = gfx.transform(gm, plan=plan)
    opt, sched = loops.optimizer(dm.named_parameters())
    clip = (lambda: dm.clip_grad_norm_(loops.CLIP)) if plan.pp > 1 else None
    losses, norms = loops.fit(lambda b: dm.train_step(**b).item(), dm.parameters, opt, sched, batches, clip)
    return dict(losses=losses, norms=norms, full=dm.full_state_dict())


@pytest.mark.dist
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.matrix) if c.get("matrix") else n
                                  for n, c in CASES.items()])
def test_batch_equal_to_sequence_and_head_dim_trains_like_one_device(name):
    t5 = CASES[name].get("model") == "t5"
    ref_losses, ref_norms, ref_params = loops.eager(_t5(), _t5_batches()) if t5 else loops.eager(_llama(), _batches())
    for r in run_distributed(_run, CASES[name].get("world", 2), name):
        assert loops.rel(r["losses"], ref_losses) < 1e-5, (r["losses"], ref_losses)
        assert loops.rel(r["norms"], ref_norms) < 1e-5, (r["norms"], ref_norms)
        for k, v in ref_params.items():
            assert torch.allclose(r["full"][k], v, rtol=1e-4, atol=1e-6), k


# --------------------------------------------------------------------------- batch x heads rows
def _bloom():
    import transformers as tf

    torch.manual_seed(0)
    return tf.BloomForCausalLM(tf.BloomConfig(vocab_size=loops.V, hidden_size=32, n_layer=2, n_head=4,
                                              hidden_dropout=0.0, attention_dropout=0.0))


def _bloom_run(rank, world):
    import galvatron_fx as gfx

    batches = loops.collate(3, batch=8)
    gm = gfx.capture(_bloom(), (), kwargs=batches[0], method="dynamo")
    out = {}
    for name, kw in (("zero3", dict(dp=2, sdp="zero3")), ("pp2", dict(pp=2, dp=1, micro_batches=2))):
        dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, global_batch_size=8, precision="fp32", **kw))
        out[name] = loops.step_losses(dm, batches, lr=1e-2)
    return out


@pytest.mark.dist
def test_alibi_rows_of_batch_times_heads_split_with_the_batch():
    # NOTE: Bloom's ALiBi is [batch * heads, 1, S], computed in the first layer and read by every block:
    # a DP shard or a micro-batch of it (also across a pipeline boundary) is a slice of its rows
    ref = loops.plain_losses(_bloom(), loops.collate(3, batch=8), lr=1e-2)
    for r in run_distributed(_bloom_run, 2):
        for name in ("zero3", "pp2"):
            assert loops.rel(r[name], ref) < 1e-5, (name, r[name], ref)


# --------------------------------------------------------------------------- samples mixed in a batch
def _clip():
    import transformers as tf

    torch.manual_seed(0)
    text = tf.CLIPTextConfig(vocab_size=loops.V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, max_position_embeddings=16, bos_token_id=1, eos_token_id=2)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 image_size=16, patch_size=8)
    return tf.CLIPModel(tf.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16))


def _clip_batches(steps=3, batch=8):
    g = torch.Generator().manual_seed(3)
    return [dict(input_ids=torch.randint(3, loops.V, (batch, 8), generator=g),
                 pixel_values=torch.randn(batch, 3, 16, 16, generator=g), return_loss=True) for _ in range(steps)]


def _clip_run(rank, world):
    import galvatron_fx as gfx
    from galvatron_fx.backend import full_state_dict
    from galvatron_fx.errors import ConfigError

    batches = _clip_batches()
    gm = gfx.capture(_clip(), (), kwargs=batches[0], method="dynamo")
    out = {}
    for name, kw in (("zero3", dict(dp=2, sdp="zero3")), ("pp2", dict(pp=2, micro_batches=1, schedule="gpipe"))):
        dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, global_batch_size=8, precision="fp32", **kw))
        out[name] = (loops.step_losses(dm, batches, lr=1e-2), dm.full_state_dict())
    try:   # micro-batches: each would see only its own samples' negatives, and no gather undoes that
        gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, dp=2, micro_batches=2, global_batch_size=8))
    except ConfigError as exc:
        out["refused"] = str(exc)
    static = gfx.capture(_clip(), (), kwargs=_clip_batches(1, batch=6)[0], method="dynamo", symbolic_batch=False)
    try:   # a static batch: the coupling cannot be told for sure, so a split is refused
        gfx.transform(static, plan=gfx.Plan.uniform(static, world, dp=2, global_batch_size=6))
    except ConfigError as exc:
        out["static"] = str(exc)
    dm = gfx.transform(gm, plan=gfx.search(gm, cluster="2xA100-80GB", global_batch_size=8, precision="fp32"))
    out["searched"] = (dm.plan.micro_batches, loops.step_losses(dm, batches, lr=1e-2))
    model = _clip()
    plan = gfx.Plan.uniform(gm, world, dp=2, sdp="zero3", global_batch_size=8, precision="fp32")
    compiled = torch.compile(model, backend="galvatron", options={"plan": plan})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "a training call returns the loss only"
        out["compile"] = (loops.plain_losses(compiled, batches, lr=1e-2), full_state_dict(model))
    return out


@pytest.mark.dist
def test_a_contrastive_loss_is_exact_under_every_batch_split():
    # NOTE: CLIP's loss compares every image with every text of the batch: the layer holding it
    # all-gathers the batch over its DP ranks (with gradient) and computes it whole
    import galvatron_fx as gfx

    model, batches = _clip(), _clip_batches()
    gm = gfx.capture(model, (), kwargs=batches[0], method="dynamo")
    post = gm.meta["galvatron"].layers[-1]
    assert post.batch_coupled and "[8, 8]" in post.batch_coupled[0]
    ref = loops.plain_losses(model, batches, lr=1e-2)
    # NOTE: softmax is invariant to the key bias: its gradient is round-off, which AdamW scales to +-lr
    want = {k: p.detach() for k, p in model.named_parameters() if not k.endswith("k_proj.bias")}
    for r in run_distributed(_clip_run, 2):
        for name in ("zero3", "pp2", "compile"):
            losses, params = r[name]
            assert loops.rel(losses, ref) < 1e-5, (name, losses, ref)
            for k, v in want.items():
                assert torch.allclose(params[k], v, rtol=1e-4, atol=1e-6), (name, k)
        assert "mixes the samples of a batch" in r["refused"] and "micro_batches=2" in r["refused"]
        assert "[6, 6]" in r["static"] and "method='dynamo'" in r["static"], r["static"]
        assert r["searched"][0] == 1 and loops.rel(r["searched"][1], ref) < 1e-5, (r["searched"], ref)


def _compiled(rank, world):
    import galvatron_fx as gfx
    from galvatron_fx.backend import distributed_model
    from galvatron_fx.errors import ConfigError

    model, batches = _llama(), _batches()
    static = gfx.capture(model, (), kwargs=batches[0], method="dynamo", symbolic_batch=False)
    plan = gfx.Plan.uniform(static, world, dp=2, sdp="zero3", global_batch_size=B, precision="fp32")
    try:   # a static graph cannot tell the batch from the sequence: one clear error, no shape error inside torch
        gfx.transform(static, plan=plan)
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    compiled = torch.compile(model, backend="galvatron", options={"plan": plan})
    opt, sched = loops.optimizer(model.named_parameters())

    def step(b):
        loss = compiled(**b).loss
        loss.backward()
        return loss.item()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "a training call returns the loss only"
        losses, norms = loops.fit(step, model.parameters, opt, sched, batches)
        model.eval()
        with torch.no_grad():
            logits = compiled(**batches[0]).logits
    return dict(refused=refused, losses=losses, norms=norms, logits=logits,
                symbolic=distributed_model(model).symbolic_batch)


@pytest.mark.dist
def test_the_compile_door_captures_the_batch_symbolically_and_trains_like_one_device():
    # NOTE: dynamo hands the backend a graph specialised to the batch; the backend captures the module
    # again from the call's arguments with a symbolic batch (batch 16 = seq = head_dim, a last batch of 8)
    model = _llama()
    ref_losses, ref_norms, _ = loops.eager(model, _batches())
    model.eval()
    with torch.no_grad():
        ref_logits = model(**_batches()[0]).logits
    for r in run_distributed(_compiled, 2):
        assert "also a length of its inputs" in r["refused"] and "gfx.capture" in r["refused"], r["refused"]
        assert r["symbolic"]
        assert loops.rel(r["losses"], ref_losses) < 1e-5, (r["losses"], ref_losses)
        assert loops.rel(r["norms"], ref_norms) < 1e-5, (r["norms"], ref_norms)
        assert torch.allclose(r["logits"], ref_logits, atol=1e-5), float((r["logits"] - ref_logits).abs().max())
