"""Measured final selection (issue "The plan you get is never slower than a baseline the tool
prints", part 2): ``gfx.search(..., measure=K)`` times the K best plans by estimate and the
baselines on the live world and returns the fastest measured, with every candidate recorded."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _measured(rank, world):
    import galvatron_fx as gfx

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=8)
    gm = gfx.capture(model, args, method="dynamo")
    plan = gfx.search(gm, "2xA100-80GB", global_batch_size=8, precision="fp32", measure=2,
                      measure_options={"warmup": 0, "steps": 1})
    dm = gfx.transform(gm, plan=plan)   # the chosen plan runs like any other
    loss = dm.train_step(*args).item()
    return dict(plan=plan.to_dict(), loss=loss)


@pytest.mark.dist
def test_search_with_measure_returns_the_fastest_measured_candidate():
    import galvatron_fx as gfx

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=8)
    with torch.no_grad():
        want = model(*args).item()
    a, b = run_distributed(_measured, 2)
    assert a["plan"] == b["plan"]   # every rank runs the same plan
    records, chosen = a["plan"]["measured"], a["plan"]["chosen"]
    timed = [r for r in records if r["measured_step_s"] is not None]
    assert records[0]["name"] == "searched" and len(timed) == len(records) >= 2
    assert {r["name"] for r in records} >= {"searched"} and any(r["name"].startswith("baseline") for r in records)
    fastest = min(timed, key=lambda r: r["measured_step_s"])
    assert chosen == fastest["name"] and gfx.Plan.from_dict(a["plan"]).estimate["step_time_s"] > 0
    assert all(r["estimated_step_s"] > 0 and r["rounds"] >= 1 for r in timed)
    assert a["plan"]["measure"]["timed"] == len(timed) and a["plan"]["measure"]["seconds"] > 0
    assert abs(a["loss"] - want) <= 1e-5 * abs(want)


def test_measure_needs_the_live_world():
    import galvatron_fx as gfx

    model, args = gfx.models.build("gpt-tiny", device="meta", layers=2, batch=8)
    gm = gfx.capture(model, args, method="fx")
    with pytest.raises(gfx.errors.ConfigError, match="under torchrun"):
        gfx.search(gm, "2xA100-80GB", global_batch_size=8, measure=2)


@pytest.mark.dist
def test_plan_command_measures_under_torchrun(tmp_path):
    # the model is built on the meta device: each candidate's parts are randomly initialised to be timed
    import json
    import os
    import subprocess
    import sys

    from tests.dist_utils import free_port

    out = tmp_path / "plan.json"
    env = {**os.environ, "GALVATRON_DEVICE": "cpu", "GALVATRON_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           f"--master-port={free_port()}", "-m", "galvatron_fx.cli", "plan", "gpt-tiny", "--cluster",
                           "2xA100-80GB", "--global-batch-size", "8", "--precision", "fp32", "--measure", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    timed = [r for r in data["measured"] if r["measured_step_s"] is not None]
    assert len(timed) >= 2 and data["chosen"] == min(timed, key=lambda r: r["measured_step_s"])["name"]
    assert proc.stdout.count("timed ") == len(data["measured"])   # printed once (rank 0)


def test_step_constants_fitted_to_the_measurements():
    from types import SimpleNamespace

    from galvatron_fx.selection import fit_step_constants

    plans = [SimpleNamespace(pp=1), SimpleNamespace(pp=1), SimpleNamespace(pp=2), SimpleNamespace(pp=2)]
    records = [{"estimated_step_s": e, "measured_step_s": m} for e, m in
               [(0.010, 0.012), (0.011, 0.013), (0.008, 0.015), (0.009, 0.016)]]
    fit = fit_step_constants(records, plans, SimpleNamespace(step_overhead_s=0.001, pipeline_step_s=0.0))
    assert fit["step_overhead_s"] == pytest.approx(0.003) and fit["pipeline_step_s"] == pytest.approx(0.005)
    fast = [{"estimated_step_s": 0.01, "measured_step_s": 0.005}] * 2   # over-estimated: kept at 0, not negative
    assert fit_step_constants(fast, plans[:2], SimpleNamespace())["step_overhead_s"] == 0.0


def test_a_time_scale_fits_proportional_residuals_better_than_constants():
    """Every candidate 1.8x its estimate (the main job on a busy host): a scale fits them exactly,
    per-step constants do not; the in-sample error picks the scale."""
    from types import SimpleNamespace

    from galvatron_fx.selection import calibration_error, fit_time_scale

    plans = [SimpleNamespace(pp=p) for p in (2, 1, 2, 1)]
    records = [{"estimated_step_s": e, "measured_step_s": 1.8 * e} for e in (0.016, 0.027, 0.017, 0.026)]
    records.append({"estimated_step_s": 0.02, "measured_step_s": None})   # failed: ignored
    assert fit_time_scale(records) == pytest.approx(1.8) and fit_time_scale(records[-1:]) is None
    plans.append(SimpleNamespace(pp=1))
    scaled = calibration_error(records, plans, lambda e, _pp: e * 1.8)
    constant = calibration_error(records, plans, lambda e, _pp: e + 0.016)   # the median residual
    assert scaled == pytest.approx(0.0, abs=1e-12) and constant > 0.1


def _with_a_failing_candidate(rank, world):
    import dataclasses

    import galvatron_fx as gfx
    from galvatron_fx.selection import measure_plans

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=8)
    gm = gfx.capture(model, args, method="dynamo")
    good = gfx.Plan.uniform(gm, world, global_batch_size=8, precision="fp32")
    bad = dataclasses.replace(good, model_fingerprint="another model")   # transform refuses it on every rank
    plan, records = measure_plans(gm, [("bad", bad), ("good", good)], {"warmup": 0, "steps": 1})
    return dict(chosen=plan.extra["chosen"], records=records)


@pytest.mark.dist
def test_a_candidate_that_fails_is_skipped_on_every_rank():
    for r in run_distributed(_with_a_failing_candidate, 2):
        bad, good = r["records"]
        assert r["chosen"] == "good" and good["measured_step_s"] > 0
        assert bad["measured_step_s"] is None and "PlanMismatchError" in bad["error"], bad
