"""Pipeline schedules (galvatron_fx/solver/schedules.py): the plan rules, the chunk placement, the
rank orders against torch's own action lists, the in-flight peaks, the bubble; plans with
``virtual_stages`` in JSON, ``Plan.uniform`` and ``explain()``; the estimate of an interleaved plan."""

from __future__ import annotations

import pytest

import galvatron_fx as gfx
from galvatron_fx.errors import ConfigError
from galvatron_fx.plan import Plan
from galvatron_fx.solver.schedules import (
    SCHEDULES,
    check_schedule,
    chunk_in_flight,
    chunk_rank,
    chunk_wgrad_peaks,
    rank_chunks,
    rank_order,
    step_slots,
)


def _torch_order(p: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """torch's ScheduleInterleaved1F1B action list per rank, as (kind, local chunk, micro-batch)."""
    from torch.distributed.pipelining import schedules as S

    sched = object.__new__(S.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    out = {}
    for r in range(p):
        out[r] = [("F" if a.computation_type == S._ComputationType.FORWARD else "B", a.stage_index // p,
                   a.microbatch_index)
                  for a in S.ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, r) if a is not None]
    return out


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_rank_order_is_torchs(p, v):
    for m in range(p, 3 * p + 1):
        if m % max(1, m // p):
            with pytest.raises(ConfigError, match="rounds"):
                check_schedule("interleaved-1f1b", p, v, m)
            continue
        ref = _torch_order(p, v, m)
        for r in range(p):
            order = rank_order("interleaved-1f1b", r, p, v, m)
            assert order == ref[r], (p, v, m, r)
            held, peak = [0] * v, [0] * v
            for kind, c, _ in order:
                held[c] += 1 if kind == "F" else -1
                peak[c] = max(peak[c], held[c])
            assert chunk_in_flight("interleaved-1f1b", p, v, m, r) == peak


def test_one_chunk_schedules_hold_what_they_always_held():
    assert [chunk_in_flight("1f1b", 4, 1, 8, k) for k in range(4)] == [[4], [3], [2], [1]]
    assert [chunk_in_flight("gpipe", 4, 1, 8, k) for k in range(4)] == [[8]] * 4
    assert step_slots("1f1b", 4, 1, 8) == step_slots("gpipe", 4, 1, 8) == 11
    assert step_slots("interleaved-1f1b", 4, 2, 8) == 8 + 3 / 2   # Megatron: bubble (p - 1) / (v m)


def test_chunk_placement():
    assert [chunk_rank("interleaved-1f1b", c, 4) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [chunk_rank("zbv", c, 4) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_chunks("interleaved-1f1b", 1, 4, 2) == [1, 5]
    assert rank_chunks("zbv", 0, 4, 2) == [0, 7]


def test_plan_rules_name_the_fix():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"}
    with pytest.raises(ConfigError, match="virtual_stages=1"):
        check_schedule("1f1b", 2, 2, 4)
    with pytest.raises(ConfigError, match="virtual_stages=2"):
        check_schedule("zbv", 2, 3, 4)
    with pytest.raises(ConfigError, match="pp >= 2"):
        check_schedule("interleaved-1f1b", 1, 2, 4)
    with pytest.raises(ConfigError, match="or schedule='gpipe'"):   # torch's Schedule1F1B needs m >= pp
        check_schedule("1f1b", 2, 1, 1)
    check_schedule("gpipe", 2, 1, 1)
    with pytest.raises(ConfigError, match="micro_batches >= pp \\* virtual_stages = 8"):
        check_schedule("dualpipev", 4, 2, 4)
    with pytest.raises(ConfigError, match="needs pp >= 2"):
        check_schedule("interleaved-zb", 1, 1, 4)
    check_schedule("zbv", 2, 2, 4)   # a valid plan


def test_transfers_on_the_critical_path():
    """With a delay ``d`` on every cross-rank input, pp2 m2 under 1F1B and GPipe takes ``9 + 2d``
    chunk-pass units (F = 1, B = 2; by hand: rank 1 starts after one transfer, rank 0's first
    backward waits for a second; the rest overlaps), so two transfers lie on the critical path;
    1F1B's steady state puts one per micro-batch there, GPipe's fill and drain only two, and
    interleaving (v = 2) six: every chunk hands over to the other rank."""
    from galvatron_fx.solver.schedules import _makespan, critical_transfers

    for sched in ("1f1b", "gpipe"):
        for d in (0.0, 0.1, 0.5):
            assert _makespan(sched, 2, 1, 2, d) == pytest.approx(9 + 2 * d)
    assert [round(critical_transfers("gpipe", 2, 1, m), 6) for m in (2, 4, 8)] == [2, 2, 2]
    assert [round(critical_transfers("1f1b", 2, 1, m), 6) for m in (2, 4, 8)] == [2, 4, 8]
    assert [round(critical_transfers("interleaved-1f1b", 2, 2, m), 6) for m in (2, 4, 8)] == [6, 6, 6]


def test_inputs_asked_for_late_while_their_sender_computes():
    """pp2 m4, F = 1, B = 2 (by hand). GPipe waits for its sends only after the last forward and at
    the end. Activation k (k = 1, 2) is made at k + 1, when rank 1 asks for it, and rank 0 has gone
    straight on to forward k + 1: the send waits for rank 0's communication thread. Activation 0
    too: rank 1 asked at 0, while rank 0 computed without a pause until it made it at 1. Gradient 0
    is made at 7 (asked at 4) and gradients 1 and 2 at 9 and 11 (asked then), each while rank 1
    goes on to its next backward. Activation 3 and gradient 3 find their sender idle: 6.
    1F1B m2: rank 0's first warm-up forward's send is waited for only after its second forward,
    and rank 1 asked for it at 0: late. Every other send is fused with the receive its sender
    waits on next (torch's 1B1F), so the sender's thread has a core: 1. Each of them adds its
    wake-up to the step; 1F1B never more than GPipe (the search does not try GPipe)."""
    from galvatron_fx.solver.schedules import late_transfers, send_waited

    assert late_transfers("gpipe", 2, 1, 4) == pytest.approx(6)
    assert late_transfers("1f1b", 2, 1, 2) == pytest.approx(1)
    assert [round(late_transfers("gpipe", 2, 1, m), 6) for m in (2, 4, 8)] == [2, 6, 14]
    assert [round(late_transfers("1f1b", 2, 1, m), 6) for m in (2, 4, 8)] == [1, 1, 1]
    # torch's Schedule1F1B on rank 0 of pp 2, m 4 (F0 F1 B0 F2 B1 F3 B2 B3): the first warm-up
    # forward's send waited after the next forward, the last warm-up's and the steady state's
    # before the next action, the cool-down backwards' after the next backward
    order = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3), ("B", 0, 2), ("B", 0, 3)]
    assert [send_waited("1f1b", order, i) for i in range(8)] == [2, 2, 3, 4, 5, 6, 8, 8]
    assert [send_waited("gpipe", [("F", 0, k) for k in range(2)] + [("B", 0, k) for k in range(2)], i)
            for i in range(4)] == [2, 2, 4, 4]
    assert [round(late_transfers("interleaved-1f1b", 2, 2, m), 6) for m in (2, 4, 8)] == [3, 8, 20]
    for p in (2, 3, 4):
        for m in range(p, 4 * p + 1):
            assert late_transfers("1f1b", p, 1, m) <= late_transfers("gpipe", p, 1, m) + 1e-9


def test_a_pipelined_step_pays_a_wakeup_per_late_input():
    # the objective adds late_transfers x p2p_wakeup_s to a pipelined step (scaled like its
    # stages), nothing unpipelined; stage_limit inverts it, with the ranks' drift as well
    import dataclasses

    from galvatron_fx.solver.objective import Pipe, stage_limit, step_time
    from galvatron_fx.solver.schedules import late_transfers

    quiet = gfx.Cluster.preset("4xA100-80GB")
    waking = dataclasses.replace(quiet, p2p_wakeup_s=1e-3, pipeline_time_scale=1.5)
    drifting = dataclasses.replace(waking, sync_drift_sqrt_s=1e-2, sync_stretch_s=1e-6)
    for sched, v, m in [("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved-1f1b", 2, 4), ("zbv", 2, 4)]:
        pipe = Pipe(sched, v, m)
        base = step_time(dataclasses.replace(quiet, pipeline_time_scale=1.5), 2, 4, 0.05, pipe)
        assert step_time(waking, 2, 4, 0.05, pipe) - base == pytest.approx(1.5 * late_transfers(sched, 2, v, m) * 1e-3)
        for cluster in (waking, drifting):
            assert stage_limit(cluster, 2, 4, step_time(cluster, 2, 4, 0.05, pipe), pipe) == pytest.approx(0.05)
    assert step_time(waking, 1, 4, 0.05, Pipe("1f1b", 1, 1)) == step_time(quiet, 1, 4, 0.05, Pipe("1f1b", 1, 1))


def test_the_bubble_simulation_reproduces_the_closed_forms():
    # the simulator (torch's action lists, F = I = W = 1) gives 1F1B's m + p - 1 and Megatron's
    # interleaved m + (p - 1) / v exactly, so the zero-bubble figures come from the same arithmetic
    from galvatron_fx.solver.schedules import _makespan

    for p, v, m in [(2, 1, 4), (4, 1, 8), (4, 1, 5)]:
        assert _makespan("1f1b", p, v, m) / 3 == m + p - 1
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 6)]:
        assert _makespan("interleaved-1f1b", p, v, m) / (3 * v) == pytest.approx(m + (p - 1) / v)
    # zero bubble (Qi et al.): ZB-H1 (one chunk) leaves (p - 1) (F + I - W) = (p - 1) F of bubble,
    # a third of 1F1B's; ZB-V / DualPipeV leave less than interleaved 1F1B
    assert step_slots("interleaved-zb", 4, 1, 16) == 16 + 1
    for sched in ("zbv", "dualpipev"):
        assert 16 < step_slots(sched, 4, 2, 16) < step_slots("interleaved-1f1b", 4, 2, 16)


