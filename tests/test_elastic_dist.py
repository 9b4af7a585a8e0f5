"""A run that survives losing a rank: ``galvatron-fx train CONFIG --data FILE`` under torchrun's
elastic agent, with a real fault injected into the first attempt (``tests/elastic_entry.py``).

* same world: SIGKILL a rank after step 7 of 20 (checkpoints every 5); the agent restarts the
  workers, which find the newest complete checkpoint, run its plan again and finish: the final
  parameters are bit-identical to an uninterrupted run's and so are the step records after it;
* smaller world: the same kill with no restarts left, then a relaunch on fewer ranks with
  ``--resume`` re-plans for them; losses match the uninterrupted run within 1e-5 relative;
* a kill in the middle of a checkpoint write: the restart resumes from the previous checkpoint;
* a hung peer (SIGSTOP): the others fail with a timeout error after ``--timeout``, not a hang;
* a diverging run (NaN): one line, exit non-zero, the last checkpoint loadable, and a restart by
  the agent fails at once with the same line;
* TensorBoard: the event files hold every listed scalar.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.dist_utils import free_port

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS, EVERY = 20, 5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import argparse
    import csv

    import transformers as tf

    d = tmp_path_factory.mktemp("elastic")
    tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128,
                   architectures=["LlamaForCausalLM"]).save_pretrained(d / "llama")
    (d / "corpus.txt").write_text("".join(open(m.__file__, encoding="utf-8").read() for m in (argparse, csv, json)))
    return d


def _command(workdir, run: str, nproc: int, *extra: str, restarts: int = 2, fault: dict | None = None,
             steps: int = STEPS, nnodes: str = "1", endpoint: str | None = None) -> tuple[list[str], dict]:
    """The torchrun command line (c10d rendezvous, like an elastic job) and its environment."""
    out_dir = workdir / run
    out_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", endpoint or f"127.0.0.1:{free_port()}", "--rdzv-conf", "last_call_timeout=5",
           os.path.join(HERE, "elastic_entry.py"), "train", str(workdir / "llama" / "config.json"),
           "--data", str(workdir / "corpus.txt"), "--seq-len", "32", "--global-batch-size", "8", "--steps", str(steps),
           "--lr", "3e-3", "--cluster", "4xA100-80GB", "--precision", "fp32", "--measure", "0",
           "--save-every", str(EVERY), "--ckpt-dir", str(out_dir / "ckpt"), "--log-json", str(out_dir / "log.jsonl"),
           *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GALVATRON_DEVICE": "cpu", "GALVATRON_BACKEND": "gloo",
           "FAULT_DIR": str(out_dir), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **{k: str(v) for k, v in (fault or {}).items()}}
    return cmd, env


def _launch(workdir, run: str, nproc: int, *extra: str, restarts: int = 2, fault: dict | None = None,
            steps: int = STEPS, timeout: float = 400):
    """One torchrun launch; returns (process result, records)."""
    cmd, env = _command(workdir, run, nproc, *extra, restarts=restarts, fault=fault, steps=steps)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    log = workdir / run / "log.jsonl"
    records = [json.loads(line) for line in open(log)] if log.exists() else []
    return res, records


def _params(ckpt) -> dict:
    from galvatron_fx.checkpoint import consolidate

    return consolidate(str(ckpt))


def _fault_at(workdir, run: str) -> float:
    return float((workdir / run / "fault_at").read_text())


def _reference(workdir, nproc: int):
    """The uninterrupted run (cached per world size)."""
    run = f"ref{nproc}"
    if not (workdir / run / "ckpt" / f"step-{STEPS}").exists():
        res, _ = _launch(workdir, run, nproc, "--tensorboard", str(workdir / run / "tb"), restarts=0)
        assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in open(workdir / run / "log.jsonl")]


def _same_world(workdir, nproc: int):
    ref = _reference(workdir, nproc)
    run = f"kill{nproc}"
    res, records = _launch(workdir, run, nproc, fault={"FAULT": "kill", "FAULT_RANK": 1, "FAULT_STEP": 7})
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stderr.splitlines() if "restart 1 (torchrun)" in ln)
    assert f"same world ({nproc} ranks)" in line and "the checkpoint's plan" in line, line
    assert "resumed at step 5 from" in line and "steps 6-7 redone" in line, line
    # the log holds each step once, and the steps equal the uninterrupted run's
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for a, b in zip(records, ref):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]), (a, b)
    mine, theirs = _params(workdir / run / "ckpt" / f"step-{STEPS}"), _params(workdir / f"ref{nproc}" / "ckpt" /
                                                                               f"step-{STEPS}")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), "parameters differ from the uninterrupted run's"
    resumed = next(r for r in records if r["step"] == 6)
    recovery = resumed["time"] - _fault_at(workdir, run)
    print(f"{nproc} ranks: SIGKILL after step 7 -> first resumed step (6) done after {recovery:.1f} s; {line}")
    return recovery


@pytest.mark.dist
def test_restart_after_a_kill_resumes_bit_identically_2_ranks(workdir):
    _same_world(workdir, 2)


@pytest.mark.dist
def test_tensorboard_holds_every_scalar(workdir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from galvatron_fx.watch import SCALARS

    ref = _reference(workdir, 2)
    acc = EventAccumulator(str(workdir / "ref2" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {tag for key, tag in SCALARS.items() if ref[-1].get(key) is not None}
    assert want >= {"train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s", "perf/mfu",
                    "memory/peak_bytes_max"}, want
    assert want | {"memory/peak_bytes/rank0", "memory/peak_bytes/rank1"} <= tags, tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert all(abs(e.value - r["loss"]) <= 1e-6 * r["loss"] for e, r in zip(loss, ref))


@pytest.mark.dist
def test_nan_stops_with_one_line_and_a_restart_does_not_retry(workdir):
    res, records = _launch(workdir, "nan", 2, "--lr", "1e8", "--warmup", "1", steps=12, restarts=1)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("galvatron-fx train: error:")]
    # first attempt: one line (rank 0's); the agent's restart: the same stop at once, one line
    assert len(lines) == 2 and "the gradient norm nan under fp32" in lines[0], res.stderr[-3000:]
    assert "stopped before this restart" in lines[1], lines
    assert os.path.join("galvatron_fx", "") not in res.stderr, res.stderr[-3000:]   # no worker traceback
    stopped = int(lines[0].split("step ")[1].split(":")[0])
    from galvatron_fx import checkpoint

    last = checkpoint.latest(str(workdir / "nan" / "ckpt"))
    assert (last is None) == (stopped <= EVERY)
    if last is not None:
        assert all(torch.isfinite(t).all() for t in _params(last).values())
    assert [r["step"] for r in records] == list(range(1, stopped))


@pytest.mark.dist
@pytest.mark.matrix
def test_restart_after_a_kill_resumes_bit_identically_4_ranks(workdir):
    _same_world(workdir, 4)


@pytest.mark.dist
@pytest.mark.matrix
def test_relaunch_on_fewer_ranks_replans_and_matches(workdir):
    ref = _reference(workdir, 4)
    res, _ = _launch(workdir, "shrink", 4, restarts=0, fault={"FAULT": "kill", "FAULT_RANK": 3, "FAULT_STEP": 7})
    assert res.returncode != 0
    res, records = _launch(workdir, "shrink", 2, "--resume", restarts=0)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stderr.splitlines() if "resumed by hand" in ln)
    assert "world 4 -> 2 ranks (2 lost)" in line and "searched for 2 ranks" in line, line
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(records, ref))
    assert worst <= 1e-5, worst
    print(f"4 -> 2 ranks: {line}; worst loss difference {worst:.2e} relative")


def test_a_failed_checkpoint_write_is_one_line():
    """DCP wraps a rank's failed collective in a CheckpointException: still one TrainingError line."""
    from torch.distributed.checkpoint.api import CheckpointException

    from galvatron_fx.errors import TrainingError
    from galvatron_fx.text_train import _raise_if_peer_lost

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:35013: Connection reset by peer")
    with pytest.raises(TrainingError, match=r"step 10: a collective of the checkpoint write failed on rank 0 "
                                            r"\(\[gloo.*Connection reset by peer\): a peer died or stayed silent"):
        _raise_if_peer_lost(CheckpointException("save", {1: (lost, None)}), 10, "of the checkpoint write ")
    _raise_if_peer_lost(ValueError("a bug of ours"), 10)   # not a collective's: raised as it is by the caller


