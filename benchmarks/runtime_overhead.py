"""Runtime overhead: galvatron_fx's generated programs vs PyTorch's native parallel wrappers, 2 gloo ranks.

Same model, batch and AdamW step on both sides; one training iteration (forward, backward, gradient
sync, optimizer step) timed on the slowest rank, all variants interleaved round-robin, medians:

* DP vs ``DistributedDataParallel`` on the eager model;
* ZeRO-3 vs FSDP2 ``fully_shard`` (each block, then the root);
* TP2 vs DTensor ``parallelize_module`` (Colwise q/k/v/fc1, Rowwise o/fc2; heads per rank halved);
* PP2 (1F1B, 4 micro-batches) vs ``torch.distributed.pipelining`` ``PipelineStage`` + ``Schedule1F1B``
  on the same hand split (embeddings + first half of the blocks | rest + head).

The first iteration's loss of each pair is compared (same initial weights and batch) to show that
both sides compute the same thing. A native baseline that does not run on CPU/gloo is reported "n/a"
with its error.

    python benchmarks/runtime_overhead.py [--hidden 128] [--steps 7] [--pairs dp,pp2] [--json PATH]
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402
from _dist import add_model_args, build, gfx_step, interleaved, model_kw, spawn, uniform  # noqa: E402

PAIRS = [  # label, galvatron_fx plan keywords, native name
    ("dp", dict(), "DDP"),
    ("zero3", dict(sdp="zero3"), "FSDP2 fully_shard"),
    ("tp2", dict(tp=2), "DTensor parallelize_module"),
    ("pp2", dict(pp=2, micro_batches=4, schedule="1f1b"), "pipelining Schedule1F1B"),
]
LR = 1e-4


def _local(args, rank, world):
    n = args[0].shape[0] // world
    return [a[rank * n:(rank + 1) * n] for a in args]


def _eager_step(model, opt, inputs, data_parallel: bool = True):
    """One eager iteration; returns the global-batch loss (the mean over ranks of the local means)."""
    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        opt.step()
        loss = loss.detach().clone()
        if data_parallel:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return loss
    return step


def native_ddp(model, args, rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = DDP(model)
    return _eager_step(m, torch.optim.AdamW(m.parameters(), lr=LR), _local(args, rank, world))


def native_fsdp2(model, args, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _eager_step(model, torch.optim.AdamW(model.parameters(), lr=LR), _local(args, rank, world))


def native_tp(model, args, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
        # NOTE: local outputs of the column-parallel projections hold heads / world heads
        block.attn.heads //= world
        block.attn.kv_heads //= world
    return _eager_step(model, torch.optim.AdamW(model.parameters(), lr=LR), list(args), data_parallel=False)


class _Head(nn.Module):
    def __init__(self, model, blocks):
        super().__init__()
        self.wte, self.wpe, self.blocks = model.wte, model.wpe, nn.ModuleList(blocks)
        self.seq_len = model.config.seq_len

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe(torch.arange(self.seq_len))
        for b in self.blocks:
            x = b(x, is_causal=True)
        return x


class _Tail(nn.Module):
    def __init__(self, model, blocks):
        super().__init__()
        self.blocks, self.ln_f, self.lm_head = nn.ModuleList(blocks), model.ln_f, model.lm_head

    def forward(self, x):
        for b in self.blocks:
            x = b(x, is_causal=True)
        return self.lm_head(self.ln_f(x))


def native_pp(model, args, rank, world, micro_batches=4):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from galvatron_fx.models.layers import lm_loss

    half = len(model.blocks) // 2
    part = _Head(model, model.blocks[:half]) if rank == 0 else _Tail(model, model.blocks[half:])
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(stage, micro_batches, loss_fn=lambda logits, y: lm_loss(logits[:, :-1], y[:, 1:]))
    opt = torch.optim.AdamW(part.parameters(), lr=LR)
    ids, labels = args

    def step():
        opt.zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            sched.step(ids)
        else:
            sched.step(target=labels, losses=losses)
        opt.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(loss, src=world - 1)
        return loss
    return step


NATIVE = {"dp": native_ddp, "zero3": native_fsdp2, "tp2": native_tp, "pp2": native_pp}


def _smoke(step) -> tuple[str | None, float | None]:
    """Run ``step`` once on every rank: (the first error's text, same on all ranks, or None; the loss)."""
    err, loss = None, None
    try:
        loss = float(step())
    except Exception as e:  # noqa: BLE001 - reported as n/a, never faked
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    box = [err]
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, box[0])
    return next((e for e in errs if e), None), loss