def test_zero_bubble_closed_forms_equal_the_simulation():
    # the search prices m >= p by closed forms (the simulation is too slow for 1000s of devices);
    # they equal the simulation of torch's action lists on every configuration torch accepts here
    from galvatron_fx.solver.schedules import _makespan

    checked = 0
    for sched, vs in (("interleaved-zb", (1, 2, 3)), ("zbv", (2,)), ("dualpipev", (2,))):
        for p in range(2, 7):
            for v in vs:
                for m in range(p, 4 * p + 1):
                    try:
                        check_schedule(sched, p, v, m)
                    except ConfigError:
                        continue
                    assert step_slots(sched, p, v, m) == pytest.approx(_makespan(sched, p, v, m) / (3 * v)), \
                        (sched, p, v, m)
                    checked += 1
    assert checked > 150


def test_zero_bubble_peaks_stop_growing_from_two_rounds():
    # the search reads the per-chunk peaks of m >= 2p micro-batches off 2 rounds (schedules._steady);
    # torch's full action lists give the same peaks
    from galvatron_fx.solver.schedules import _chunk_peaks, _chunk_wgrad_peaks, chunk_peaks

    checked = 0
    for sched, vs in (("interleaved-zb", (1, 2, 3)), ("zbv", (2,)), ("dualpipev", (2,))):
        for p in range(2, 7):
            for v in vs:
                for m in range(2 * p, 6 * p + 1):
                    try:
                        check_schedule(sched, p, v, m)
                    except ConfigError:
                        continue
                    assert chunk_peaks(sched, p, v, m) == _chunk_peaks(sched, p, v, m), (sched, p, v, m)
                    assert chunk_wgrad_peaks(sched, p, v, m) == _chunk_wgrad_peaks(sched, p, v, m), (sched, p, v, m)
                    checked += 1
    assert checked > 150


