"""Capture gpt3-175b built on the meta device with each front end: wall time and peak memory.

Each method runs in a fresh process so its peak resident memory (which includes importing torch)
is its own. Target: < 30 s and < 2 GB per capture.

    python benchmarks/capture_175b.py [--model gpt3-175b] [--methods fx dynamo export] [--json out.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402

CHILD = r"""
import json, resource, sys, time
import galvatron_fx as gfx
model_name, method = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
model, args = gfx.models.build(model_name, device="meta")
t1 = time.perf_counter()
gm = gfx.capture(model, args, method=method)
t2 = time.perf_counter()
layers = gfx.layers(gm)
print(json.dumps({"build_s": t1 - t0, "capture_s": t2 - t1, "layers": len(layers),
                  "blocks": sum(la.kind == "block" for la in layers),
                  "signatures": len({la.signature for la in layers}),
                  "params": sum(p.numel() for p in model.parameters()),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--methods", nargs="+", default=["fx", "dynamo", "export"])
    args = p.parse_args()
    results = {}
    for method in args.methods:
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, method], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{method} failed:\n{out.stderr[-3000:]}")
        results[method] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [[m, r["layers"], r["blocks"], r["signatures"], f"{r['params'] / 1e9:.1f}B", r["build_s"], r["capture_s"],
             f"{r['peak_rss_bytes'] / 2**30:.2f} GiB", "yes" if r["capture_s"] < 30 and r["peak_rss_bytes"] < 2e9 else "NO"]
            for m, r in results.items()]
    print(f"capture of {args.model} on the meta device (one process per method)")
    print_table(["method", "layers", "blocks", "signatures", "params", "build s", "capture s", "peak RSS",
                 "< 30 s, < 2 GB"], rows)
    worst = max(r["capture_s"] for r in results.values())
    print(f"summary: slowest capture {worst:.1f} s, largest peak "
          f"{max(r['peak_rss_bytes'] for r in results.values()) / 2**30:.2f} GiB")
    write_json(args.json, {"model": args.model, "results": results,
                           "summary": {"slowest_capture_s": worst,
                                       "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in results.values())}})


if __name__ == "__main__":
    main()
