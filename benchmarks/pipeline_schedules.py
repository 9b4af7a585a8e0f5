"""Pipeline schedules: 1F1B vs interleaved and zero-bubble schedules, measured on gloo ranks and
searched at scale.

Part 1 (measured): gpt-tiny on 2 and 4 gloo ranks, one pipeline rank per process (pp = world),
under GPipe, 1F1B, interleaved 1F1B with 2 chunks per rank, and the zero-bubble schedules (ZB-H1 =
interleaved-zb with one chunk, interleaved-zb with 2, ZB-V, DualPipeV), the same micro-batches. Every rank
profiles the live world first (``Cluster.profile()``) and prices each plan with the profiled cost
model (layers timed on this CPU). Measured: the median step (``train_step`` + AdamW, slowest rank,
interleaved rounds) and each rank's peak saved activation bytes (``schedule_stats``); beside each
the estimate (``gfx.estimate``: step time, the rank's activation bytes).

Part 2 (searched, meta device): llama-70b and gpt3-175b on 32-128 GPUs with global batches that
force pipelines, searched over every schedule vs 1F1B only (``constraints={"schedule": "1f1b"}``):
estimated throughput of each, which schedule wins and by how much (geomean over the cases whose
1F1B-only plan pipelines and whose searched plan is not 1F1B).

    python benchmarks/pipeline_schedules.py [--worlds 2 4] [--skip-measured] [--json PATH]
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402
from _dist import build, profiled_cluster, rel_err, spawn, time_plans, uniform  # noqa: E402

MODEL = dict(layers=6, hidden=128, heads=4, seq_len=64, vocab=256, batch=16)   # 8 layers: pre, 6 blocks, post
SCHEDULES = {  # label -> Plan.uniform keywords beside pp = world
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "interleaved v2": dict(schedule="interleaved-1f1b", virtual_stages=2),
    "zb-h1": dict(schedule="interleaved-zb", virtual_stages=1),
    "interleaved-zb v2": dict(schedule="interleaved-zb", virtual_stages=2),
    "zbv": dict(schedule="zbv"),
    "dualpipev": dict(schedule="dualpipev"),
}
SEARCHED = [  # model, cluster, global batch, memory budget, pinned pipeline degree (None: searched)
    ("llama-70b", "4x8xH100-80GB", 64, "80GB", None),
    ("llama-70b", "8x8xH100-80GB", 16, "80GB", None),
    ("llama-70b", "8x8xH100-80GB", 32, "80GB", None),
    ("llama-70b", "16x8xH100-80GB", 32, "80GB", None),
    ("gpt3-175b", "8x8xA100-80GB", 16, "80GB", None),
    ("gpt3-175b", "16x8xA100-80GB", 32, "80GB", None),
    # pipelines forced (as Megatron-LM runs these models: pp across nodes)
    ("llama-70b", "4x8xH100-80GB", 32, "80GB", 4),
    ("llama-70b", "8x8xH100-80GB", 16, "80GB", 8),
    ("llama-70b", "8x8xH100-80GB", 64, "80GB", 8),
    ("llama-70b", "16x8xH100-80GB", 32, "80GB", 16),
    ("gpt3-175b", "8x8xA100-80GB", 16, "80GB", 8),
    ("gpt3-175b", "8x8xA100-80GB", 64, "80GB", 8),
    ("gpt3-175b", "16x8xA100-80GB", 32, "80GB", 16),
    ("gpt3-175b", "16x8xA100-80GB", 128, "80GB", 16),
]


def _rank(rank, world, micro_batches, steps):
    import galvatron_fx as gfx

    cluster = profiled_cluster()
    model, args, gm = build(MODEL)
    gbs = args[0].shape[0]
    plans = {k: uniform(gm, world, gbs, pp=world, micro_batches=micro_batches, **kw) for k, kw in SCHEDULES.items()}
    with tempfile.TemporaryDirectory() as cache:
        cost = {"mode": "profiled", "reserve_bytes": 0, "cache_dir": cache, "profile_sizes": (1, 2, 4),
                "profile_repeats": 9}
        ests = {k: gfx.estimate(gm, p, cluster, **cost) for k, p in plans.items()}
    models, times = time_plans(gm, plans, args, steps)
    out = {}
    for label, (dm, _opt) in models.items():
        dm.track_memory = True   # after the timed steps: a hook per saved tensor
        dm.train_step(*args)
        est = ests[label]
        out[label] = {"step_s": times[label], "pred_step_s": est["step_time_s"],
                      "activation": dm.schedule_stats["peak_saved_bytes"],
                      "pred_activation": est["per_device"]["activation_bytes"][dm.stage_index],
                      "peak_in_flight": dm.schedule_stats["peak_in_flight"], "stage": dm.stage_index}
    return out


def measured(worlds: list[int], steps: int) -> dict:
    results = {}
    for world in worlds:
        m = 2 * world
        t0 = time.perf_counter()
        ranks = spawn(_rank, world, m, steps)
        rows = []
        for label in SCHEDULES:
            r0 = ranks[0][label]
            for r in ranks:
                x = r[label]
                x["activation_err"] = rel_err(x["pred_activation"], x["activation"])
            rows.append([label, m, r0["pred_step_s"] * 1e3, r0["step_s"] * 1e3,
                         f"{100 * rel_err(r0['pred_step_s'], r0['step_s']):+.0f}%",
                         " ".join(f"{r[label]['activation'] / 2**10:.0f}" for r in ranks),
                         " ".join(f"{r[label]['pred_activation'] / 2**10:.0f}" for r in ranks),
                         " ".join(f"{100 * r[label]['activation_err']:+.0f}%" for r in ranks)])
        base = ranks[0]["1f1b"]["step_s"]
        print(f"\ngpt-tiny {MODEL} on {world} gloo ranks (pp={world}), {m} micro-batches; median of {steps} "
              f"interleaved steps; {time.perf_counter() - t0:.0f} s")
        print_table(["schedule", "m", "pred ms", "meas ms", "err", "act KiB per rank", "pred KiB", "err"], rows)
        for label in SCHEDULES:
            if label not in ("gpipe", "1f1b"):
                print(f"{label} / 1f1b step: measured {ranks[0][label]['step_s'] / base:.3f}, estimated "
                      f"{ranks[0][label]['pred_step_s'] / ranks[0]['1f1b']['pred_step_s']:.3f}")
        results[f"world{world}"] = ranks
    return results


def searched() -> dict:
    import galvatron_fx as gfx

    rows, out = [], {}
    for name, preset, gbs, budget, pp in SEARCHED:
        pinned = {"pp": pp} if pp else {}
        model, args = gfx.models.build(name, device="meta", batch=gbs)
        gm = gfx.capture(model, args, method="fx")
        cluster = gfx.Cluster.preset(preset)
        t0 = time.perf_counter()
        try:
            every = gfx.search(gm, cluster, budget, gbs, constraints=pinned)
        except gfx.InfeasibleError:
            rows.append([name, preset, gbs, pp or "", "no plan fits", "", "", "", "", ""])
            continue
        t_every = time.perf_counter() - t0
        only = gfx.search(gm, cluster, budget, gbs, constraints={**pinned, "schedule": "1f1b"})
        speedup = every.estimate["throughput_samples_s"] / only.estimate["throughput_samples_s"]
        key = f"{name}@{preset}/batch{gbs}" + (f"/pp{pp}" if pp else "")
        out[key] = {"every": every.to_dict(), "only_1f1b": only.to_dict(), "speedup": speedup, "search_s": t_every}
        rows.append([name, preset, gbs, pp or "", f"pp{every.pp} m{every.micro_batches} {every.schedule} v{every.virtual_stages}",
                     every.estimate["throughput_samples_s"], f"pp{only.pp} m{only.micro_batches}",
                     only.estimate["throughput_samples_s"], f"{speedup:.3f}", f"{t_every:.2f}"])
    print("\nsearched on the meta device (bf16-mixed, 80 GB budget): every schedule vs 1F1B only")
    print_table(["model", "cluster", "gbs", "pp pinned", "every schedule", "samples/s", "1F1B only", "samples/s", "speedup",
                 "search s"], rows)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--skip-measured", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    meas = {} if args.skip_measured else measured(args.worlds, args.steps)
    search = searched()
    step_errs = [abs(rel_err(r[0][k]["pred_step_s"], r[0][k]["step_s"])) for r in meas.values() for k in SCHEDULES]
    act_errs = [abs(x[k]["activation_err"]) for r in meas.values() for x in r for k in SCHEDULES]
    ratio = {w: {k: r[0][k]["step_s"] / r[0]["1f1b"]["step_s"] for k in SCHEDULES} for w, r in meas.items()}
    pred = {w: {k: r[0][k]["pred_step_s"] / r[0]["1f1b"]["pred_step_s"] for k in SCHEDULES} for w, r in meas.items()}
    piped = {k: v for k, v in search.items() if v["only_1f1b"]["pp"] > 1}
    other = [v["speedup"] for v in piped.values() if v["every"]["schedule"] != "1f1b"]
    summary = {"step_time_max_abs_err": max(step_errs, default=None),
               "activation_max_abs_err": max(act_errs, default=None),
               "over_1f1b_measured": ratio, "over_1f1b_estimated": pred,
               "searched_speedup_over_1f1b_only": {k: v["speedup"] for k, v in search.items()},
               "searched_schedules": {k: v["every"]["schedule"] for k, v in search.items()},
               "pipelined_cases": len(piped), "pipelined_cases_not_1f1b": len(other),
               "geomean_gain_not_1f1b": (math.prod(other) ** (1 / len(other))) if other else None}
    print(f"\nsummary: {summary}")
    write_json(args.json, {"model": MODEL, "measured": meas, "searched": search, "summary": summary})


if __name__ == "__main__":
    main()
