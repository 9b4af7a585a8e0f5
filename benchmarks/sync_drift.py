"""The ranks' drift between blocking collectives on 2 gloo ranks: the wait of a one-element
all-reduce after S seconds of compute (square fp32 matmuls of side 256 on both ranks), for
stretches of 1 / 4 / 16 / 64 matmuls, against what the profiled cluster prices
(``collective_latency_s`` after its own short stretch, plus :meth:`Cluster.sync_wait`, the
``c * (sqrt(S) - sqrt(S0))`` fit of ``Cluster.profile()``). Each stretch runs ``--rounds`` timed
rounds of N x (compute, all-reduce) and N x compute alone; the wait is their difference per call
(means over the rounds, rank 0), and the compute inside the synced stream is timed apart from the
wait, so that a slower compute in lockstep shows as such.

    python benchmarks/sync_drift.py [--rounds N] [--json PATH]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402
from _dist import profiled_cluster, spawn  # noqa: E402

STRETCHES = (1, 4, 16, 64)   # matmuls between two all-reduces
SIDE = 256


def _rank(rank, world, rounds):
    cluster = profiled_cluster()
    torch.manual_seed(rank)
    a, one = torch.randn(SIDE, SIDE), torch.zeros(1)

    def work(k):
        for _ in range(k):
            torch.mm(a, a)

    out = {}
    for k in STRETCHES:
        calls = max(4, 256 // k)
        alone, synced, compute = [], [], []
        for _ in range(2 + rounds):   # 2 warm-up rounds
            dist.all_reduce(one)
            t0 = time.perf_counter()
            for _ in range(calls):
                work(k)
            alone.append((time.perf_counter() - t0) / calls)
            dist.all_reduce(one)
            t0, inside = time.perf_counter(), 0.0
            for _ in range(calls):
                t1 = time.perf_counter()
                work(k)
                inside += time.perf_counter() - t1
                dist.all_reduce(one)
            synced.append((time.perf_counter() - t0) / calls)
            compute.append(inside / calls)
        s = statistics.fmean(alone[2:])
        out[k] = {"stretch_s": s, "wait_s": statistics.fmean(synced[2:]) - s,
                  "compute_in_lockstep_s": statistics.fmean(compute[2:]),
                  "priced_s": cluster.collective_latency_s + cluster.sync_wait(s)}
    return {"stretches": out, "drift_sqrt_s": cluster.sync_drift_sqrt_s, "probe_stretch_s": cluster.sync_stretch_s}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="timed rounds per stretch (after 2 warm-up)")
    args = p.parse_args()
    t0 = time.perf_counter()
    r = spawn(_rank, 2, args.rounds)[0]
    rows = [[k, v["stretch_s"] * 1e3, v["compute_in_lockstep_s"] * 1e3, v["wait_s"] * 1e3, v["priced_s"] * 1e3,
             v["wait_s"] / max(v["priced_s"], 1e-12)] for k, v in r["stretches"].items()]
    print(f"\nprofiled drift c = {r['drift_sqrt_s'] * 1e3:.2f} ms per sqrt(s) beyond the probe's "
          f"{r['probe_stretch_s'] * 1e3:.2f} ms of compute")
    print_table(["matmuls", "compute ms", "in lockstep ms", "wait ms", "priced ms", "wait / priced"], rows)
    waits = {str(k): v["wait_s"] for k, v in r["stretches"].items()}
    summary = {"wait_s": waits, "wait_over_priced": {str(k): row[-1] for k, row in zip(STRETCHES, rows)},
               "drift_sqrt_s": r["drift_sqrt_s"], "wall_s": time.perf_counter() - t0}
    print(f"\nsummary: wait after {', '.join(f'{v * 1e3:.2f}' for v in waits.values())} ms per call for "
          f"{', '.join(f'{x[1]:.2f}' for x in rows)} ms of compute; run {summary['wall_s']:.0f} s")
    write_json(args.json, {"stretches": r["stretches"], "summary": summary})


if __name__ == "__main__":
    main()
