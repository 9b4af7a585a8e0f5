"""Context parallelism around the training loop's cases (tests/test_training_loop_dist.py holds
the exactness cases): saved activations per rank, outputs assembled by ``eval_step``, and the
refusals that name the layer and the fix. 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests import loops
from tests.dist_utils import run_distributed

pytest.importorskip("transformers")


def _saved_bytes(dm, batch) -> dict[str, int]:
    """Bytes each layer saves for backward in one forward of ``batch`` (distinct storages, not the
    layer's flat parameter buffers, which linears save views of)."""
    out: dict[str, int] = {}
    flat = {t.untyped_storage().data_ptr() for m in dm.modules() for t in vars(m).values()
            if isinstance(t, torch.Tensor)}
    flat |= {t.untyped_storage().data_ptr() for t in list(dm.buffers()) + [getattr(p, "_local_tensor", p)
                                                                           for p in dm.parameters()]}
    for name, layer in dm.named_children():
        if not name.startswith("layers_"):
            continue
        seen: dict[int, int] = {}

        def pack(t, seen=seen):
            if t.device.type != "meta" and t.untyped_storage().data_ptr() not in flat:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        layer.register_forward_pre_hook(lambda *_a, h=hooks: h.__enter__())
        layer.register_forward_hook(lambda *_a, h=hooks: h.__exit__(None, None, None))
        out[name] = seen
    dm.train_step(**batch)
    return {k: sum(v.values()) for k, v in out.items()}


def _activations(rank, world, cp):
    import galvatron_fx as gfx

    model = loops.llama()
    batch = loops.collate(1, batch=loops.B * (1 if cp > 1 else 2))[0]   # B samples per rank either way
    gm = gfx.capture(model, kwargs=batch, method="export")
    plan = gfx.Plan.uniform(gm, world, global_batch_size=batch["input_ids"].shape[0], dp=world, cp=cp)
    dm = gfx.transform(gm, plan=plan)
    return _saved_bytes(dm, batch)


def test_cp2_layer_saves_half_the_activations():
    """Per rank, a decoder block under cp = 2 saves half of what it saves at cp = 1 holding the same
    samples (12 samples of 8 tokens vs 12 of 16)."""
    whole = run_distributed(_activations, 2, 1)[0]
    split = run_distributed(_activations, 2, 2)[0]
    for name in ("layers_1", "layers_2"):
        ratio = split[name] / whole[name]
        print(name, split[name], whole[name], round(ratio, 3))
        assert 0.45 < ratio < 0.55, (name, split[name], whole[name])


def _outputs(rank, world, kind):
    import galvatron_fx as gfx

    model = loops.llama()
    batch = loops.collate(1)[0]
    gm = gfx.capture(model, kwargs=batch, method="dynamo")
    dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, global_batch_size=loops.B, dp=world, cp=2,
                                                 cp_kind=kind))
    loss, outs = dm.eval_step(**batch, return_outputs=True)
    return float(loss), outs[1] if isinstance(outs, tuple) else outs


@pytest.mark.parametrize("kind", ["ring", pytest.param("ulysses", marks=pytest.mark.matrix)])
def test_eval_step_assembles_the_whole_sequence(kind):
    model = loops.llama()
    batch = loops.collate(1)[0]
    with torch.no_grad():
        ref = model(**batch)
    for loss, logits in run_distributed(_outputs, 2, kind):
        assert abs(loss - float(ref.loss)) < 1e-5
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)


def _refused(rank, world, what):
    import galvatron_fx as gfx
    from galvatron_fx.errors import ConfigError

    torch.manual_seed(0)
    if what == "shifted-logits":   # the zoo GPT shifts its logits along the sequence in its last layer
        model, example = gfx.models.build("gpt-tiny", device="cpu", layers=2, hidden=32, heads=4, seq_len=loops.S,
                                          vocab=loops.V, batch=loops.B)
        gm = gfx.capture(model, example, method="fx")
        plan = gfx.Plan.uniform(gm, world, global_batch_size=loops.B, dp=world, cp=2)
    else:                          # sequence of 16 tokens over cp = 32... cp must divide dp: 2 ranks, odd sequence
        model = loops.llama()
        batch = loops.collate(1)[0]
        batch = {k: v[:, :15] for k, v in batch.items()}
        gm = gfx.capture(model, kwargs=batch, method="export")
        plan = gfx.Plan.uniform(gm, world, global_batch_size=loops.B, dp=world, cp=2)
    try:
        gfx.transform(gm, plan=plan)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what,expect", [("shifted-logits", "use cp=1 for this layer"),
                                         ("odd-sequence", "divisible by cp")])
