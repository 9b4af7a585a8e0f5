"""Mixed precision: bf16-mixed step time and memory vs fp32 and vs FSDP2, 2 gloo ranks.

Same model, batch and AdamW step for every variant, interleaved round-robin, medians of the slowest
rank:

* ``fp32 dp2``: the fp32 runtime;
* ``bf16 dp2 persistent``: bf16-mixed DP with one persistent bf16 working copy per layer, refreshed
  by a local cast after each optimizer step (the runtime's choice);
* ``bf16 dp2 cast``: the alternative the mixed-precision issue asks to measure: no persistent copy,
  the fp32 masters are cast to bf16 at each layer's forward (each micro-batch);
* ``bf16 zero3``: bf16-mixed ZeRO-3 (the all-gather moves bf16 shards: half of fp32's bytes);
* ``fsdp2 bf16``: FSDP2 ``fully_shard`` per block with ``MixedPrecisionPolicy(bf16, fp32)``.

Also printed: per-rank measured model-state bytes and the ZeRO-3 parameter all-gather bytes per
micro-batch. NOTE: on this CPU bf16 matmuls are far slower than fp32 (no bf16 units), so the bf16
rows say nothing about GPU speed; the persistent-vs-cast ratio is the comparison that carries over.

    python benchmarks/mixed_precision.py [--hidden 64] [--micro-batches 4] [--steps 5] [--json PATH]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402
from _dist import add_model_args, build, gfx_step, interleaved, model_kw, spawn, uniform  # noqa: E402

LR = 1e-4


def _cast_per_forward(dm) -> None:
    """Turn a bf16-mixed DP program into the cast-per-forward variant: drop the persistent copies."""
    for s in dm.stores:
        if s.mode == "none" and s.mixed:
            s.full = None
            s.working = (lambda st: lambda: st.flat_param.data.to(st.compute_dtype))(s)
            s.sync_after_step = lambda: None


def _fsdp2_step(args, rank, world, kw):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model, batch, _gm = build(kw)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    n = batch[0].shape[0] // world
    local = [t[rank * n:(rank + 1) * n] for t in batch]

    def step():
        model(*local).backward()
        opt.step()
        opt.zero_grad()
    return step


def _bench(rank, world, kw, m, repeats):
    import galvatron_fx as gfx  # noqa: F401

    _model, batch, gm = build(kw)
    gbs = batch[0].shape[0]
    variants = {"fp32 dp2": dict(precision="fp32"), "bf16 dp2 persistent": dict(precision="bf16-mixed"),
                "bf16 dp2 cast": dict(precision="bf16-mixed"),
                "bf16 zero3": dict(precision="bf16-mixed", sdp="zero3"), "fp32 zero3": dict(precision="fp32", sdp="zero3")}
    steps, states, gathers = {}, {}, {}
    for label, spec in variants.items():
        dm = gfx.transform(gm, plan=uniform(gm, world, gbs, micro_batches=m, **spec))
        if label == "bf16 dp2 cast":
            _cast_per_forward(dm)
        opt = torch.optim.AdamW(dm.parameters(), lr=LR)
        gfx_step(dm, opt, batch)()
        states[label] = dm.states_bytes(opt)
        if "zero3" in label:
            gathers[label] = sum(s.padded * s.full.element_size() for s in dm.stores)
        steps[label] = gfx_step(dm, opt, batch)
    steps["fsdp2 bf16"] = _fsdp2_step(batch, rank, world, kw)
    return interleaved(steps, repeats), states, gathers


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    add_model_args(p, steps=5)
    p.set_defaults(hidden=64, layers=2, seq_len=32, vocab=128, batch=8)
    p.add_argument("--micro-batches", type=int, default=4)
    args = p.parse_args(argv)
    kw = model_kw(args)
    times, states, gathers = spawn(_bench, 2, kw, args.micro_batches, args.steps, timeout=1800)[0]
    rows = [[k, t * 1e3, states.get(k, {}).get("total", float("nan")) / 2**10] for k, t in times.items()]
    print_table(["variant", "step ms", "states KiB/rank"], rows)
    for k, b in gathers.items():
        print(f"{k}: all-gathered parameter bytes per micro-batch forward {b}")
    summary = {
        "bf16_dp_persistent_over_cast": times["bf16 dp2 persistent"] / times["bf16 dp2 cast"],
        "bf16_dp_over_fsdp2": times["bf16 dp2 persistent"] / times["fsdp2 bf16"],
        "bf16_zero3_over_fsdp2": times["bf16 zero3"] / times["fsdp2 bf16"],
        "zero3_gather_bytes_bf16_over_fp32": gathers["bf16 zero3"] / gathers["fp32 zero3"],
    }
    print("summary: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    write_json(args.json, {"model": kw, "micro_batches": args.micro_batches, "step_s": times, "states": states,
                           "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
