"""gfx.checkpoint on real gloo ranks: sharded saves, exact and cross-plan resume, async saves,
consolidation, and saves interrupted by a SIGKILLed rank.

``_resume_cases`` trains gpt-tiny under a source plan for ``BEFORE`` steps, saves, and keeps training
``AFTER`` steps (the uninterrupted reference). It then builds the model again under the same plan,
loads, and trains ``AFTER`` steps: losses and parameters must be *bit-identical* (CPU fp32). Then
under another plan: losses within ``TOL`` of the reference. Each saved checkpoint's DCP metadata
must show every rank writing only its own share (no gathered whole tensors).
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
    return gfx.Plan.uniform(gm, world_size, global_batch_size=8, **dict(spec))


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


def _gpt(gfx):
    model, args = gfx.models.build("gpt-tiny", device="cpu", **GPT)
    return gfx.capture(model, args, method="fx"), args


def _resume_cases(rank, world_size, root, cases, async_case=None):
    import galvatron_fx as gfx
    from galvatron_fx import checkpoint

    gm, args = _gpt(gfx)
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
    if async_case is not None:
        out["async"] = _async_save(gfx, checkpoint, gm, args, world_size, os.path.join(root, "async"), async_case)
    return out


def _async_save(gfx, checkpoint, gm, args, world_size, path, spec):
    """Save asynchronously, keep training until the save completes, then load what it saved.

    The save's writes wait for a gate the training loop opens after its first step: a save that
    runs beside training writes once the step is done (``overlapped``: steps that ran while it was
    pending), one that blocks the loop waits for the gate in vain (``gate_opened`` False after the
    timeout). A gate rather than a race against the clock: on a fast host the writes could finish
    before a step does."""
    import threading

    from galvatron_fx.runtime.sharded_state import CommittingWriter

    gate, gate_opened = threading.Event(), []
    write_data = CommittingWriter.write_data

    def gated(self, *a, **k):
        gate_opened.append(gate.wait(timeout=60))
        return write_data(self, *a, **k)

    dm, opt = _build(gfx, gm, world_size, spec)
    _steps(dm, opt, args, BEFORE)
    CommittingWriter.write_data = gated
    try:
        pending = checkpoint.save(dm, opt, path, step=BEFORE, async_save=True)
        ref, overlapped = [], 0
        for _ in range(AFTER):   # NOTE: a fixed count: every rank must run the same collectives
            ref += _steps(dm, opt, args, 1)
            overlapped += not pending.done()   # a whole step ran while the save was still pending
            gate.set()
        assert pending.result() == path
    finally:
        CommittingWriter.write_data = write_data
    dm, opt = _build(gfx, gm, world_size, spec)
    checkpoint.load(dm, opt, path)
    return dict(overlapped=overlapped, gate_opened=gate_opened, ref=ref[:AFTER],
                resumed=_steps(dm, opt, args, AFTER))


def _chunk_report(path):
    """Per checkpoint: the fraction of the bytes of tensors with >= 4096 elements stored as chunks
    smaller than the tensor, and the bytes each rank's data file holds."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(path)).read_metadata()
    total = partial = 0
    per_file: dict[str, int] = {}
    for m in md.state_dict_metadata.values():
        if not hasattr(m, "chunks"):
            continue
        n = m.size.numel() * m.properties.dtype.itemsize
        if m.size.numel() >= 4096:
            total += n
            partial += sum(c.sizes.numel() * m.properties.dtype.itemsize for c in m.chunks if c.sizes != m.size)
    for index, info in md.storage_data.items():
        if index.fqn.startswith("model.") and len(index.offset or ()):
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
    return partial / total, per_file


def _check(results, tol=TOL):
    for label, r in results.items():
        if label == "async":
            continue
        assert r["step"] == BEFORE, label
        assert r["exact"], (label, r["ref"], r["same"])
        err = max(abs(a - b) / abs(b) for a, b in zip(r["other"], r["ref"]))
        assert err <= tol, (label, err, r["ref"], r["other"])
        print(f"{label}: exact same-plan resume; other plan rel err {err:.1e}")


# NOTE: CI runs the two sharded plans of the acceptance (ZeRO-3, TP2) into other plans, ZeRO-2 among
# them, and the async save; the rest of the matrix runs with --run-matrix
CI_CASES = [
    ("zero3-to-tp2", dict(sdp="zero3"), dict(tp=2, dp=1)),
    ("tp2-to-zero2", dict(tp=2, dp=1), dict(sdp="zero2")),
]
MATRIX_CASES = [
    ("dp2-to-zero2", dict(sdp="none"), dict(sdp="zero2")),
    ("zero2-to-zero2", dict(sdp="zero2", micro_batches=2), dict(sdp="zero2")),
    ("pp2-to-zero3", dict(pp=2, micro_batches=2), dict(sdp="zero3")),
    ("dp2-to-tp2", dict(sdp="none"), dict(tp=2, dp=1)),
    ("tp2-to-pp2", dict(tp=2, dp=1, micro_batches=2), dict(pp=2, micro_batches=2)),
    ("zero3-to-searched", dict(sdp="zero3", ckpt=True), "searched"),
    ("zero2-to-zero3", dict(sdp="zero2", micro_batches=2), dict(sdp="zero3")),
]


