"""ZeRO-2/3 prefetch (runtime/data_parallel.py ``FlatParams.prefetch``) on 2 and 4 gloo ranks.

ZeRO-3: a gather in forward starts the next layer's all-gather, a gather in backward the previous
one's (FSDP2's order), so per pass only the first layer waits for a gather it did not prefetch; at
most two layers' buffers are gathered at once (beyond a tied weight kept for its backward).
ZeRO-2: after an optimizer step, the first forward re-gathers each layer's shards when it reads
the layer, prefetched by the layer before. Every step still trains exactly like one device: with
and without checkpointing (the recomputation gathers and prefetches backward), with pp = 2 (each
stage chains its own layers), with the user's SGD; and on a transformers Llama captured by
torch.export from keyword inputs, with the user's AdamW.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training import TOL, apply_specs, transform


def _counting(rank, world_size, pp, ckpt, sdp, kind):
    from galvatron_fx.runtime.data_parallel import FlatParams

    counts = {"prefetched": 0, "waited": 0, "max_gathered": 0}
    stores: list = []
    finish, gather_into, gather_full = FlatParams._finish_prefetch, FlatParams._gather_into, FlatParams.gather_full

    def _finish(self):
        counts["prefetched"] += 1
        finish(self)

    def _into(self, full):
        if full.data_ptr() == self.full.data_ptr():   # not unsharded()'s copies for checkpoints
            counts["waited"] += 1
        gather_into(self, full)

    def _full(self):
        out = gather_full(self)
        alive = sum(s.full.untyped_storage().size() > 0 for s in stores if not s.keep_gathered)
        counts["max_gathered"] = max(counts["max_gathered"], alive)
        return out

    FlatParams._finish_prefetch, FlatParams._gather_into, FlatParams.gather_full = _finish, _into, _full
    try:
        return _train(world_size, pp, ckpt, sdp, kind, counts, stores)
    finally:   # the rank processes are pooled (tests/dist_utils.py)
        FlatParams._finish_prefetch, FlatParams._gather_into, FlatParams.gather_full = finish, gather_into, gather_full


def _train(world_size, pp, ckpt, sdp, kind, counts, stores):
    import galvatron_fx as gfx

    if kind == "llama":   # transformers, keyword inputs, torch.export, the user's AdamW
        from tests.test_hf_doors_dist import hf_model

        model, kwargs = hf_model("llama")
        args, method, opt_cls, lr = (), "export", torch.optim.AdamW, 1e-3
    else:
        model, args = gfx.models.build("gpt-tiny", device="cpu", layers=4, batch=8)
        kwargs, method, opt_cls, lr = {}, "fx", torch.optim.SGD, 0.1
    ref = copy.deepcopy(model)
    gm = gfx.capture(model, args, kwargs=kwargs, method=method)
    plan = gfx.Plan.uniform(gm, world_size, pp=pp, global_batch_size=8, micro_batches=2)
    apply_specs(plan, [dict(sdp=sdp, ckpt=ckpt)])
    dm = transform(gm, plan)
    stores.extend(dm.stores)
    opt, ref_opt = opt_cls(dm.parameters(), lr=lr), opt_cls(ref.parameters(), lr=lr)
    losses, ref_losses = [], []
    for _ in range(3):
        losses.append(dm.train_step(*args, **kwargs).item())
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = ref(*args, **kwargs)
        loss = loss.loss if kind == "llama" else loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    chained = sum(s.mode == sdp and s.dp > 1 and not s.keep_gathered for s in dm.stores)
    return counts, chained, losses, ref_losses


def _check(pp, ckpt, sdp="zero3", kind="gpt-tiny", tol=TOL):
    for counts, chained, losses, ref_losses in run_distributed(_counting, 2 * pp, pp, ckpt, sdp, kind):
        assert chained >= 3, chained
        if sdp == "zero3":
            # 3 steps x 2 micro-batches x (forward + backward) passes; each waits for its first gather
            passes = 3 * 2 * 2
            assert counts["max_gathered"] <= 2, counts
        else:
            passes = 2   # the first forward after each of the first 2 optimizer steps
        assert counts["waited"] == passes, counts
        assert counts["prefetched"] == passes * (chained - 1), counts
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= tol, (losses, ref_losses)


def test_zero3_prefetches_the_next_layer_and_trains_exactly():
    _check(pp=1, ckpt=False)


def test_zero3_prefetch_under_checkpointing_and_pipeline_stages():
    _check(pp=2, ckpt=True)


def test_zero2_regathers_after_the_step_prefetched_layer_by_layer():
    _check(pp=1, ckpt=False, sdp="zero2")


def test_zero3_prefetch_on_a_transformers_llama_through_export():
    pytest.importorskip("transformers")
    _check(pp=1, ckpt=False, kind="llama", tol=1e-4)
