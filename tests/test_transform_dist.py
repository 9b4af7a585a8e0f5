"""gfx.transform (pp = 1) on real gloo ranks: every plan trains exactly like one device.

Each spawned run builds a zoo model, trains it 5 AdamW steps on one device as the reference, then
for several plans transforms the captured graph and checks every step's loss and the final gathered
parameters (relative error of all parameters as one vector) against the reference.

Plans with ``tp > 1`` run here with an *identity* tensor-parallel pass (each TP rank computes the
whole layer on its batch slice, which is mathematically the same), which exercises the rank layout,
the per-layer DP groups and the resharding between layouts (tp4 -> tp2·dp2 -> dp4, tied weights
crossing layouts) independently of the tensor-parallel rewrite.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training import EPS, LR, STEPS, TOL, apply_specs, reference, transform

BERT = dict(layers=2, hidden=64, heads=4, seq_len=16, vocab=96, batch=8)
GPT = dict(layers=2, batch=8)





def _run_cases(rank, world_size, model_name, overrides, cases, real_tp=False):
    import galvatron_fx as gfx

    model, args = gfx.models.build(model_name, device="cpu", **overrides)
    gm = gfx.capture(model, args, method="fx")  # NOTE: same normal form as dynamo, faster on 2 cores
    ref_losses, ref_params = reference(copy.deepcopy(model), args)  # gm holds model's tensors
    results = {}
    for label, micro_batches, specs in cases:
        plan = gfx.Plan.uniform(gm, world_size, global_batch_size=args[0].shape[0], micro_batches=micro_batches)
        apply_specs(plan, specs)
        dm = transform(gm, plan, real_tp)
        opt = dm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        t0 = time.perf_counter()
        losses = []
        for _ in range(STEPS):
            losses.append(dm.train_step(*args).item())
            opt.step()
        sd = dm.full_state_dict()
        diff = torch.cat([(sd[k] - p).flatten() for k, p in ref_params.items()])
        ref = torch.cat([p.flatten() for p in ref_params.values()])
        results[label] = {
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": (diff.norm() / ref.norm()).item(),
            "keys_ok": set(sd) == set(ref_params),
            "states": dm.states_bytes(opt),
            "seconds": time.perf_counter() - t0,
            "code": dm.code if rank == 0 else "",
        }
    return results


def _uniform(**spec):
    return [spec]


def _cycle(*specs):
    return list(specs)


def _check(results):
    for rank_results in results:
        for label, r in rank_results.items():
            assert r["keys_ok"], label
            assert r["loss_err"] <= TOL, (label, r)
            assert r["param_err"] <= TOL, (label, r)


CASES_2 = [
    ("dp", 1, _uniform(sdp="none")),
    ("zero2", 2, _uniform(sdp="zero2")),
    ("zero3", 1, _uniform(sdp="zero3")),
    ("dp-ckpt", 2, _uniform(sdp="none", ckpt=True)),
    ("zero3-ckpt", 1, _uniform(sdp="zero3", ckpt=True)),
    ("hetero", 2, _cycle(dict(sdp="zero3"), dict(sdp="none", ckpt=True), dict(sdp="zero2"),
                         dict(sdp="zero3", ckpt=True))),
]

TP2 = dict(tp=2, dp=2)
TP4 = dict(tp=4, dp=1)
CASES_4 = [
    ("dp", 2, _uniform(sdp="none")),
    ("zero3-ckpt", 1, _uniform(sdp="zero3", ckpt=True)),
    # layouts change between layers: dp4 -> tp2·dp2 -> tp4 -> dp4 (batch gathered and sliced)
    ("layouts", 2, _cycle(dict(sdp="zero3"), dict(TP2, sdp="zero2", ckpt=True), dict(TP4),
                          dict(sdp="none", ckpt=True))),
    ("layouts-2", 1, _cycle(dict(TP4, sdp="none"), dict(TP2, sdp="zero3"), dict(sdp="zero2"),
                            dict(TP2, sdp="none"))),
]


@pytest.mark.dist
@pytest.mark.parametrize("model_name, overrides", [("gpt-tiny", GPT), ("bert-huge-32", BERT)])
def test_transform_world2(model_name, overrides):
    results = run_distributed(_run_cases, 2, model_name, overrides, CASES_2, timeout=90)
    _check(results)
    code = results[0]["hetero"]["code"]
    # NOTE: graph inputs arrive as this rank's slice (runtime/inputs.py): no slicing in the graph
    # for DP readers; a layer of another layout gathers or takes what it needs
    assert "self.layers_0(" in code and "checkpoint_layer(" in code and "slice_input(" not in code


@pytest.mark.dist
@pytest.mark.parametrize("model_name, overrides", [
    # NOTE: CI time: per-layer DP changes at world 4 run in CI in test_transform_tensor_parallel_world4
    pytest.param("gpt-tiny", GPT, marks=pytest.mark.matrix),
    pytest.param("bert-huge-32", BERT, marks=pytest.mark.matrix)])
def test_transform_world4(model_name, overrides):
    results = run_distributed(_run_cases, 4, model_name, overrides, CASES_4, timeout=90)
    _check(results)
    code = results[0]["layouts"]["code"]
    assert "reshard_gather(" in code and "reshard_take(" in code


CASES_TP = [
    ("tp2-dp2", 2, _uniform(tp=2, dp=2)),
    ("tp2-sp-zero3", 1, _uniform(tp=2, dp=2, sp=True, sdp="zero3")),
    # different TP per layer forces resharding (tp4 -> tp2·dp2 -> dp4 -> tp2·dp2)
    ("tp-per-layer", 2, _cycle(dict(tp=4, dp=1), dict(tp=2, dp=2, ckpt=True), dict(tp=1, dp=4, sdp="zero2"),
                               dict(tp=2, dp=2, sdp="zero3"))),
    # sequence parallel switching on and off between layers whose batch slices differ too
    ("mixed-sp", 1, _cycle(dict(tp=4, dp=1, sp=True), dict(tp=2, dp=2), dict(tp=2, dp=2, sp=True),
                           dict(tp=1, dp=4))),
    ("mixed-sp-2", 2, _cycle(dict(tp=1, dp=4), dict(tp=2, dp=2, sp=True, sdp="zero3"), dict(tp=4, dp=1),
                             dict(tp=4, dp=1, sp=True))),
]


@pytest.mark.dist
@pytest.mark.parametrize("model_name, overrides", [
    ("gpt-tiny", dict(GPT, layers=2, batch=8)),
    pytest.param("bert-huge-32", BERT, marks=pytest.mark.matrix)])   # NOTE: CI time, as above
def test_transform_tensor_parallel_world4(model_name, overrides):
    results = run_distributed(_run_cases, 4, model_name, overrides, CASES_TP, True, timeout=150)
    _check(results)


def _errors(rank, world_size):
    import galvatron_fx as gfx
    from galvatron_fx.parallelize import transform

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=1)
    gm = gfx.capture(model, args, method="fx")
    seen = []
    for plan in (gfx.Plan.uniform(gm, world_size * 2),
                 gfx.Plan.uniform_from_layer_names(["a", "b", "c"], world_size),
                 gfx.Plan.uniform_from_layer_names([r.name for r in gfx.layers(gm)], world_size,
                                                   model_fingerprint="not-this-model")):
        try:
            transform(gm, plan=plan)
        except gfx.PlanMismatchError as exc:
            seen.append(str(exc))
    return seen


@pytest.mark.dist
def test_transform_rejects_mismatched_plans():
    seen = run_distributed(_errors, 2, timeout=60)[0]
    assert len(seen) == 3
    assert "world_size" in seen[0] and "layers differ" in seen[1] and "fingerprint" in seen[2]
