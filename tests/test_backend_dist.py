"""``torch.compile(model, backend="galvatron")`` on 2 gloo ranks: HF GPT-2 / BERT train like eager.

Each run builds a small transformers model (no downloads, dropout off), trains 5 AdamW steps eagerly
on one device as the reference, then compiles the same initial model with the galvatron backend
(``fullgraph=True``, plan file in options) and trains 5 steps with an optimizer built from
``model.parameters()`` *before* compiling.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist_utils import run_distributed

STEPS, LR, EPS, TOL = 5, 1e-3, 1e-6, 1e-5


def _hf_model(kind: str):
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, use_cache=False,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                         vocab_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        model = BertForMaskedLM(cfg)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    labels = torch.randint(0, 64, (4, 8), generator=g)
    return model, ids, labels


def _train(step_fn, params, steps=STEPS):
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = step_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compiled_run(rank, world_size, kind, sdp, plan_dir):
    import galvatron_fx as gfx
    from galvatron_fx import backend

    model, ids, labels = _hf_model(kind)
    ref_model = copy.deepcopy(model)
    ref = _train(lambda: ref_model(ids, labels=labels).loss, ref_model.parameters())
    gm = gfx.capture(model, (ids,), {"labels": labels}, method="dynamo")
    path = f"{plan_dir}/{kind}-{sdp}.json"
    if rank == 0:
        gfx.Plan.uniform(gm, world_size, sdp=sdp, global_batch_size=ids.shape[0]).save(path)
    torch.distributed.barrier()
    full = {n: p.numel() for n, p in model.named_parameters()}
    params = list(model.parameters())  # the optimizer's parameters, taken before compiling
    compiled = torch.compile(model, backend="galvatron", fullgraph=True, dynamic=False,
                             options={"plan": path, "memory_budget": "1GiB"})

    def _search_forbidden(*_a, **_k):
        raise AssertionError("the backend searched although a plan was given")

    search, backend.agreement._search = backend.agreement._search, _search_forbidden
    try:
        losses = _train(lambda: compiled(ids, labels=labels).loss, params)
    finally:
        backend.agreement._search = search   # the rank processes are pooled (tests/dist_utils.py)
    local = {n: p.numel() for n, p in model.named_parameters()}
    sd = backend.full_state_dict(model)
    ref_sd = dict(ref_model.named_parameters())
    # NOTE: all parameters as one vector (as tests/test_transform_dist.py): the attention key bias has
    # a mathematically zero gradient, so Adam turns round-off into updates of that one tensor
    diff = torch.cat([(sd[k] - p).flatten() for k, p in ref_sd.items()])
    err = (diff.norm() / torch.cat([p.detach().flatten() for p in ref_sd.values()]).norm()).item()
    return {"ref": ref, "losses": losses, "stats": dict(backend.stats), "full": full, "local": local,
            "grads": all(p.grad is not None and p.grad.shape == p.shape for p in params), "param_err": err}


def _check(results, sharded: bool):
    for r in results:
        assert r["stats"] == {"compiles": 1, "searches": 0}, r["stats"]   # one compile, no search
        assert r["grads"]
        for a, b in zip(r["losses"], r["ref"]):
            assert abs(a - b) <= TOL * abs(b), (r["losses"], r["ref"])
        assert r["param_err"] <= TOL, r["param_err"]
    if sharded:  # ZeRO-3: each rank's Parameter objects hold only its shard of every parameter
        total = {k: sum(r["local"][k] for r in results) for k in results[0]["full"]}
        assert all(total[k] == results[0]["full"][k] for k in total)
        assert sum(results[0]["local"].values()) < sum(results[0]["full"].values())


@pytest.mark.dist
@pytest.mark.parametrize("kind, sdp", [pytest.param("gpt2", "zero3", marks=pytest.mark.matrix),
                                       pytest.param("bert", "zero2", marks=pytest.mark.matrix)])  # CI time
def test_backend_trains_like_eager(kind, sdp, tmp_path):
    pytest.importorskip("transformers")
    results = run_distributed(_compiled_run, 2, kind, sdp, str(tmp_path), timeout=120)
    _check(results, sharded=(sdp == "zero3"))


def _compiled_pipeline_run(rank, world_size, how, plan_dir):
    """GPT-2 under a pp = 2 plan: from a plan file (made with gfx.capture + Plan.uniform) or from
    the backend's own search constrained to pp = 2."""
    import galvatron_fx as gfx
    from galvatron_fx import backend

    model, ids, labels = _hf_model("gpt2")
    ref_model = copy.deepcopy(model)
    ref = _train(lambda: ref_model(ids, labels=labels).loss, ref_model.parameters())
    options = {"cluster": f"{world_size}xA100-80GB", "memory_budget": "2GiB", "precision": "fp32"}
    if how == "plan":
        gm = gfx.capture(model, (ids,), {"labels": labels}, method="dynamo")
        path = f"{plan_dir}/gpt2-pp2.json"
        if rank == 0:
            gfx.Plan.uniform(gm, world_size, pp=2, dp=world_size // 2, micro_batches=2,
                             global_batch_size=ids.shape[0]).save(path)
        torch.distributed.barrier()
        options = {"plan": path}
    else:
        options["constraints"] = {"pp": 2}
    params = list(model.parameters())
    compiled = torch.compile(model, backend="galvatron", fullgraph=True, dynamic=False, options=options)
    losses = _train(lambda: compiled(ids, labels=labels).loss, params)
    dm = backend.distributed_model(model)
    sd = backend.full_state_dict(model)
    ref_sd = dict(ref_model.named_parameters())
    diff = torch.cat([(sd[k] - p).flatten() for k, p in ref_sd.items()])
    err = (diff.norm() / torch.cat([p.detach().flatten() for p in ref_sd.values()]).norm()).item()
    return {"ref": ref, "losses": losses, "pp": dm.plan.pp, "passes": dm.passes, "param_err": err,
            "searches": backend.stats["searches"]}


