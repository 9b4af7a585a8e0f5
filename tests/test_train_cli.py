"""``galvatron-fx train``: a 2-rank torchrun happy path against --single-device, and bad arguments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from galvatron_fx.train import read_log
from tests.dist_utils import free_port

ARGS = ["gpt-tiny", "--steps", "3", "--set", "layers=2", "--global-batch-size", "4",]


def _run(cmd, env_extra=None, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GALVATRON_DEVICE": "cpu", "GALVATRON_BACKEND": "gloo",
           **(env_extra or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.dist
@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), pytest.param("bf16-mixed", 5e-3, marks=pytest.mark.matrix)])
def test_train_two_ranks_matches_single_device(tmp_path, precision, tol):
    """fp32: the single-device run exactly; bf16-mixed: the single-device autocast reference."""
    import galvatron_fx as gfx

    dist_json, ref_json, plan = tmp_path / "dist.json", tmp_path / "ref.json", tmp_path / "plan.json"
    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=4)
    gfx.Plan.uniform(gfx.capture(model, args, method="dynamo"), 2, sdp="zero3", global_batch_size=4).save(plan)
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                f"--master-port={free_port()}", "-m", "galvatron_fx.cli", "train", *ARGS,
                "--plan", str(plan), "--log-json", str(dist_json), "--precision", precision])
    assert out.returncode == 0, out.stderr[-3000:]
    ref = _run([sys.executable, "-m", "galvatron_fx.cli", "train", *ARGS, "--single-device", "--log-json", str(ref_json),
                "--precision", precision])
    assert ref.returncode == 0, ref.stderr[-3000:]
    d, r = read_log(dist_json), read_log(ref_json)
    assert d["world_size"] == 2 and len(d["steps"]) == 3 and len(d["memory"]) == 2
    for a, b in zip(d["steps"], r["steps"]):
        assert abs(a["loss"] - b["loss"]) <= tol * abs(b["loss"]), (d["steps"], r["steps"])
        assert a["samples_per_s"] > 0 and a["step_time_s"] > 0
    assert all(m["states_bytes"] > 0 and m["peak_bytes"] > 0 for m in d["memory"])


@pytest.mark.parametrize("extra, needle", [
    (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
    (["--plan", "/nonexistent/plan.json"], "no such file"),
    ([], "runs under torchrun"),
    (["--json", "log.json"], "the training log is --log-json log.json"),
])
def test_train_bad_arguments_one_line(extra, needle):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-m", "galvatron_fx.cli", "train", "gpt-tiny", *extra],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_train_help():
    out = subprocess.run([sys.executable, "-m", "galvatron_fx.cli", "train", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--single-device" in out.stdout and "--plan" in out.stdout
    assert "--precision" in out.stdout
