"""What a pipeline costs beyond its compute, measured against the cost model: a near-empty gpt-tiny
(hidden 16, 4 layers, seq 8, batch 8: a few hundred microseconds of compute per micro-batch) on
2 gloo ranks, DP2 and pp2 with 2 / 4 / 8 micro-batches (1F1B) and 4 micro-batches interleaved
(v = 2), estimated on the profiled cluster vs measured (``train_step`` + AdamW, median of
interleaved rounds after warm-up). With compute out of the way, the step is the schedule's
crossings and per-micro-batch work; the summary gives each plan's measured / estimated step and
the seconds each added micro-batch costs (slope over m = 2..8), measured and estimated.

    python benchmarks/pipeline_overhead.py [--steps N] [--json PATH]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402
from _dist import build, profiled_cluster, spawn, time_plans, uniform  # noqa: E402

MODEL = {"layers": 4, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 32, "batch": 8}
PLANS = {  # label -> Plan.uniform keywords (2 devices)
    "dp2": {},
    "pp2 m2": {"pp": 2, "micro_batches": 2, "schedule": "1f1b"},
    "pp2 m4": {"pp": 2, "micro_batches": 4, "schedule": "1f1b"},
    "pp2 m8": {"pp": 2, "micro_batches": 8, "schedule": "1f1b"},
    "pp2 m4 interleaved": {"pp": 2, "micro_batches": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2},
}


def _rank(rank, world, steps):
    import galvatron_fx as gfx

    cluster = profiled_cluster()
    _model, args, gm = build(MODEL)
    plans = {k: uniform(gm, world, MODEL["batch"], **kw) for k, kw in PLANS.items()}
    est = {k: gfx.estimate(gm, p, cluster, reserve_bytes=0)["step_time_s"] for k, p in plans.items()}
    _models, times = time_plans(gm, plans, args, steps)
    return {"estimated_s": est, "measured_s": times}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed interleaved rounds (median)")
    args = p.parse_args()
    res = spawn(_rank, 2, args.steps)[0]
    est, meas = res["estimated_s"], res["measured_s"]
    rows = [[k, f"{est[k] * 1e3:.2f}", f"{meas[k] * 1e3:.2f}", f"{meas[k] / est[k]:.2f}"] for k in PLANS]
    print(f"gpt-tiny {MODEL} on 2 gloo ranks, profiled cluster; step = train_step + AdamW, median of {args.steps}")
    print_table(["plan", "est. ms", "meas. ms", "meas / est"], rows)
    slope_m = (meas["pp2 m8"] - meas["pp2 m2"]) / 6
    slope_e = (est["pp2 m8"] - est["pp2 m2"]) / 6
    summary = {f"{k.replace(' ', '_')}_measured_over_estimated": meas[k] / est[k] for k in PLANS}
    summary.update(per_microbatch_measured_s=slope_m, per_microbatch_estimated_s=slope_e)
    print(f"summary: each added micro-batch (pp2 1F1B, m 2 -> 8) measured {slope_m * 1e3:.2f} ms, estimated "
          f"{slope_e * 1e3:.2f} ms; measured / estimated step " + ", ".join(
              f"{k} {meas[k] / est[k]:.2f}" for k in PLANS))
    write_json(args.json, {"summary": summary, "model": MODEL, **res})


if __name__ == "__main__":
    main()
