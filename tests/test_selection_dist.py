"""Measured final selection (issue "The plan you get is never slower than a baseline the tool
prints", part 2): ``gfx.search(..., measure=K)`` times the K best plans by estimate and the
baselines on the live world and returns the fastest measured, with every candidate recorded."""

from __future__ import annotations

import statistics
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_distributed


def _measured(rank, world):
    import galvatron_fx as gfx

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=8)
    gm = gfx.capture(model, args, method="dynamo")
    values, rng = {k: v.clone() for k, v in gm.state_dict().items()}, torch.get_rng_state()
    plan = gfx.search(gm, "2xA100-80GB", global_batch_size=8, precision="fp32", measure=2,
                      measure_options={"warmup": 0, "steps": 1})
    kept = torch.equal(rng, torch.get_rng_state()) and all(torch.equal(v, values[k]) for k, v in gm.state_dict().items())
    dm = gfx.transform(gm, plan=plan)   # the chosen plan runs like any other
    loss = dm.train_step(*args).item()
    return dict(plan=plan.to_dict(), loss=loss, kept=kept)


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
    from galvatron_fx.selection import DEFAULTS, winner

    rounds = {i: {k: s for k, s in enumerate(r["round_s"]) if s is not None} for i, r in enumerate(records)}
    assert all(r["measured_step_s"] == pytest.approx(statistics.median(rounds[i].values()))
               and r["rounds"] == len(rounds[i]) >= 1 for i, r in enumerate(records))
    est = {i: r["estimated_step_s"] for i, r in enumerate(records)}
    assert chosen == records[winner(rounds, est, DEFAULTS["tie"], DEFAULTS["doubt"])]["name"]
    assert gfx.Plan.from_dict(a["plan"]).estimate["step_time_s"] > 0
    assert all(r["estimated_step_s"] > 0 for r in timed)
    assert a["plan"]["measure"]["timed"] == len(timed) and a["plan"]["measure"]["seconds"] > 0
    assert abs(a["loss"] - want) <= 1e-5 * abs(want)
    assert a["kept"] and b["kept"]   # the model's values and the random state as before the measurement


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

    import galvatron_fx as gfx
    from tests.dist_utils import free_port

    out, cfile = tmp_path / "plan.json", tmp_path / "cluster.json"
    gfx.Cluster.preset("2xA100-80GB").save(str(cfile))
    env = {**os.environ, "GALVATRON_DEVICE": "cpu", "GALVATRON_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           f"--master-port={free_port()}", "-m", "galvatron_fx.cli", "plan", "gpt-tiny", "--cluster",
                           str(cfile), "--global-batch-size", "8", "--precision", "fp32", "--measure", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    timed = [r for r in data["measured"] if r["measured_step_s"] is not None]
    assert len(timed) >= 2
    # the selection's own rule over the rounds it printed: the fastest median, unless the timing
    # cannot tell it from others, then the lowest estimate of those (selection.winner)
    from galvatron_fx.selection import DEFAULTS, winner

    rounds = {i: {k: s for k, s in enumerate(r["round_s"]) if s is not None} for i, r in enumerate(data["measured"])}
    estimates = {i: r["estimated_step_s"] for i, r in enumerate(data["measured"])}
    chosen = winner({i: r for i, r in rounds.items() if r}, estimates, DEFAULTS["tie"], DEFAULTS["doubt"])
    assert data["chosen"] == data["measured"][chosen]["name"]
    assert proc.stdout.count("timed ") == len(data["measured"])   # printed once (rank 0)
    # the fit went into the cluster file: the chosen plan re-estimated on it is the calibrated step
    # (an A100 preset timed on this CPU: the steps run slower than priced, so the scale exceeds 1; how
    # far, 2.0-2.6 on the 2-core test hosts, is the host's speed, which the fit's own test does not need)
    calibrated = gfx.Cluster.load(str(cfile))
    assert calibrated.time_scale == pytest.approx(data["measure"]["fit"]["time_scale"]) and calibrated.time_scale > 1
    assert f"calibrated {cfile}" in proc.stderr and data["measure"]["error_after"] <= data["measure"]["error_before"]
    model, args = gfx.models.build("gpt-tiny", device="meta", batch=8)
    gm = gfx.capture(model, args, method="fx")
    est = gfx.estimate(gm, gfx.Plan.from_dict(data), calibrated, precision="fp32")
    assert est["step_time_s"] == pytest.approx(data["measure"]["calibrated_step_s"], rel=1e-9)


def test_the_scales_are_fitted_to_the_candidates_near_the_fastest():
    """The fit takes the measured candidates within ``close`` of the fastest (the fastest itself,
    the boundary included), at least the two fastest; failed ones (no measurement) and slower ones
    are left out."""
    from galvatron_fx.selection import near_fastest

    steps = [0.0132, 0.0223, 0.0117, None, 0.0187, 0.01404]
    records = [{"measured_step_s": s} for s in steps]
    assert near_fastest(records, 0.20) == [0, 2, 5]        # 11.7 ms x 1.2 = 14.04 ms
    assert near_fastest(records, 0.0) == [0, 2]          # the two fastest at least
    assert near_fastest(records, 1.0) == [0, 1, 2, 4, 5]
    assert near_fastest([{"measured_step_s": None}], 0.2) == []
    assert near_fastest([{"measured_step_s": 0.01}, {"measured_step_s": None}], 0.2) == [0]


def test_time_scales_fitted_to_the_measurements():
    """Unpipelined candidates 1.5x their estimate, pipelined ones 1.8x: the fit scales every plan's
    stage time by 1.5 and a pipelined one's by 1.2 on top (compounding the cluster's own scales),
    with the per-step constants taken off first; re-priced on the fit every candidate's estimate
    equals its measurement. A kind of one measured candidate gets no scale of its own."""
    import galvatron_fx as gfx
    from galvatron_fx.selection import calibration_error, fit_time_scales
    from galvatron_fx.solver.objective import Pipe, stage_limit, step_constant, step_time

    # with the ranks' drift priced at a pipeline's transfers (non-linear in the stage time)
    cluster = replace(gfx.Cluster.preset("2xA100-80GB"), sync_drift_sqrt_s=4e-3, sync_stretch_s=2e-4)
    cluster = cluster.calibrated({"time_scale": 2.0, "step_overhead_s": 1e-3})
    plans = [SimpleNamespace(pp=p, schedule=s, virtual_stages=v, micro_batches=m)
             for p, s, v, m in ((1, "1f1b", 1, 1), (1, "1f1b", 1, 1), (2, "1f1b", 1, 4),
                                (2, "interleaved-1f1b", 2, 2), (1, "1f1b", 1, 1))]
    stages = [0.010, 0.012, 0.008, 0.009, 0.011]   # the slowest stage of each as the model prices it
    wants = [1.5, 1.5, 1.8, 1.8]
    estimates = [step_time(cluster, p.pp, 2, s, Pipe.of(p)) for p, s in zip(plans, stages)]
    assert estimates[2] > step_time(cluster, 2, 2, stages[2])   # the wait is priced
    for x in (1e-6, 1e-4, 2e-3, 0.3):   # below and beyond the probe's stretch: stage_limit inverts step_time
        for p in plans[2:4]:
            assert stage_limit(cluster, 2, 2, step_time(cluster, 2, 2, x, Pipe.of(p)), Pipe.of(p)) == pytest.approx(x)
    const = [step_constant(cluster, p.pp, 2) for p in plans]   # measured: the scaled stage + the constant
    records = [{"estimated_step_s": e, "measured_step_s": c + w * (e - c)} for e, c, w in zip(estimates, const, wants)]
    records.append({"estimated_step_s": step_time(cluster, 1, 2, stages[-1]), "measured_step_s": None})  # failed
    fit = fit_time_scales(records, plans, cluster, 2)
    assert fit == pytest.approx({"time_scale": 3.0, "pipeline_time_scale": 1.2})
    fitted = cluster.calibrated(fit)
    assert fitted.step_overhead_s == 1e-3 and cluster.time_scale == 2.0   # the constant kept; a new cluster

    def recalibrated(estimate, plan):
        pipe = Pipe.of(plan)
        return step_time(fitted, plan.pp, 2, stage_limit(cluster, plan.pp, 2, estimate, pipe), pipe)

    assert calibration_error(records, plans, recalibrated) == pytest.approx(0.0, abs=1e-12)
    assert calibration_error(records, plans, lambda e, _plan: e) > 0.3
    # one kind measured: a uniform scale (the ranking unchanged), the pipeline factor kept
    only_piped = fit_time_scales(records[2:4], plans[2:4], cluster, 2)
    assert only_piped == pytest.approx({"time_scale": 3.6, "pipeline_time_scale": 1.0})
    # one unpipelined candidate beside two pipelined: too few for its own scale, the median of all three
    one_flat = fit_time_scales(records[1:4], plans[1:4], cluster, 2)
    assert one_flat == pytest.approx({"time_scale": 3.6, "pipeline_time_scale": 1.0})
    assert fit_time_scales(records[-1:], plans[-1:], cluster, 2) == {"time_scale": 2.0, "pipeline_time_scale": 1.0}


def test_a_calibrated_cluster_round_trips_and_refuses_unknown_keys(tmp_path):
    import galvatron_fx as gfx

    cluster = gfx.Cluster.preset("2xA100-80GB").calibrated({"time_scale": 1.3, "pipeline_time_scale": 1.1})
    cluster.save(str(tmp_path / "c.json"))
    back = gfx.Cluster.load(str(tmp_path / "c.json"))
    assert (back.time_scale, back.pipeline_time_scale) == (1.3, 1.1) and back.is_calibrated
    assert "stage time x 1.3" in back.summary() and not gfx.Cluster.preset("2xA100-80GB").is_calibrated
    with pytest.raises(gfx.errors.ConfigError, match="calibration key"):
        cluster.calibrated({"time_scal": 2.0})
    with pytest.raises(gfx.errors.ConfigError, match="time_scale"):
        cluster.calibrated({"time_scale": 0.0})


def _with_a_failing_candidate(rank, world):
    import dataclasses

    import galvatron_fx as gfx
    from galvatron_fx.selection import measure_plans

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=8)
    gm = gfx.capture(model, args, method="dynamo")
    good = gfx.Plan.uniform(gm, world, global_batch_size=8, precision="fp32")
    bad = dataclasses.replace(good, model_fingerprint="another model")   # transform refuses it on every rank
    # close=10: every timed candidate is close to the fastest, so each gets all 3 rounds
    plan, records = measure_plans(gm, [("bad", bad), ("good", good), ("twin", good)],
                                  {"warmup": 0, "steps": 1, "close": 10.0})
    return dict(chosen=plan.extra["chosen"], records=records)