def test_zero_bubble_orders_are_torchs_and_hold_activations_until_w():
    # rank_order takes torch's own action lists: every micro-batch's F, I and W once per chunk
    for sched, v in [("interleaved-zb", 2), ("interleaved-zb", 1), ("zbv", 2), ("dualpipev", 2)]:
        for r in range(2):
            order = rank_order(sched, r, 2, v, 4)
            kinds = {(k, c, mb) for k, c, mb in order}
            assert len(order) == len(kinds)
            for c in range(v):
                for mb in range(4):
                    assert ("F", c, mb) in kinds and (("I", c, mb) in kinds and ("W", c, mb) in kinds
                                                     or ("B", c, mb) in kinds), (sched, r, c, mb)
    # ZBV, rank 0 runs chunks 0 and 3: chunk 0's first W comes after its fourth F
    order = rank_order("zbv", 0, 2, 2, 4)
    assert [f"{k}{mb}" for k, c, mb in order if c == 0][:5] == ["F0", "F1", "F2", "F3", "I0"]
    assert chunk_in_flight("zbv", 2, 2, 4, 0) == [4, 1]


NAMES = ["pre", "b0", "b1", "b2", "b3", "post"]


def test_plans_carry_virtual_stages_and_old_plans_load():
    p = Plan.uniform_from_layer_names(NAMES, 4, pp=2, micro_batches=4, schedule="interleaved-1f1b",
                                      virtual_stages=2, global_batch_size=8)
    assert p.stages == [(0, 1), (2, 3), (4, 4), (5, 5)] and p.num_chunks == 4
    assert [p.chunk_rank(c) for c in range(4)] == [0, 1, 0, 1] and p.rank_chunks(1) == [1, 3]
    again = Plan.from_dict(p.to_dict())
    assert again.virtual_stages == 2 and again.to_json() == p.to_json()
    old = p.to_dict()
    old.update(schedule="1f1b", stages=[[0, 2], [3, 5]])
    del old["virtual_stages"]   # written before the key existed
    assert Plan.from_dict(old).virtual_stages == 1
    zbv = Plan.uniform_from_layer_names(NAMES, 2, pp=2, micro_batches=4, schedule="zbv", global_batch_size=8)
    assert zbv.virtual_stages == 2 and len(zbv.stages) == 4
    with pytest.raises(ConfigError, match="pp \\* virtual_stages = 2 \\* 4"):
        Plan.uniform_from_layer_names(NAMES, 2, pp=2, schedule="interleaved-1f1b", virtual_stages=4)
    bad = p.to_dict()
    bad["stages"] = [[0, 2], [3, 5]]
    with pytest.raises(ConfigError, match="pp \\* virtual_stages"):
        Plan.from_dict(bad)


