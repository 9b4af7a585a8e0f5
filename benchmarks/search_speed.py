"""Search speed: capture, cost annotation and search time for the reference cases (one core).

Then a scaling sweep: search time vs layers (24..192) and vs devices (8..1024).

Reference cases: bert-huge-32 on 8xRTX-TITAN-24GB (fp32, as in the paper),
llama-70b on 8x8xH100-80GB and gpt3-175b on 128x8xA100-80GB (bf16-mixed), with the whole exact
space (every pp / micro-batch divisor, checkpointing, SP, ZeRO). Targets: search <= 1 s for <= 64
devices, <= 5 s for 1024 devices, on one core. ``--json`` writes a top-level ``summary``: the median
search seconds per case (``model/cluster``) and ``all_within_target``.

    python benchmarks/search_speed.py [--json out.json]
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402

import galvatron_fx as gfx  # noqa: E402
from galvatron_fx.planner import cost_model_for  # noqa: E402

CASES = [
    # model, cluster, budget, global batch, cost-model options
    ("bert-huge-32", "8xRTX-TITAN-24GB", "16GB", 32, {"precision": "fp32"}),
    ("llama-70b", "8x8xH100-80GB", "80GB", 512, {"precision": "bf16-mixed"}),
    ("gpt3-175b", "128x8xA100-80GB", "80GB", 1536, {"precision": "bf16-mixed"}),
]


def run_case(model_name, preset, budget, gbs, cost, repeats=3):
    t0 = time.perf_counter()
    model, args = gfx.models.build(model_name, device="meta")
    gm = gfx.capture(model, args, method="fx")
    t1 = time.perf_counter()
    cluster = gfx.Cluster.preset(preset)
    cost_model_for(gm, cluster, **cost)
    t2 = time.perf_counter()
    times, plan = [], None
    for _ in range(repeats):
        cluster = gfx.Cluster.preset(preset)  # fresh: no cached collective links
        cost_model_for(gm, cluster, **cost)
        s = time.perf_counter()
        plan = gfx.search(gm, cluster, budget, gbs, **cost)
        times.append(time.perf_counter() - s)
    times.sort()
    return {"model": model_name, "cluster": preset, "devices": cluster.world_size, "memory_budget": budget,
            "global_batch_size": gbs, "layers": plan.num_layers, "capture_s": t1 - t0, "annotate_s": t2 - t1,
            "search_s": times[len(times) // 2], "pp": plan.pp, "micro_batches": plan.micro_batches,
            "strategies": sorted({la.strategy.label for la in plan.layers}),
            "throughput_samples_s": plan.estimate["throughput_samples_s"]}


def sweep(layers_list, device_presets, model="gpt3-13b", gbs=512):
    """Search time vs layer count (on 8x8xA100-80GB) and vs device count (model's own depth)."""
    rows, out = [], []
    cost = {"precision": "bf16-mixed"}
    for layers in layers_list:
        m, a = gfx.models.build(model, device="meta", layers=layers)
        gm = gfx.capture(m, a, method="fx")
        cluster = gfx.Cluster.preset("8x8xA100-80GB")
        cost_model_for(gm, cluster, **cost)
        s = time.perf_counter()
        gfx.search(gm, cluster, "80GB", gbs, **cost)
        out.append({"sweep": "layers", "layers": layers + 2, "devices": 64, "search_s": time.perf_counter() - s})
    m, a = gfx.models.build(model, device="meta")
    gm = gfx.capture(m, a, method="fx")
    for preset in device_presets:
        cluster = gfx.Cluster.preset(preset)
        cost_model_for(gm, cluster, **cost)
        s = time.perf_counter()
        gfx.search(gm, cluster, "80GB", max(gbs, cluster.world_size), **cost)
        out.append({"sweep": "devices", "layers": len(gfx.layers(gm)), "devices": cluster.world_size,
                    "search_s": time.perf_counter() - s})
    for r in out:
        rows.append([r["sweep"], r["layers"], r["devices"], r["search_s"]])
    print(f"\nscaling sweep ({model}, bf16 mixed precision, 80 GB budget)")
    print_table(["sweep", "layers", "devices", "search s"], rows)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep-layers", nargs="*", type=int, default=[24, 48, 96, 192])
    p.add_argument("--sweep-devices", nargs="*", default=["8xA100-80GB", "8x8xA100-80GB", "32x8xA100-80GB",
                                                           "128x8xA100-80GB"])
    args = p.parse_args()
    torch.set_num_threads(1)
    rows, results = [], []
    for case in CASES:
        r = run_case(*case, repeats=args.repeats)
        results.append(r)
        target = 1.0 if r["devices"] <= 64 else 5.0
        rows.append([r["model"], r["cluster"], r["devices"], r["layers"], r["capture_s"], r["annotate_s"],
                     r["search_s"], f"<= {target:g} s", "yes" if r["search_s"] <= target else "NO",
                     f"pp{r['pp']} m{r['micro_batches']}", " ".join(r["strategies"])[:60]])
    print_table(["model", "cluster", "devices", "layers", "capture s", "annotate s", "search s", "target", "met",
                 "plan", "strategies"], rows)
    met = all(r["search_s"] <= (1.0 if r["devices"] <= 64 else 5.0) for r in results)
    print("summary: search " + ", ".join(f"{r['model']} {r['search_s']:.2f} s" for r in results)
          + f"; all within target: {'yes' if met else 'NO'}")
    summary = {f"{r['model']}/{r['cluster']}": r["search_s"] for r in results}
    summary["all_within_target"] = met
    scaling = sweep(args.sweep_layers, args.sweep_devices) if args.sweep_layers or args.sweep_devices else []
    write_json(args.json, {"summary": summary, "cases": results, "sweep": scaling})


if __name__ == "__main__":
    main()