def _process_tree(pid: int) -> list[int]:
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [q for k in kids for q in _process_tree(int(k))]


@pytest.mark.dist
@pytest.mark.matrix
def test_losing_a_node_shrinks_the_world_and_resumes(workdir):
    """Two torchrun agents of one job (``--nnodes 1:2``, 2 workers each); the second "node" (its
    agent and workers: torchrun starts each worker in a session of its own) is SIGKILLed after
    step 7. The first node's workers fail with one line each, its agent re-rendezvouses alone, the
    trainer re-plans for the 2 ranks left and finishes. The first agent hosts the c10d rendezvous
    store, so losing the second node is the case c10d survives."""
    import signal

    run, steps, endpoint = "node-loss", 40, f"127.0.0.1:{free_port()}"
    agents, outs = [], []
    for node in ("a", "b"):
        cmd, env = _command(workdir, run, 2, "--timeout", "60", steps=steps, nnodes="1:2", endpoint=endpoint)
        outs.append(open(workdir / run / f"{node}.out", "w+"))
        agents.append(subprocess.Popen(cmd, env=env, stdout=outs[-1], stderr=subprocess.STDOUT))
        time.sleep(3)
    beat, t0 = workdir / run / "ckpt" / "progress.json", time.time()
    while not (beat.exists() and json.loads(beat.read_text() or "{}").get("step", 0) >= 8):
        assert time.time() - t0 < 180 and agents[0].poll() is None, "the job did not reach step 8"
        time.sleep(0.1)
    killed_at = time.time()
    for pid in _process_tree(agents[1].pid):
        os.kill(pid, signal.SIGKILL)
    assert agents[0].wait(timeout=300) == 0
    outs[0].seek(0)
    text = outs[0].read()
    line = next(ln for ln in text.splitlines() if "restart 1 (torchrun)" in ln)
    assert "world 4 -> 2 ranks (2 lost)" in line and "searched for 2 ranks" in line, line
    records = [json.loads(ln) for ln in open(workdir / run / "log.jsonl")]
    assert records[-1]["step"] == steps and all(r["step"] == i + 1 for i, r in enumerate(records[-10:], steps - 10))
    failed = [ln for ln in text.splitlines() if ln.startswith("galvatron-fx train: error:")]
    assert failed and all("a collective" in ln for ln in failed), failed
    first = next(r for r in records if r["time"] > killed_at)
    print(f"a node of 2 ranks lost: the first resumed step ({first['step']}) done {first['time'] - killed_at:.1f} s "
          f"after the kill; {line}")