@pytest.mark.dist
def test_a_candidate_that_fails_is_skipped_and_close_ones_are_timed_again():
    for r in run_distributed(_with_a_failing_candidate, 2):
        bad, good, twin = r["records"]
        assert r["chosen"] in ("good", "twin") and good["measured_step_s"] > 0
        assert (bad["rounds"], good["rounds"], twin["rounds"]) == (0, 3, 3)
        assert bad["round_s"] == [None] * 3 and None not in good["round_s"] + twin["round_s"]
        assert bad["measured_step_s"] is None and "PlanMismatchError" in bad["error"], bad


def test_a_loaded_plan_does_not_calibrate_the_cluster_again(tmp_path, capsys):
    """``train --plan P --cluster FILE``: P carries the fit of the run that measured it, already in
    FILE; training P must neither apply it again (the scales would compound) nor print its
    candidates as timed before this run's step 1."""
    from types import SimpleNamespace as NS

    import galvatron_fx as gfx
    from galvatron_fx.cli import _report
    from galvatron_fx.train import print_log

    cfile = tmp_path / "cluster.json"
    gfx.Cluster.preset("2xA100-80GB").calibrated({"time_scale": 2.0}).save(str(cfile))
    measure = {"fit": {"time_scale": 4.0, "pipeline_time_scale": 1.0}, "error_before": 0.5, "error_after": 0.1,
               "seconds": 1.0}
    record = {"name": "searched", "label": "pp1", "estimated_step_s": 0.01, "measured_step_s": 0.02, "rounds": 1}
    log = {"model": "m", "mode": "galvatron", "world_size": 2, "rank": 0, "steps": [], "memory": [],
           "plan": {"measure": measure, "measured": [record], "chosen": "searched"},
           "summary": {"samples_per_s": 1.0, "first_step_s": 1.0}}
    args = NS(log_json=None, cluster=str(cfile), no_calibrate=False)
    _report(log, args, print_log)
    assert gfx.Cluster.load(str(cfile)).time_scale == 2.0 and "timed" not in capsys.readouterr().out
    log["summary"]["measure"] = measure   # the run that measured: its fit is written, its candidates shown
    _report(log, args, print_log)
    assert gfx.Cluster.load(str(cfile)).time_scale == 4.0 and "timed searched" in capsys.readouterr().out


