"""Per-rank memory of the distributed program vs the cost model's prediction (real gloo ranks).

For each plan: the bytes of parameters + gradients + optimizer states held by the live tensors after
one training step must equal the cost model's figure exactly (device and, under CPU offload, host), and the bytes saved for backward in
one micro-batch's forward (unique storages, parameters excluded; under selective checkpointing
also the outputs its regions keep) must be within 5 % of it.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training import apply_specs

GPT = dict(layers=2, hidden=64, heads=4, seq_len=32, vocab=128, batch=8)
BERT = dict(layers=2, hidden=64, heads=4, seq_len=16, vocab=96, batch=8)

PLANS = [  # label, micro-batches, per-layer spec cycled over the layers
    ("dp", 1, [dict()]),
    ("zero2", 2, [dict(sdp="zero2")]),
    ("zero3", 1, [dict(sdp="zero3")]),
    ("tp", 1, [dict(tp=4, dp=1)]),
    ("tp-sp", 1, [dict(tp=4, dp=1, sp=True)]),
    ("ckpt", 1, [dict(ckpt=True)]),
    ("dp2xtp2", 1, [dict(tp=2, dp=2)]),
    ("zero3xtp2", 2, [dict(tp=2, dp=2, sdp="zero3")]),
    ("hetero", 1, [dict(tp=4, dp=1, sp=True), dict(tp=2, dp=2, sdp="zero3", ckpt=True), dict(tp=1, dp=4, sdp="zero2")]),
    ("sac", 1, [dict(ckpt="selective")]),
    ("sac-tp-sp", 1, [dict(tp=4, dp=1, sp=True, ckpt="selective")]),
    ("sac-zero3xtp2", 2, [dict(tp=2, dp=2, sdp="zero3", ckpt="selective")]),
    ("sacop", 1, [dict(ckpt="selective-op")]),
    ("sacop-tp-sp", 1, [dict(tp=4, dp=1, sp=True, ckpt="selective-op")]),
    ("hsdp-zero2", 2, [dict(sdp="zero2", shard=2)]),
    ("hsdp-zero3", 1, [dict(sdp="zero3", shard=2)]),
    ("hsdp-mixed", 1, [dict(sdp="zero3", shard=2, ckpt="selective"), dict(sdp="zero2"), dict(sdp="zero3", shard=1)]),
    ("sac-mixed", 1, [dict(tp=2, dp=2, sp=True, ckpt="selective"), dict(tp=2, dp=2, sp=True, ckpt=True)]),
    ("offload-zero3", 1, [dict(sdp="zero3", offload="optimizer")]),
    ("offload-mixed", 2, [dict(sdp="zero2", offload="optimizer"), dict(tp=2, dp=2, sdp="zero3", offload="optimizer",
                                                                     ckpt="selective"),
                          dict(sdp="zero3", shard=2, offload="optimizer"), dict(sdp="zero3")]),
]


def _measure(rank, world, model_name, overrides, labels=None, precision="fp32", float8=False):
    import galvatron_fx as gfx
    from galvatron_fx.cost import CostModel
    from galvatron_fx.runtime.checkpointing import kept_tensors, recording_kept
    from galvatron_fx.runtime.groups import Layout
    from galvatron_fx.runtime.reshard import slice_input  # noqa: F401  (imported for the graph)

    model, args = gfx.models.build(model_name, device="cpu", **overrides)
    if float8:   # its linears as Float8 training runs them (tests/test_float8.py)
        from galvatron_fx.models.float8 import convert_to_float8

        convert_to_float8(model)
    gm = gfx.capture(model, args, method="fx")
    cm = CostModel(gm, gfx.Cluster.preset(f"{world}xA100-80GB"), reserve_bytes=0, precision=precision)
    out = {}
    for label, m, specs in PLANS:
        if labels and label not in labels:
            continue
        plan = gfx.Plan.uniform(gm, world, global_batch_size=args[0].shape[0], micro_batches=m, precision=precision)
        apply_specs(plan, specs)
        dm = gfx.transform(gm, plan=plan)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        dm.train_step(*args)
        opt.step()
        live = dm.states_bytes(opt)
        measured = (live["total"], live["host"])
        # NOTE: per rank: ZeRO shards hold ceil(rows / dp) rows per rank, the last ranks fewer. An
        # offloaded layer's gradient shard is on the device only from its backward to the step's
        # reduction (then on the host): not live at rest
        est = [(cm.states_bytes(i, s, dp_index=Layout(s.tp, s.dp).batch_index(rank) % s.shard), s.offload != "none")
               for i, s in enumerate(plan.layer_strategies())]
        predicted = (sum(e.total - (e.grads if off else 0) for e, off in est), sum(e.host for e, _ in est))
        # saved activations of one micro-batch's forward, parameter storages excluded (a ZeRO-3
        # buffer is re-allocated when gathered: look its storage up when a tensor is saved) and
        # the caller's input batch too (slices of it are views, not memory the program holds)
        seen: dict[int, int] = {}
        b = plan.micro_batch_size
        index, size = dm.input_shard   # the graph takes this rank's slice of a micro-batch
        inputs = [a[:b][index * b // size:(index + 1) * b // size] for a in args]
        caller = {a.untyped_storage().data_ptr() for a in inputs}

        def pack(t):
            st = t.untyped_storage()
            params = {p.untyped_storage().data_ptr() for p in dm.parameters()} | caller
            params |= {s.full.untyped_storage().data_ptr() for s in dm.stores if s.full is not None}
            if st.data_ptr() not in params and st.nbytes() > 0:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recording_kept() as regions:
            loss = dm(*inputs)
        for t in kept_tensors(regions):   # what selective checkpointing keeps outside autograd's saved tensors
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        loss.backward()  # release the graph (its gradients are not used)
        for s in dm.stores:
            s.zero_grad_state()
        act_pred = sum(cm.activation_bytes(i, s, b) for i, s in enumerate(plan.layer_strategies()))
        out[label] = (measured, predicted, sum(seen.values()), act_pred)
    return out


CI_PLANS = ["dp", "zero3", "tp-sp", "zero3xtp2", "hetero", "sac", "sac-tp-sp", "sacop-tp-sp", "sac-mixed", "offload-mixed"]   # CI time: --run-matrix measures all of PLANS


@pytest.mark.dist
@pytest.mark.parametrize("model_name, overrides, labels", [
    ("gpt-tiny", GPT, CI_PLANS),
    pytest.param("gpt-tiny", GPT, None, marks=pytest.mark.matrix),
    pytest.param("bert-huge-32", BERT, None, marks=pytest.mark.matrix)])   # CI time
def test_states_exact_and_activations_close(model_name, overrides, labels):
    results = run_distributed(_measure, 4, model_name, overrides, labels, timeout=180)
    for rank, res in enumerate(results):
        for label, (measured, predicted, act, act_pred) in res.items():
            assert measured == predicted, (rank, label, measured, predicted)
            assert (measured[1] > 0) == label.startswith("offload"), (rank, label, measured)
            assert abs(act - act_pred) <= 0.05 * act_pred, (rank, label, act, act_pred)


@pytest.mark.dist
def test_mixed_precision_states_exact_and_activations_close():
    """bf16-mixed: working copies + fp32 masters, gradients and moments byte-exact; activations in bf16."""
    labels = ["dp", "zero2", "zero3", "tp-sp", "ckpt", "zero3xtp2", "sac-zero3xtp2", "offload-mixed"]
    results = run_distributed(_measure, 4, "gpt-tiny", GPT, labels, "bf16-mixed", timeout=300)
    for rank, res in enumerate(results):
        assert sorted(res) == sorted(labels)
        for label, (measured, predicted, act, act_pred) in res.items():
            assert measured == predicted, (rank, label, measured, predicted)
            assert (measured[1] > 0) == label.startswith("offload"), (rank, label, measured)
            assert abs(act - act_pred) <= 0.05 * act_pred, (rank, label, act, act_pred)