@pytest.mark.dist
@pytest.mark.matrix
def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(workdir):
    _reference(workdir, 2)
    res, records = _launch(workdir, "midsave", 2, fault={"FAULT": "kill-in-save", "FAULT_RANK": 1, "FAULT_STEP": 10})
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stderr.splitlines() if "restart 1 (torchrun)" in ln)
    assert "resumed at step 5 from" in line and "steps 6-10 redone" in line, line
    ref = [json.loads(line) for line in open(workdir / "ref2" / "log.jsonl")]
    assert [(r["loss"], r["lr"]) for r in records] == [(r["loss"], r["lr"]) for r in ref]
    assert not any(".tmp-" in n for n in os.listdir(workdir / "midsave" / "ckpt"))


@pytest.mark.dist
@pytest.mark.matrix
def test_a_hung_peer_ends_the_job_with_a_timeout_error(workdir):
    t0 = time.time()
    res, _ = _launch(workdir, "hung", 2, "--timeout", "10", restarts=0,
                     fault={"FAULT": "stop", "FAULT_RANK": 1, "FAULT_STEP": 3}, timeout=200)
    took = time.time() - _fault_at(workdir, "hung")
    assert res.returncode != 0
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("galvatron-fx train: error:"))
    assert "a collective failed on rank 0" in line and "collective timeout" in line, line
    print(f"SIGSTOP after step 3: rank 0 failed with a timeout, torchrun exited {took:.1f} s after the stop "
          f"(launch to exit {time.time() - t0:.1f} s); {line}")