def test_refusals_name_the_layer_and_the_fix(what, expect):
    for msg in run_distributed(_refused, 2, what):
        assert msg is not None and expect in msg and "layer " in msg, msg


def _meta_llama(rank, world):
    """A Llama built on the meta device, DP2 x CP2 ring: this rank's parts initialised, 3 AdamW steps."""
    import transformers as tf

    config = loops.llama().config
    config.use_cache = False    # transformers' cache cannot be captured on the meta device
    return loops.meta_training(lambda: tf.LlamaForCausalLM(config), world, dp=2, cp=2)


@pytest.mark.matrix
def test_a_meta_device_llama_trains_under_cp():
    import transformers as tf

    init, losses = loops.initialised_reference(tf.LlamaForCausalLM(loops.llama().config), 7, loops.collate(3), lr=1e-2)
    for full, got in run_distributed(_meta_llama, 2, timeout=300):
        assert all(torch.equal(full[k], v) for k, v in init.items())
        assert loops.rel(got, losses) < 1e-4, (got, losses)


def _searched(rank, world):
    import galvatron_fx as gfx

    model = loops.llama()
    batches = loops.collate(3)
    gm = gfx.capture(model, kwargs=batches[0], method="export")
    plan = gfx.search(gm, cluster=f"{world}xA100-80GB", global_batch_size=loops.B, constraints={"cp": 2},
                      precision="fp32")
    dm = gfx.transform(gm, plan=plan)
    return [lp.cp for lp in plan.layers], loops.step_losses(dm, batches, lr=1e-2)


def test_a_searched_cp_plan_trains_like_one_device():
    """``constraints={"cp": 2}``: the search pins cp 2 where the pass can apply it (admissibility is
    the pass's own analysis), and that plan trains to one device's losses."""
    losses = loops.plain_losses(loops.llama(), loops.collate(3), lr=1e-2)
    for cps, got in run_distributed(_searched, 2):
        assert any(c == 2 for c in cps), cps
        assert loops.rel(got, losses) < 1e-5, (got, losses)


def _one_sample_micro_batches(rank, world):
    import galvatron_fx as gfx

    batches = loops.collate(3, batch=2)
    gm = gfx.capture(loops.llama(), kwargs=batches[0], method="export")
    plan = gfx.Plan.uniform(gm, world, global_batch_size=2, dp=world, cp=world, micro_batches=2)
    dm = gfx.transform(gm, plan=plan)
    return dm.input_shard, loops.step_losses(dm, batches, lr=1e-2)


def test_micro_batches_of_one_sample_split_over_the_cp_group():
    """What CP is for: 2 micro-batches of 1 sample on 2 ranks (each holds half a sample's tokens);
    the inputs arrive whole on both ranks (``input_shard`` (0, 1)) and the loss is one device's."""
    ref = loops.plain_losses(loops.llama(), loops.collate(3, batch=2), lr=1e-2)
    for shard, losses in run_distributed(_one_sample_micro_batches, 2):
        assert shard == (0, 1)
        assert loops.rel(losses, ref) < 1e-5, (losses, ref)


def _uneven_sp_chunks(rank, world, seq):
    import galvatron_fx as gfx

    batches = [{k: v[:, :seq] for k, v in b.items()} for b in loops.collate(3)]
    gm = gfx.capture(loops.llama(), kwargs=batches[0], method="export")
    plan = gfx.Plan.uniform(gm, world, global_batch_size=loops.B, tp=2, sp=True, dp=2, cp=2)
    return loops.step_losses(gfx.transform(gm, plan=plan), batches, lr=1e-2)


@pytest.mark.matrix
def test_sequence_parallel_chunks_of_an_odd_cp_shard():
    """14 tokens, cp 2, tp 2 with sp: each rank's 7 positions split 4 / 3 over its TP group (the
    gathers' whole length is this rank's shard, not the captured sequence)."""
    batches = [{k: v[:, :14] for k, v in b.items()} for b in loops.collate(3)]
    ref = loops.plain_losses(loops.llama(), batches, lr=1e-2)
    for got in run_distributed(_uneven_sp_chunks, 4, 14):
        assert loops.rel(got, ref) < 1e-5, (got, ref)