def test_estimate_of_an_interleaved_plan():
    model, args = gfx.models.build("gpt-tiny", device="meta", layers=6, batch=8)
    gm = gfx.capture(model, args, method="fx")
    cluster = gfx.Cluster.preset("2xA100-80GB")
    one = gfx.Plan.uniform(gm, 2, pp=2, micro_batches=4, global_batch_size=8)
    two = gfx.Plan.uniform(gm, 2, pp=2, micro_batches=4, global_batch_size=8, schedule="interleaved-1f1b",
                           virtual_stages=2)
    e1, e2 = gfx.estimate(gm, one, cluster, reserve_bytes=0), gfx.estimate(gm, two, cluster, reserve_bytes=0)
    assert len(e2["memory_bytes_per_device"]) == 2 and len(e2["layers"]) == 8
    # each chunk's activations count its own peak: rank 0 holds chunk 0 (layers 0-1) 4 times and
    # chunk 2 (4-5) twice, rank 1 chunk 1 (2-3) 3 times and chunk 3 (6-7) once; 1F1B's stage 0
    # (layers 0-3) holds 2 micro-batches, stage 1 (4-7) one
    assert [chunk_in_flight("interleaved-1f1b", 2, 2, 4, r) for r in (0, 1)] == [[4, 2], [3, 1]]
    one_mb = [row["activation_bytes"] / (2 if i < 4 else 1) for i, row in enumerate(e1["layers"])]
    peak = [4, 4, 3, 3, 2, 2, 1, 1]
    assert [row["activation_bytes"] for row in e2["layers"]] == pytest.approx([q * a for q, a in zip(peak, one_mb)])
    # states: rank 0 holds layers 0, 1, 4, 5 under interleaving, 0-3 under 1F1B
    st1 = [row["states_bytes"] for row in e1["layers"]]
    assert e2["per_device"]["states_bytes"][0] == sum(st1[i] for i in (0, 1, 4, 5))
    plan = gfx.search(gm, cluster, "80GB", 8, constraints={"schedule": "interleaved-1f1b", "pp": 2,
                                                           "virtual_stages": 2, "micro_batches": 4})
    assert (plan.schedule, plan.virtual_stages, len(plan.stages)) == ("interleaved-1f1b", 2, 4)
    assert gfx.estimate(gm, plan, cluster)["step_time_s"] == pytest.approx(plan.estimate["step_time_s"], rel=1e-9)
    assert "chunk 3 on pipeline rank 1" in plan.explain()