@pytest.mark.dist
@pytest.mark.parametrize("how", [pytest.param("plan", marks=pytest.mark.matrix), "search"])  # CI: the search
def test_backend_pipeline_plan_trains_like_eager(how, tmp_path):
    pytest.importorskip("transformers")
    results = run_distributed(_compiled_pipeline_run, 2, how, str(tmp_path), timeout=180)
    for r in results:
        assert r["pp"] == 2 and r["passes"][1] == "stage_split" and r["passes"][-1] == "bind_parameters"
        for a, b in zip(r["losses"], r["ref"]):
            assert abs(a - b) <= TOL * abs(b), (r["losses"], r["ref"])
        assert r["param_err"] <= TOL, r["param_err"]
    assert results[0]["searches"] == (1 if how == "search" else 0)


def _mismatch(rank, world_size, plan_dir):
    import galvatron_fx as gfx

    model, ids, labels = _hf_model("gpt2")
    gm = gfx.capture(model, (ids,), {"labels": labels}, method="dynamo")
    path = f"{plan_dir}/plan-{rank}.json"
    gfx.Plan.uniform(gm, world_size, sdp="zero3" if rank else "none", global_batch_size=4).save(path)
    shapes = [tuple(p.shape) for p in model.parameters()]
    compiled = torch.compile(model, backend="galvatron", fullgraph=True, dynamic=False, options={"plan": path})
    try:
        compiled(ids, labels=labels)
    except Exception as exc:  # noqa: BLE001 - dynamo wraps the backend's error
        return str(exc), shapes == [tuple(p.shape) for p in model.parameters()]
    return "", False


@pytest.mark.dist
def test_backend_refuses_mismatched_plans(tmp_path):
    pytest.importorskip("transformers")
    for msg, untouched in run_distributed(_mismatch, 2, str(tmp_path), timeout=90):
        assert "PlanMismatchError" in msg and "disagree" in msg, msg
        assert untouched  # refused before the first step: no parameter was resharded


def _default_precision_run(rank, world_size):
    """One call of GPT-2 compiled on an A100 preset without ``precision``, then with ``fp32``: the
    warnings each first call gives and the precision each plan trains in."""
    import warnings

    from galvatron_fx import backend

    out = []
    for extra in ({}, {"precision": "fp32"}):
        model, ids, labels = _hf_model("gpt2")
        compiled = torch.compile(model, backend="galvatron", fullgraph=True, dynamic=False,
                                 options={"cluster": f"{world_size}xA100-80GB", "memory_budget": "2GiB", **extra})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(ids, labels=labels).loss.backward()
        out.append({"precision": backend.distributed_model(model).plan.precision,
                    "warned": [str(w.message) for w in caught if "by default, but this world" in str(w.message)]})
    return out


@pytest.mark.dist
def test_a_gpu_preset_default_precision_on_a_cpu_world_is_said():
    """An A100 preset trains bf16-mixed by default (what A100 users train in); on a CPU world, where
    bf16 matmuls are far slower, the backend says so and names the option; fp32 given: no warning."""
    pytest.importorskip("transformers")
    for default, pinned in run_distributed(_default_precision_run, 2, timeout=120):
        assert default["precision"] == "bf16-mixed" and len(default["warned"]) == 1
        assert "'precision': 'fp32'" in default["warned"][0] and "2xA100-80GB" in default["warned"][0]
        assert pinned == {"precision": "fp32", "warned": []}