@pytest.mark.dist
def test_sharded_resume_cross_plan_async_and_consolidate(tmp_path):
    import galvatron_fx as gfx
    from galvatron_fx import checkpoint
    from galvatron_fx.cli import main

    results = run_distributed(_resume_cases, 2, str(tmp_path), CI_CASES, dict(sdp="zero3"), timeout=300)[0]
    _check(results)
    a = results["async"]
    assert a["gate_opened"] == [True] and a["overlapped"] >= 1 and a["resumed"] == a["ref"], a
    print(f"async save: {a['overlapped']} training step(s) ran while it was written")
    # sharded: each rank wrote its half of the parameters' bytes, and no whole-tensor gather
    for label in results:
        if label == "async":
            continue
        frac, per_file = _chunk_report(tmp_path / label)
        print(f"{label}: {frac:.2f} of the big tensors' bytes in partial chunks; bytes per rank file {per_file}")
        assert len(per_file) == 2, per_file
        lo, hi = min(per_file.values()), max(per_file.values())
        assert hi <= 1.25 * lo, per_file
        assert frac >= 0.9, (label, frac)   # ZeRO-3 and TP2: every rank's dim-0 / TP slice of each tensor
    # consolidation: one process, no process group, into the original nn.Module, and as safetensors
    model, _ = gfx.models.build("gpt-tiny", device="cpu", **GPT)
    for label in ("zero3-to-tp2", "tp2-to-zero2"):
        state = checkpoint.consolidate(tmp_path / label)
        saved = results[label]["saved"]
        assert set(state) == set(saved), label
        assert all(torch.equal(state[k], torch.from_numpy(v)) for k, v in saved.items()), label
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
    assert main(["consolidate", str(tmp_path / "tp2-to-zero2"), "--out", str(tmp_path / "export")]) == 0
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert set(exported) == set(state) and all(torch.equal(exported[k], v) for k, v in state.items())
    full = checkpoint.consolidate(tmp_path / "zero3-to-tp2", optimizer=True)
    assert any(k.endswith(".exp_avg_sq") for k in full) and any(k.endswith(".step") for k in full)
    assert checkpoint.latest(tmp_path) is not None


@pytest.mark.dist
@pytest.mark.matrix
def test_resume_matrix(tmp_path):
    results = run_distributed(_resume_cases, 2, str(tmp_path), MATRIX_CASES, timeout=900)[0]
    _check(results)
    assert results["tp2-to-pp2"]["other_plan"][-1] == 2
    for label in ("dp2-to-zero2", "zero2-to-zero2", "pp2-to-zero3", "zero3-to-searched"):
        frac, per_file = _chunk_report(tmp_path / label)
        assert len(per_file) == 2, (label, per_file)


@pytest.mark.dist
def test_interleaved_pipeline_resumes_exactly_and_into_another_plan(tmp_path):
    # interleaved 1F1B: each rank's two chunks save and load as one stage (runtime/chunk_set.py)
    cases = [("interleaved-to-zero2", dict(pp=2, micro_batches=2, schedule="interleaved-1f1b", virtual_stages=2),
              dict(sdp="zero2"))]
    results = run_distributed(_resume_cases, 2, str(tmp_path), cases, timeout=300)[0]
    _check(results)
    assert results["interleaved-to-zero2"]["other_plan"][-1] == 1


BF16_CASES = [
    ("bf16-zero3-to-dp2", dict(sdp="zero3", precision="bf16-mixed"), dict(sdp="none", precision="bf16-mixed")),
    ("bf16-tp2-to-zero2", dict(tp=2, dp=1, precision="bf16-mixed"), dict(sdp="zero2", precision="bf16-mixed")),
]


@pytest.mark.dist
@pytest.mark.matrix
def test_resume_bf16_mixed_from_fp32_masters(tmp_path):
    # the masters are saved; the working copies are rebuilt on load (ZeRO-2 gather, DP cast)
    # NOTE: across TP degrees bf16 rounds differently (measured 3e-5), hence the wider tolerance
    _check(run_distributed(_resume_cases, 2, str(tmp_path), BF16_CASES, timeout=600)[0], tol=1e-3)


# ----------------------------------------------------------------------- 4 ranks -> 2 ranks
def _world4_save(rank, world_size, path):
    import galvatron_fx as gfx
    from galvatron_fx import checkpoint

    gm, args = _gpt(gfx)
    dm, opt = _build(gfx, gm, world_size, dict(tp=2, dp=2))
    _steps(dm, opt, args, BEFORE)
    checkpoint.save(dm, opt, path, step=BEFORE)
    return _steps(dm, opt, args, AFTER)


def _world2_load(rank, world_size, path):
    import galvatron_fx as gfx
    from galvatron_fx import checkpoint

    gm, args = _gpt(gfx)
    dm, opt = _build(gfx, gm, world_size, dict(sdp="zero3"))
    checkpoint.load(dm, opt, path)
    return _steps(dm, opt, args, AFTER)