def _rank(rank, world, overrides, steps, pairs):
    import galvatron_fx as gfx

    model, args, gm = build(overrides)
    eager = copy.deepcopy(model)
    gbs = args[0].shape[0]
    steps_by_name, status, loss_diff = {}, {}, {}
    for label, kw, _ in pairs:
        plan = uniform(gm, world, gbs, **kw)
        dm = gfx.transform(gm, plan=plan)
        opt = dm.optimizer(torch.optim.AdamW, lr=LR)
        ours_loss = float(dm.train_step(*args))  # first step from the same weights as the native copy
        opt.step()
        steps_by_name[f"gfx:{label}"] = gfx_step(dm, opt, args)
        try:
            native = NATIVE[label](copy.deepcopy(eager), args, rank, world)
            err, native_loss = _smoke(native)
        except Exception as e:  # noqa: BLE001
            native, native_loss = None, None
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        if native_loss is not None:
            loss_diff[label] = abs(ours_loss - native_loss) / abs(native_loss)
        errs = [None] * world
        dist.all_gather_object(errs, err)
        err = next((e for e in errs if e), None)
        status[label] = err
        if err is None:
            steps_by_name[f"native:{label}"] = native
    times = interleaved(steps_by_name, steps)
    return {"times": times, "errors": status, "loss_diff": loss_diff}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--pairs", default=",".join(label for label, _, _ in PAIRS),
                   help="comma-separated subset of " + ", ".join(label for label, _, _ in PAIRS))
    args = p.parse_args()
    wanted = args.pairs.split(",")
    unknown = sorted(set(wanted) - {label for label, _, _ in PAIRS})
    if unknown:
        p.error(f"unknown --pairs {unknown}")
    pairs = [pair for pair in PAIRS if pair[0] in wanted]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = spawn(_rank, 2, model_kw(args), args.steps, pairs)[0]
    wall = time.perf_counter() - t0
    rows, out, ratios = [], {}, []
    for label, _, native in pairs:
        ours = res["times"][f"gfx:{label}"]
        theirs = res["times"].get(f"native:{label}")
        err = res["errors"][label]
        ratio = ours / theirs if theirs else None
        if ratio:
            ratios.append(ratio)
        diff = res["loss_diff"].get(label)
        out[label] = {"native": native, "ours_s": ours, "native_s": theirs, "ratio": ratio,
                      "native_error": err,
                      "first_loss_rel_diff": diff}
        rows.append([label, native, ours * 1e3, theirs * 1e3 if theirs else "n/a",
                     f"{ratio:.2f}" if ratio else "n/a", f"{diff:.1e}" if diff is not None else "n/a",
                     "" if err is None else err[:70]])
    print(f"gpt-tiny {model_kw(args)} on 2 gloo ranks; one iteration incl. AdamW step, "
          f"median of {args.steps} "
          "interleaved rounds")
    print_table(["plan", "native", "galvatron_fx ms", "native ms", "ours/native", "step-1 loss diff", "note"],
                rows)
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None
    print("summary: ours/native " + ", ".join(f"{k} {v['ratio']:.2f}" if v["ratio"] else f"{k} n/a"
                                                 for k, v in out.items())
          + (f"; geometric mean {geo:.2f}" if geo is not None else "") + f"; run {wall:.0f} s")
    names = {"dp": "dp_over_ddp", "zero3": "zero3_over_fsdp2", "tp2": "tp2_over_dtensor", "pp2": "pp2_over_pipelining"}
    summary = {names[k]: v["ratio"] for k, v in out.items() if k in names}
    write_json(args.json, {"model": "gpt-tiny", "overrides": model_kw(args), "pairs": out, "wall_s": wall,
                           "summary": summary})


if __name__ == "__main__":
    main()