@pytest.mark.dist
def test_a_corrupt_or_foreign_checkpoint_is_one_clear_error(workdir, tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp

    from galvatron_fx import checkpoint
    from galvatron_fx.checkpoint import CorruptCheckpointError
    from galvatron_fx.errors import ConfigError

    _reference(workdir, 2)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(workdir / "ref2" / "ckpt" / f"step-{STEPS}", ckpt / f"step-{STEPS}")
    data = sorted(p for p in (ckpt / f"step-{STEPS}").iterdir() if p.suffix == ".distcp")[-1]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])          # truncated
    with pytest.raises(CorruptCheckpointError, match=f"data file '{data}' holds .* bytes where its index needs"):
        checkpoint.consolidate(ckpt / f"step-{STEPS}")
    res, _ = _launch(workdir, "corrupt", 2, "--resume", "--ckpt-dir", str(ckpt), restarts=0, steps=STEPS + 2)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("galvatron-fx train: error:")]
    assert res.returncode != 0 and lines and f"data file '{data}'" in lines[0], res.stderr[-3000:]
    meta = tmp_path / "meta"
    shutil.copytree(workdir / "ref2" / "ckpt" / f"step-{STEPS}", meta)
    (meta / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CorruptCheckpointError, match="its index .* is unreadable"):
        checkpoint.consolidate(meta)
    foreign = tmp_path / "foreign"
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(foreign), no_dist=True)   # another program's DCP
    with pytest.raises(ConfigError, match="not written by gfx.checkpoint.save"):
        checkpoint.consolidate(foreign)


@pytest.mark.dist
def test_resume_helpers(workdir, tmp_path, monkeypatch):
    from galvatron_fx import resume
    from galvatron_fx.errors import TrainingError

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    resume.trim_log(str(log), 5)   # the redone steps and a line cut off by the kill go
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4, 5]
    monkeypatch.setenv(resume.RESTART_ENV, "1")
    resume.mark_stopped(str(tmp_path), 9, "step 9: the loss is nan")
    with pytest.raises(TrainingError, match="step 9: the loss is nan .stopped before this restart"):
        resume.check_stopped(str(tmp_path))
    monkeypatch.setenv(resume.RESTART_ENV, "0")   # a launch by hand clears the mark
    resume.check_stopped(str(tmp_path))
    assert not (tmp_path / resume.STOPPED).exists()
    _reference(workdir, 2)
    point = resume.find(str(workdir / "ref2" / "ckpt"))
    assert (point.step, point.world_size, point.plan.world_size) == (STEPS, 2, 2)
    assert resume.choose_plan(point, 2, None)[1] == "the checkpoint's plan (2 ranks)"
    assert resume.choose_plan(point, 3, None) == (None, "searched for 3 ranks (the checkpoint ran on 2)")
    saved = str(workdir / "ref2" / "ckpt" / f"step-{STEPS}" / "plan.json")
    assert resume.choose_plan(point, 3, saved)[0] is None
    assert resume.choose_plan(None, 3, saved)[0].world_size == 2   # a first launch: transform names it
    line = resume.restart_line(point, 1, "searched", ["tp1·dp1"], {"step": 23, "time": 100.0, "world_size": 2},
                               112.5)
    assert "world 2 -> 1 ranks (1 lost)" in line and "steps 21-23 redone" in line and "recovery 12.5 s" in line
