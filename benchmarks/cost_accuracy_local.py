"""Profiled time model and activation model vs real measurements on the local device.

Fits forward/backward time at micro-batch sizes 1, 2, 4 (profiled mode, fresh cache) and predicts a
held-out size; predicts saved-activation bytes and compares with a real run's saved tensors.

    python benchmarks/cost_accuracy_local.py [--model gpt-tiny] [--held-out 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

import galvatron_fx as gfx
from galvatron_fx.cluster import Cluster
from galvatron_fx.cost import CostModel
from galvatron_fx.cost.measure import saved_bytes
from galvatron_fx.cost.profile import time_layer
from galvatron_fx.solver.strategy import Strategy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--held-out", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    model, example = gfx.models.build(args.model, device="cpu", hidden=args.hidden, heads=4, seq_len=128,
                                      layers=2, batch=2)
    gm = gfx.capture(model, example, method="fx")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        cm = CostModel(gm, Cluster.preset("2xA100-80GB"), mode="profiled", cache_dir=cache,
                       profile_sizes=(1, 2, 4))
        block = next(r.index for r in cm.layers if r.kind == "block")
        graph = cm.graphs[cm.layers[block].signature]
        for tp in (1, 2):
            s = Strategy(tp, 1)
            c = cm.layer_cost(block, s, args.held_out)
            fwd, bwd = time_layer(graph, args.held_out, tp=tp, repeats=7)
            rows.append({"what": f"block fwd time tp{tp} (ms)", "predicted": c.fwd_s * 1e3, "measured": fwd * 1e3})
            rows.append({"what": f"block bwd time tp{tp} (ms)", "predicted": c.bwd_s * 1e3, "measured": bwd * 1e3})
    blk = model.blocks[0]
    x = torch.randn(args.held_out, 128, args.hidden, requires_grad=True)
    real = saved_bytes(lambda: blk(x, is_causal=True), list(blk.parameters()))
    rows.append({"what": "block saved activations (KiB)", "predicted": cm.activation_bytes(block, Strategy(1, 1),
                 args.held_out) / 1024, "measured": real / 1024})
    print(f"held-out micro-batch size {args.held_out} (fit on 1, 2, 4)")
    print(f"{'figure':>32} {'predicted':>12} {'measured':>12} {'error %':>8}")
    for r in rows:
        r["error_pct"] = 100 * (r["predicted"] - r["measured"]) / r["measured"]
        print(f"{r['what']:>32} {r['predicted']:12.3f} {r['measured']:12.3f} {r['error_pct']:8.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            # the same names and units (fractions) as cost_model_accuracy.py's summary
            times = [abs(r["error_pct"]) / 100 for r in rows[:-1]]
            json.dump({"rows": rows, "summary": {
                "layer_time_max_abs_err": max(times),
                "layer_time_median_abs_err": sorted(times)[len(times) // 2],
                "activation_max_rel_err": abs(rows[-1]["error_pct"]) / 100}}, fh, indent=1)


if __name__ == "__main__":
    main()