def test_candidates_measured_alike_are_told_apart_by_their_estimate():
    from galvatron_fx.selection import winner

    def once(*ms):   # one round each
        return {i: {0: m * 1e-3} for i, m in enumerate(ms)}

    estimated = {0: 13.0e-3, 1: 13.4e-3, 2: 12.0e-3}
    assert winner(once(14.1, 14.0, 20.0), estimated, 0.03) == 0          # within 3 %: the cheaper estimate
    assert winner(once(14.1, 14.0, 20.0), estimated, 0.0) == 1           # no tie: the fastest measured
    assert winner(once(14.5, 14.0), estimated, 0.03, 0.10) == 1          # 3.6 % apart in its only round
    assert winner(once(14.1, 14.0), {0: None, 1: 13.4e-3}, 0.03) == 1    # no estimate: last
    # the main job, 2026-12-04: 1F1B (est. 11.6 ms) 12.7 ms by median against GPipe's (12.6) 12.1; a
    # round that had 1F1B ahead leaves them undecided, the estimate decides; rounds that all put
    # GPipe ahead decide for it; 10 % apart is beyond doubt
    est = {0: 11.6e-3, 1: 12.6e-3}
    ms = lambda *xs: dict(enumerate(x * 1e-3 for x in xs))   # noqa: E731
    assert winner({0: ms(12.7, 11.9, 13.0), 1: ms(12.1, 12.3, 12.0)}, est, 0.03, 0.10) == 0
    assert winner({0: ms(12.7, 12.9, 13.0), 1: ms(12.1, 12.3, 12.0)}, est, 0.03, 0.10) == 1
    assert winner({0: ms(12.7, 11.9, 13.0), 1: ms(12.1, 12.3, 12.0)}, est, 0.03, 0.0) == 1
    assert winner({0: ms(13.4, 11.9, 13.6), 1: ms(12.1, 12.3, 12.0)}, est, 0.03, 0.10) == 1
    # rounds a candidate sat out pair with nothing
    assert winner({0: {0: 12.7e-3, 2: 13.0e-3}, 1: ms(12.1, 11.0, 12.0)}, est, 0.03, 0.10) == 1
