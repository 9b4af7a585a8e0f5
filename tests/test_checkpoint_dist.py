"""gfx.checkpoint on real gloo ranks: exact resume, loading across plans, consolidation, and a save
interrupted by a SIGKILLed rank.

``_resume_cases`` trains gpt-tiny under a source plan for ``BEFORE`` steps, saves, and keeps training
``AFTER`` steps (the uninterrupted reference). It then builds the model again under the same plan,
loads, and trains ``AFTER`` steps: losses and parameters must be *bit-identical* (CPU fp32). Then
under another plan (DP2 -> TP2, TP2 -> PP2, ZeRO-3 -> a searched plan): losses within ``TOL``.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.dist_utils import DistributedTestError, run_distributed

BEFORE, AFTER = 2, 2
LR, EPS = 1e-3, 1e-6   # eps: see tests/test_transform_dist.py
TOL = 1e-5
GPT = dict(layers=2, batch=8)


def _plan(gfx, gm, world_size, spec):
    if spec == "searched":
        return gfx.search(gm, gfx.Cluster.preset(f"{world_size}xA100-80GB"), "16GiB", 8, precision="fp32")
    spec = dict(spec)
    return gfx.Plan.uniform(gm, world_size, global_batch_size=8, **spec)


def _steps(dm, opt, args, n):
    losses = []
    for _ in range(n):
        losses.append(dm.train_step(*args).item())
        opt.step()
    return losses


def _build(gfx, gm, world_size, spec):
    dm = gfx.transform(gm, plan=_plan(gfx, gm, world_size, spec))
    # NOTE: weight_decay and a non-default beta make every restored hyper-parameter matter
    return dm, dm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS, betas=(0.8, 0.99), weight_decay=0.1)


def _resume_cases(rank, world_size, root, cases):
    import galvatron_fx as gfx
    from galvatron_fx import checkpoint

    model, args = gfx.models.build("gpt-tiny", device="cpu", **GPT)
    gm = gfx.capture(model, args, method="fx")
    out = {}
    for label, src, dst in cases:   # NOTE: "searched" runs after tp > 1 transforms of gm (regression)
        path = os.path.join(root, label)
        dm, opt = _build(gfx, gm, world_size, src)
        _steps(dm, opt, args, BEFORE)
        checkpoint.save(dm, opt, path, step=BEFORE)
        saved = dm.full_state_dict()
        ref = _steps(dm, opt, args, AFTER)
        ref_params = dm.full_state_dict()

        dm, opt = _build(gfx, gm, world_size, src)          # same plan: bit for bit
        step = checkpoint.load(dm, opt, path)
        same = _steps(dm, opt, args, AFTER)
        params = dm.full_state_dict()
        exact = same == ref and all(torch.equal(params[k], v) for k, v in ref_params.items())

        dm, opt = _build(gfx, gm, world_size, dst)          # another plan: same losses
        checkpoint.load(dm, opt, path)
        other = _steps(dm, opt, args, AFTER)
        out[label] = dict(step=step, exact=exact, ref=ref, same=same, other=other,
                          other_plan=[(lp.tp, lp.dp, lp.sdp) for lp in dm.plan.layers] + [dm.plan.pp],
                          saved={k: v.numpy().copy() for k, v in saved.items()} if rank == 0 else None)
    return out


CASES = [
    ("dp2-to-tp2", dict(sdp="none"), dict(tp=2, dp=1)),
    ("tp2-to-pp2", dict(tp=2, dp=1, micro_batches=2), dict(pp=2, micro_batches=2)),
    ("zero3-to-searched", dict(sdp="zero3", ckpt=True), "searched"),
    ("zero2-to-zero3", dict(sdp="zero2", micro_batches=2), dict(sdp="zero3")),
    # NOTE: into ZeRO-2 with a plain torch.optim optimizer (dm.optimizer is only a convenience):
    # the shards it updates are re-gathered at the next step, no hook needed
    ("dp2-to-zero2", dict(sdp="none"), dict(sdp="zero2")),
]


@pytest.mark.dist
def test_resume_exact_and_cross_plan_and_consolidate(tmp_path):
    import galvatron_fx as gfx
    from galvatron_fx import checkpoint

    results = run_distributed(_resume_cases, 2, str(tmp_path), CASES, timeout=170)
    for label, r in results[0].items():
        assert r["step"] == BEFORE, label
        assert r["exact"], (label, r["ref"], r["same"])
        err = max(abs(a - b) / abs(b) for a, b in zip(r["other"], r["ref"]))
        assert err <= TOL, (label, r["ref"], r["other"])
    assert results[0]["tp2-to-pp2"]["other_plan"][-1] == 2
    # consolidation: one process, no process group, into the original nn.Module
    model, args = gfx.models.build("gpt-tiny", device="cpu", **GPT)
    for label, r in results[0].items():
        state = checkpoint.consolidate(tmp_path / label)
        assert set(state) == set(r["saved"]), label
        assert all(torch.equal(state[k], torch.from_numpy(v)) for k, v in r["saved"].items()), label
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
    full = checkpoint.consolidate(tmp_path / "dp2-to-tp2", optimizer=True)
    assert any(k.endswith(".exp_avg_sq") for k in full) and any(k.endswith(".step") for k in full)
    assert checkpoint.latest(tmp_path) is not None


# ----------------------------------------------------------------------- interrupted save
def _kill_mid_save(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    import galvatron_fx as gfx
    from galvatron_fx import checkpoint

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=1, batch=4)
    gm = gfx.capture(model, args, method="fx")
    dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world_size, global_batch_size=4, sdp="zero3"))
    opt = dm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    _steps(dm, opt, args, 1)
    checkpoint.save(dm, opt, path, step=1)              # complete
    _steps(dm, opt, args, 1)
    if rank == 1:   # die after writing this rank's data files, before the save completes
        write = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            fut = write(self, plan, planner)
            fut.wait()
            os.kill(os.getpid(), signal.SIGKILL)
            return fut

        dcp.FileSystemWriter.write_data = write_then_die
    checkpoint.save(dm, opt, path, step=2)              # overwrites path: never happens
    return "not killed"


def _resume_after_kill(rank, world_size, path):
    import galvatron_fx as gfx
    from galvatron_fx import checkpoint

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=1, batch=4)
    gm = gfx.capture(model, args, method="fx")
    dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world_size, global_batch_size=4, tp=2, dp=1))
    opt = dm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    step = checkpoint.load(dm, opt, path)
    return step, dm.train_step(*args).item()


@pytest.mark.dist
def test_interrupted_save_is_never_loaded_and_previous_survives(tmp_path):
    from galvatron_fx import checkpoint

    path = str(tmp_path / "ckpt")
    with pytest.raises(DistributedTestError):
        run_distributed(_kill_mid_save, 2, path, timeout=90)
    tmp = path + ".tmp-2"
    assert os.path.isdir(tmp) and os.listdir(tmp)          # rank 1's data files are there
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="incomplete.*never loaded"):
        checkpoint.consolidate(tmp)
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="incomplete"):
        checkpoint.load(None, None, tmp)                    # refused before any collective
    assert checkpoint.latest(tmp_path) == path
    assert checkpoint.read_marker(path)["step"] == 1
    step, loss = run_distributed(_resume_after_kill, 2, path, timeout=60)[0]
    assert step == 1 and loss == loss


def test_missing_checkpoint_names_the_interrupted_save(tmp_path):
    from galvatron_fx import checkpoint

    os.makedirs(tmp_path / "ck.tmp-7")
    with pytest.raises(checkpoint.ConfigError, match=r"no checkpoint at .*ck\.tmp-7.*never loaded"):
        checkpoint.consolidate(tmp_path / "ck")
