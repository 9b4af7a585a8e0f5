"""Activation offload on gloo ranks: the user's training loop trains as on one device with the
layers' saved activations in host memory (transformers Llama / GPT-NeoX and the zoo's gpt-tiny, the
three capture front ends and torch.compile, ZeRO-2 / ZeRO-3, TP + SP, pipelines, LoRA, bf16), and the
bytes the host holds are the estimate's.

The loop cases run through tests/test_training_loop_dist.py's harness (a new collated batch every
step with -100 padding, clip_grad_norm_, AdamW over param groups by name, a cosine schedule; losses,
clip norms and final parameters against one device); they are registered there on import.
"""

from __future__ import annotations

import pytest

from tests import loops
from tests import test_training_loop_dist as harness
from tests.dist_utils import run_distributed

pytest.importorskip("transformers")

CASES = {
    "aoff-zero3": dict(plan=dict(dp=2, sdp="zero3", act_offload=True)),
    "aoff-pp2-export": dict(method="export", clip="dm", plan=dict(pp=2, dp=1, micro_batches=2, act_offload=True)),
    "aoff-pp2xdp2-export": dict(matrix=True, world=4, method="export", clip="dm",
                                plan=dict(pp=2, dp=2, micro_batches=2, sdp="zero2", act_offload=True)),
    "aoff-tp2-sp-compile": dict(door="compile", plan=dict(tp=2, dp=1, sp=True, act_offload=True)),
    "aoff-gpt-fx": dict(model="gpt", method="fx", plan=dict(dp=2, act_offload=True)),
    "aoff-lora-zero2": dict(matrix=True, model="lora", plan=dict(dp=2, sdp="zero2", act_offload=True)),
    "aoff-bf16-zero3": dict(matrix=True, precision="bf16-mixed", plan=dict(dp=2, sdp="zero3", act_offload=True)),
    "aoff-zbv-neox-export": dict(matrix=True, world=4, model="neox", method="export", clip="dm",
                                 plan=dict(pp=2, dp=2, micro_batches=2, schedule="zbv", act_offload=True)),
    "aoff-interleaved-compile": dict(matrix=True, door="compile", clip="dm",
                                     plan=dict(pp=2, dp=1, micro_batches=2, schedule="interleaved-1f1b",
                                               virtual_stages=2, act_offload=True)),
}
test_the_loop_trains_as_on_one_device_with_activations_on_the_host = harness.loop_test(__name__, CASES)


def _bytes(rank, world, method, pp):
    """One step of a Llama with every layer's activations offloaded: the host copies made (unique
    storages) and the saved bytes left on the device (pp > 1: the stage's tracker), beside the
    estimate's host and device activation bytes of this rank's stage."""
    import galvatron_fx as gfx
    from galvatron_fx.runtime.activation_offload import recording_offloaded

    model = loops.llama()
    batch = loops.collate(1)[0]
    gm = gfx.capture(model, (), kwargs=batch, method=method)
    plan = gfx.Plan.uniform(gm, world, pp=pp, micro_batches=pp, global_batch_size=loops.B, act_offload=True)
    dm = gfx.transform(gm, plan=plan)
    dm.track_memory = pp > 1
    with recording_offloaded() as copies:
        dm.train_step(**batch)
    host = sum({c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in copies}.values())
    # NOTE: the CPU's attention kernel is what ran here (the preset prices the GPU's by default)
    est = gfx.estimate(gm, plan, gfx.Cluster.preset(f"{world}xA100-80GB"), attention_target="cpu")
    stage = dm.stage_index if pp > 1 else 0
    stats = dm.schedule_stats if pp > 1 else {}
    return dict(host=host, predicted_host=est["host_bytes_per_device"][stage],
                device=stats.get("peak_saved_bytes", 0), predicted_device=est["per_device"]["activation_bytes"][stage],
                in_flight=stats.get("peak_in_flight", 1))


@pytest.mark.dist
@pytest.mark.parametrize("method, pp", [("dynamo", 1), ("export", 2)])
def test_the_host_holds_the_bytes_the_estimate_moves_there(method, pp):
    for r in run_distributed(_bytes, 2, method, pp):
        assert r["predicted_device"] == 0 and r["device"] == 0, r
        # the recorder holds every micro-batch's copies of the step, the estimate the peak in flight
        # NOTE: slack: a pipeline stage's loss layer saves its micro-batch's labels (768 B here)
        # the model prices with the whole batch's graph (tests/test_pipeline_dist.py: ~2 KiB)
        per_micro_batch = r["predicted_host"] / r["in_flight"]
        assert abs(r["host"] - pp * per_micro_batch) <= (64 if pp == 1 else 1024 * pp), r
        assert r["host"] > 100_000, r
