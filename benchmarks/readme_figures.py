"""The README's performance figures from one run: each benchmark in a subprocess, one after the
other (a quiet machine is the caller's job), their ``summary`` dicts printed side by side with the
date, the machine and each script's wall time, and written as one JSON (``--json``).

Default set (about 3 minutes on the 2-core CPU machine): the main job (``scripts/main_job.py``),
``regret.py``, ``cost_model_accuracy.py`` and ``search_speed.py``; ``--all`` adds
``runtime_overhead.py``, ``hf_coverage.py``, ``paper_table.py``, ``optimizer_step.py``,
``mixed_precision.py``, ``lora_memory.py``, ``pipeline_overhead.py`` and ``pipeline_waits.py``. A figure in the README that the latest run of this
script does not reproduce is to be fixed or qualified there.

    python benchmarks/readme_figures.py [--all] [--only NAME ...] [--json PATH]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, parser, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ("main_job", "regret", "cost_model_accuracy", "search_speed")
MORE = ("runtime_overhead", "hf_coverage", "paper_table", "optimizer_step", "mixed_precision", "lora_memory",
        "pipeline_overhead", "pipeline_waits")


def command(name: str, out_dir: str) -> tuple[list[str], str]:
    """``(argv, path of the JSON it writes)`` of benchmark ``name``."""
    if name == "main_job":
        work = os.path.join(out_dir, "main_job")
        return [sys.executable, os.path.join(ROOT, "scripts", "main_job.py"), work], os.path.join(work, "summary.json")
    path = os.path.join(out_dir, f"{name}.json")
    return [sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), "--json", path], path


def run(name: str, out_dir: str) -> dict:
    argv, path = command(name, out_dir)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.isfile(path):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"ok": False, "wall_s": wall, "error": tail[0][:300]}
    with open(path) as fh:
        return {"ok": True, "wall_s": wall, "summary": json.load(fh).get("summary", {})}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v[:6]) + (", ..." if len(v) > 6 else "") + "]"
    return str(v)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="also the long benchmarks")
    p.add_argument("--only", nargs="+", choices=DEFAULT + MORE, help="just these")
    args = p.parse_args()
    names = args.only or (DEFAULT + MORE if args.all else DEFAULT)
    m = machine()
    print(f"README figures, {m['date']}, {m['processor']} ({m['cpus']} threads), python {m['python']}, "
          f"torch {m['torch']}")
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for name in names:
            print(f"\n== {name}", flush=True)
            res = results[name] = run(name, out_dir)
            if not res["ok"]:
                print(f"   FAILED after {res['wall_s']:.0f} s: {res['error']}")
                continue
            print(f"   {res['wall_s']:.0f} s")
            for k, v in sorted(res["summary"].items()):
                print(f"   {k:<36} {_fmt(v)}")
    summary = {f"{name}.{k}": v for name, res in results.items() if res["ok"] for k, v in res["summary"].items()
               if isinstance(v, (int, float))}
    summary["failed"] = [name for name, res in results.items() if not res["ok"]]
    summary["wall_s"] = sum(res["wall_s"] for res in results.values())
    write_json(args.json, {"summary": summary, "benchmarks": results})


if __name__ == "__main__":
    main()