def _door(rank, world):
    import dataclasses

    import galvatron_fx as gfx
    from galvatron_fx.backend import agreement, distributed_model, door

    profiled = door.profile_with_door(progress=False, repeats=1)   # Cluster.profile + the door
    figures = {k: getattr(profiled, k) for k in ("door_call_s", "door_param_s")}
    cluster = gfx.Cluster.preset("2xA100-80GB")
    # a searched plan gets the door in its estimate, once (a plan saved with it is not charged again)
    torch.manual_seed(0)
    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, hidden=32, heads=2, seq_len=16, vocab=64,
                                   batch=4)
    priced = dataclasses.replace(cluster, door_call_s=1e-3, door_param_s=1e-5)
    compiled = torch.compile(model, backend="galvatron", fullgraph=True,
                             options={"cluster": priced, "precision": "fp32", "memory_budget": "4GiB"})
    compiled(*args).backward()
    plan = distributed_model(compiled).plan
    tensors = sum(p.requires_grad for p in model.parameters())
    again = agreement._with_door(plan, tensors)
    return figures, plan.estimate, tensors, again.estimate == plan.estimate


@pytest.mark.dist
def test_the_compile_door_is_measured_and_priced_once():
    """``profile_with_door`` (``galvatron-fx profile`` from Python) profiles the world and times the
    real door (two small models through the backend, against their own ``train_step``) into a
    positive per-step cost for gpt-tiny's tensors; a searched plan's estimate
    carries ``door_s = door_call_s + tensors * door_param_s``, once."""
    (figures, est, tensors, unchanged), _ = run_distributed(_door, 2, timeout=300)
    assert set(figures) == {"door_call_s", "door_param_s"}
    assert 0 < figures["door_call_s"] + 60 * figures["door_param_s"] < 0.05   # 2026-12-03: ~0.9 ms here
    assert est["door_s"] == pytest.approx(1e-3 + tensors * 1e-5)
    assert est["throughput_samples_s"] == pytest.approx(4 / est["step_time_s"])
    assert unchanged


def _single_device():
    import warnings

    model, ids, labels = _hf_model("gpt2")
    ref = copy.deepcopy(model)(ids, labels=labels).loss.item()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend="galvatron", fullgraph=True)(ids, labels=labels).loss.item()
    return ref, loss, [str(w.message) for w in seen]


def test_backend_without_distributed_runs_single_device():
    pytest.importorskip("transformers")
    ref, loss, seen = _single_device()
    assert abs(ref - loss) <= 1e-6 * abs(ref)
    assert any("not initialised" in m for m in seen)


def test_backend_registered_by_entry_point():
    import subprocess
    import sys

    code = ("import torch; from torch._dynamo.backends.registry import lookup_backend; "
            "f = lookup_backend('galvatron'); print(f.__module__, 'galvatron_fx' in __import__('sys').modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "galvatron_fx.backend"


def test_backend_rejects_unknown_options():
    from galvatron_fx.backend import BackendOptions
    from galvatron_fx.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown galvatron backend option"):
        BackendOptions.parse({"memory_budgett": "1GiB"})
    with pytest.raises(ConfigError, match="global_batch_size"):
        BackendOptions.parse({"global_batch_size": 0})


def _capture_methods(rank, world_size, method):
    import galvatron_fx as gfx
    from galvatron_fx.parallelize import transform

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=4)
    ref_model = copy.deepcopy(model)
    ref = _train(lambda: ref_model(*args), ref_model.parameters(), steps=3)
    gm = gfx.capture(model, args, method=method)
    dm = transform(gm, plan=gfx.Plan.uniform(gm, world_size, sdp="zero3", global_batch_size=4))
    opt = dm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses = []
    for _ in range(3):
        losses.append(dm.train_step(*args).item())
        opt.step()
    return ref, losses


@pytest.mark.dist
@pytest.mark.parametrize("method", ["fx", *(pytest.param(m, marks=pytest.mark.matrix) for m in ("dynamo", "export"))])
def test_transform_accepts_every_capture_method(method):
    # NOTE: CI runs fx here; dynamo and export train in CI through test_frontend_matrix_dist.py
    for ref, losses in run_distributed(_capture_methods, 2, method, timeout=90):
        for a, b in zip(losses, ref):
            assert abs(a - b) <= TOL * abs(b), (method, losses, ref)
