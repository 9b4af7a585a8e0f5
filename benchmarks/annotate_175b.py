"""Annotate GPT-3 175B (meta device, nothing allocated) analytically and time it.

    python benchmarks/annotate_175b.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import galvatron_fx as gfx
from galvatron_fx.cluster import Cluster
from galvatron_fx.passes.cost_annotation import CostAnnotationPass
from galvatron_fx.solver.strategy import Strategy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--method", default="fx")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, example = gfx.models.build("gpt3-175b", device="meta", batch=1)
    gm = gfx.capture(model, example, method=args.method)
    t1 = time.perf_counter()
    gm = CostAnnotationPass(Cluster.preset("8x8xA100-80GB"), dtype="bf16", mixed_precision=True)(gm).graph_module
    cm = gm.meta["galvatron"].cost_model
    strategies = [Strategy(8, 1), Strategy(4, 2, "zero3"), Strategy(8, 1, sp=True, ckpt=True)]
    rows = [(i, s, cm.layer_cost(i, s, 1)) for i in (0, 1, len(cm.layers) - 1) for s in strategies]
    t2 = time.perf_counter()
    print(f"{'layer':>6} {'strategy':>22} {'fwd ms':>9} {'bwd ms':>9} {'tp ms':>8} {'states GiB':>11} {'act MiB':>9}")
    for i, s, c in rows:
        print(f"{i:>6} {s.label:>22} {c.fwd_s * 1e3:9.2f} {c.bwd_s * 1e3:9.2f} {c.tp_comm_s * 1e3:8.2f} "
              f"{c.states_bytes / 2**30:11.3f} {c.activation_bytes / 2**20:9.1f}")
    m = cm.measure(1)
    print(f"block forward TFLOPs per sample: {(m.fwd_flops_sharded(1) + m.fwd_flops_rep(1)) / 1e12:.3f}")
    print(f"layers: {len(cm.layers)}, distinct signatures measured: {len(cm.measures)}")
    print(f"capture: {t1 - t0:.1f} s, annotation: {t2 - t1:.1f} s (target < 60 s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": {"capture_s": t1 - t0, "annotate_s": t2 - t1},
                       "capture_s": t1 - t0, "annotate_s": t2 - t1, "layers": len(cm.layers),
                       "rows": [{"layer": i, "strategy": s.label, **c.to_dict()} for i, s, c in rows]}, fh, indent=1)


if __name__ == "__main__":
    main()