@pytest.mark.dist
@pytest.mark.matrix
def test_world4_tp2xdp2_resumes_on_world2_zero3(tmp_path):
    path = str(tmp_path / "w4")
    ref = run_distributed(_world4_save, 4, path, timeout=400)[0]
    frac, per_file = _chunk_report(path)
    assert len(per_file) == 4, per_file          # four ranks wrote in parallel
    other = run_distributed(_world2_load, 2, path, timeout=200)[0]
    err = max(abs(a - b) / abs(b) for a, b in zip(other, ref))
    print(f"world 4 TP2xDP2 -> world 2 ZeRO-3: rel err {err:.1e} ({frac:.2f} partial-chunk bytes)")
    assert err <= TOL, (ref, other)


# ----------------------------------------------------------------------- interrupted save
def _kill_mid_save(rank, world_size, path, async_save):
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
    pending = checkpoint.save(dm, opt, path, step=2, async_save=async_save)   # overwrites path: never happens
    if async_save:   # rank 1 dies in the background thread while this one trains on
        _steps(dm, opt, args, 3)
        pending.result()
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
@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.matrix)])
def test_interrupted_save_is_never_loaded_and_previous_survives(tmp_path, async_save):
    from galvatron_fx import checkpoint

    path = str(tmp_path / "ckpt")
    with pytest.raises(DistributedTestError):
        run_distributed(_kill_mid_save, 2, path, async_save, timeout=120, fresh=True)
    tmp = path + ".tmp-2"
    assert os.path.isdir(tmp) and os.listdir(tmp)          # rank 1's data files are there
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="incomplete.*never loaded"):
        checkpoint.consolidate(tmp)
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="incomplete"):
        checkpoint.load(None, None, tmp)                    # refused before any collective
    assert checkpoint.latest(tmp_path) == path
    assert checkpoint.read_marker(path)["step"] == 1
    step, loss = run_distributed(_resume_after_kill, 2, path, timeout=90)[0]
    assert step == 1 and loss == loss


def test_missing_checkpoint_names_the_interrupted_save(tmp_path):
    from galvatron_fx import checkpoint

    os.makedirs(tmp_path / "ck.tmp-7")
    with pytest.raises(checkpoint.ConfigError, match=r"no checkpoint at .*ck\.tmp-7.*never loaded"):
        checkpoint.consolidate(tmp_path / "ck")


def test_latest_skips_interrupted_saves_and_recovers_a_replaced_one(tmp_path):
    import json

    from galvatron_fx import checkpoint

    def fake(name, step):
        os.makedirs(tmp_path / name)
        (tmp_path / name / checkpoint.MARKER).write_text(json.dumps({"format": checkpoint.FORMAT, "step": step}))

    fake("a", 1)
    os.makedirs(tmp_path / "b.tmp-9")                      # interrupted: no marker
    assert checkpoint.latest(tmp_path) == str(tmp_path / "a")
    fake("b.old-2", 2)          # killed between moving the old "b" aside and renaming the new one
    assert checkpoint.latest(tmp_path) == str(tmp_path / "b.old-2")
    fake("b", 3)                                           # the successor is in place: .old- ignored
    assert checkpoint.latest(tmp_path) == str(tmp_path / "b")


@pytest.mark.dist
def test_hsdp_saves_each_shard_once_and_resumes_into_plain_zero(tmp_path):
    """HSDP (ZeRO-3 over shard groups of 2, replicated twice) on 4 ranks: exact same-plan resume,
    resume into plain ZeRO-2 and back; only the first shard group writes the model's bytes."""
    cases = [("hsdp-to-zero2", dict(sdp="zero3", shard=2), dict(sdp="zero2")),
             ("zero2-to-hsdp", dict(sdp="zero2", micro_batches=2), dict(sdp="zero2", shard=2))]
    results = run_distributed(_resume_cases, 4, str(tmp_path), cases, timeout=300)[0]
    _check(results)
    _frac, per_file = _chunk_report(tmp_path / "hsdp-to-zero2")
    assert len(per_file) == 2, per_file   # ranks 0 and 1: one copy of every shard
    _frac, per_file = _chunk_report(tmp_path / "zero2-to-hsdp")
    assert len(per_file) == 4, per_file   # plain ZeRO-2 over 4: every rank its quarter


@pytest.mark.dist
def test_offload_checkpoints_resume_exactly_and_into_plans_without_it(tmp_path):
    """CPU offload (masters and optimizer states in host memory) on 2 ranks: exact same-plan resume,
    resume into plain ZeRO-3, and from plain ZeRO-2 into offload."""
    cases = [("offload-to-zero3", dict(sdp="zero3", offload="optimizer"), dict(sdp="zero3")),
             ("zero2-to-offload", dict(sdp="zero2", micro_batches=2), dict(sdp="zero2", offload="optimizer"))]
    _check(run_distributed(_resume_cases, 2, str(tmp_path), cases, timeout=300)[0])
