"""Clean exits of a correct multi-rank run: ``galvatron-fx train`` on 2 gloo ranks under torchrun,
launched ``--runs`` times in a row, each run training a tiny Llama (transformers config, no
download) for a few steps with a checkpoint write, and the count of runs where torchrun or any
rank exited non-zero. A run that fails keeps its output in ``--keep DIR`` (``fail-N.out``).

Why: a gloo process group (or a finished collective's work object held by cyclic garbage) that
outlives the interpreter's teardown can abort a rank after it printed a correct result, which
torchrun reports as a failed job; ``distributed.shutdown()`` tears the group down first.

    python benchmarks/clean_exits.py [--runs 200] [--sdp zero3] [--keep DIR] [--json PATH]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.dist_utils import free_port  # noqa: E402


def _workload(d: str) -> tuple[str, str]:
    """A tiny Llama config and a text corpus (the standard library's own sources) under ``d``."""
    import argparse
    import csv
    import json

    import transformers as tf

    tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128,
                   architectures=["LlamaForCausalLM"]).save_pretrained(os.path.join(d, "llama"))
    corpus = os.path.join(d, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("".join(open(m.__file__, encoding="utf-8").read() for m in (argparse, csv, json)))
    return os.path.join(d, "llama", "config.json"), corpus


def _uniform_plan(config: str, sdp: str, d: str) -> str:
    """A plan JSON with every layer on ``tp1·dp2·<sdp>`` (the layer names from the planner's own plan)."""
    import galvatron_fx as gfx

    searched = os.path.join(d, "searched.json")
    subprocess.run([sys.executable, "-m", "galvatron_fx.cli", "plan", config, "--seq-len", "32", "--global-batch-size",
                    "8", "--cluster", "2xA100-80GB", "--json", searched], check=True, capture_output=True)
    base = gfx.Plan.load(searched)
    path = os.path.join(d, f"{sdp}.json")
    gfx.Plan.uniform_from_layer_names([layer.name for layer in base.layers], 2, sdp=sdp, global_batch_size=8,
                                      model_fingerprint=base.model_fingerprint).save(path)
    return path


def _run(config: str, corpus: str, work: str, plan_args: list[str], steps: int) -> tuple[int, str, float]:
    """One 2-rank torchrun launch of the train command: (exit code, output, seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "-m", "galvatron_fx.cli", "train", config, "--data", corpus, "--seq-len", "32",
           "--global-batch-size", "8", "--steps", str(steps), "--precision", "fp32", "--measure", "0",
           "--cluster", "2xA100-80GB", "--save-every", str(max(steps // 2, 1)),
           "--ckpt-dir", os.path.join(work, "ckpt"), *plan_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GALVATRON_DEVICE": "cpu", "GALVATRON_BACKEND": "gloo",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=work)
    return res.returncode, res.stdout + res.stderr, time.perf_counter() - t0


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sdp", choices=["zero2", "zero3"], help="train every layer on tp1·dp2·SDP (default: each run "
                   "searches its plan)")
    p.add_argument("--keep", metavar="DIR", help="where failing runs' outputs go (default: a temporary directory)")
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="clean-exits-")
    keep = args.keep or base
    os.makedirs(keep, exist_ok=True)
    config, corpus = _workload(base)
    plan_args = ["--plan", _uniform_plan(config, args.sdp, base)] if args.sdp else []
    failures, seconds, first_failure = [], [], None
    for i in range(1, args.runs + 1):
        work = tempfile.mkdtemp(dir=base)
        rc, out, took = _run(config, corpus, work, plan_args, args.steps)
        seconds.append(took)
        if i == 1:
            print("\n".join(line for line in out.splitlines() if line.startswith("trained ")))
        if rc != 0 or "trained " not in out:   # a clean exit of a correct run prints its result
            failures.append(i)
            first_failure = first_failure or out
            with open(os.path.join(keep, f"fail-{i}.out"), "w") as f:
                f.write(out)
        print(f"run {i}/{args.runs}: exit {rc} ({took:.1f} s); failures so far {len(failures)}", flush=True)
    clean = args.runs - len(failures)
    print_table(["runs", "clean exits", "failures", "median s/run"],
                [[args.runs, clean, len(failures), sorted(seconds)[len(seconds) // 2]]])
    print(f"summary: {clean}/{args.runs} clean exits of a 2-rank train run ({args.sdp or 'searched'} plan)")
    write_json(args.json, {"summary": {"runs": args.runs, "clean_exits": clean, "failures": len(failures),
                                       "failed_runs": failures, "plan": args.sdp or "searched"},
                           "first_failure_tail": (first_failure or "")[-4000:]})


if __name__ == "__main__":
    main()
