"""The example trainer behind ``galvatron-fx train MODEL`` (run it under torchrun).

Builds MODEL (zoo name or ``package.module:factory``) on every rank with the same seed, creates
AdamW over ``model.parameters()``, compiles with ``torch.compile(backend="galvatron",
fullgraph=True, dynamic=False, options=...)`` and trains ``--steps`` steps on synthetic data: the
model's example inputs re-sampled per step from a seeded generator (the same global batch on every
rank). Logs per step: loss, step time (seconds), samples/s, and per rank the measured state bytes
(parameters + gradients + optimizer states of the DistributedModel) and peak memory (CUDA
``max_memory_allocated`` or the process's peak RSS, bytes); the log holds the plan run (``plan``;
with ``measure=K`` its ``extra["measured"]`` lists the candidates timed before step 1). ``--single-device`` trains the same
model eagerly in one process (the reference). ``--json`` writes the log (rank 0).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from .errors import ConfigError
from .watch import peak_bytes


def synthetic_batch(example: tuple, step: int, seed: int) -> tuple:
    """``example`` re-sampled for ``step`` as a *learnable* task, so the loss visibly falls.

    Each sample ``b`` draws a start ``s_b``; every integer tensor with a sequence dim holds the
    progression ``(s_b + j) mod high`` along dim 1 (``high = max + 1`` of the example tensor: token
    ids and, for causal LMs, the labels alike, so the next token is always the current one plus 1),
    integer tensors of one dim hold ``s_b mod high``; negative entries (ignore-index labels) stay;
    floats ~ N(0, 1); anything else unchanged."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    batch = next((int(t.shape[0]) for t in example if isinstance(t, torch.Tensor) and t.dim() >= 1), 1)
    start = torch.randint(0, 2**30, (batch,), generator=g)
    out = []
    for t in example:
        if isinstance(t, torch.Tensor) and t.dtype in (torch.int32, torch.int64) and t.numel() and t.dim() >= 1:
            high = int(t.max()) + 1
            s = start[:t.shape[0]].view(-1, *([1] * (t.dim() - 1)))
            if t.dim() >= 2:
                pos = torch.arange(t.shape[1]).view(1, -1, *([1] * (t.dim() - 2)))
                new = (s + pos).expand(t.shape) % high
            else:
                new = s % high
            out.append(torch.where(t < 0, t, new.to(t.dtype).to(t.device)))
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            out.append(torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device))
        else:
            out.append(t)
    return tuple(out)


def _loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, (tuple, list)):
        loss = out[0]
    if not isinstance(loss, torch.Tensor):
        raise ConfigError("the model's output is not a loss (a scalar tensor, .loss or ['loss'])")
    return loss


def train(model_spec: str, *, steps: int = 10, plan: str | None = None, memory_budget=None,
          global_batch_size: int | None = None, cluster=None, reserve=None, single_device: bool = False,
          lr: float = 1e-3, seed: int = 0, overrides: dict | None = None, progress=None,
          precision: str | None = None, measure: int = 0, constraints: dict | None = None) -> dict:
    """Train and return the log ``{"mode", "world_size", "steps": [...], "summary": {...}}``.

    ``precision`` (``"fp32"`` / ``"bf16-mixed"`` / ``"fp16-mixed"``; default the plan's, else the
    cluster's): the distributed run's (:mod:`galvatron_fx.runtime.precision`); the single-device
    reference then runs its forward under ``torch.autocast`` in the compute dtype. ``constraints``:
    the search's (:data:`galvatron_fx.planner.CONSTRAINT_KEYS`), when it searches."""
    from . import models
    from .distributed import init_distributed, is_distributed, pick_device, synchronize

    overrides = dict(overrides or {})
    if global_batch_size is not None and ":" not in model_spec:
        overrides["batch"] = global_batch_size
    device = pick_device()
    if not single_device:
        import os

        if "RANK" not in os.environ and not is_distributed():
            raise ConfigError("galvatron-fx train runs under torchrun (e.g. torchrun --nproc-per-node 2 -m "
                              "galvatron_fx.cli train MODEL); use --single-device for the eager reference")
        init_distributed()
    torch.manual_seed(seed)
    model, example = models.load(model_spec, device="cpu", overrides=overrides)
    model = model.to(device)
    example = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in example)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
    rank, world = (dist.get_rank(), dist.get_world_size()) if not single_device else (0, 1)
    step_fn = model
    if not single_device:
        options = {k: v for k, v in {"plan": plan, "memory_budget": memory_budget, "cluster": cluster,
                                     "reserve": reserve, "precision": precision,
                                     "measure": measure or None, "constraints": constraints}.items()
                   if v is not None}
        step_fn = torch.compile(model, backend="galvatron", fullgraph=True, dynamic=False, options=options)
    batch = next(int(t.shape[0]) for t in example if isinstance(t, torch.Tensor) and t.dim() >= 1)
    rows = []
    for step in range(steps):
        inputs = synthetic_batch(example, step, seed)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with _reference_autocast(device, precision if single_device else None):
            loss = _loss_of(step_fn(*inputs))
        loss.backward()
        opt.step()
        synchronize(device)
        dt = time.perf_counter() - t0
        row = {"step": step + 1, "loss": float(loss.item()), "step_time_s": dt, "samples_per_s": batch / dt}
        rows.append(row)
        if progress and rank == 0:
            progress(f"step {step + 1:>4}  loss {row['loss']:.6f}  {dt * 1e3:8.1f} ms  "
                     f"{row['samples_per_s']:8.2f} samples/s")
    memory = _memory(model, opt, device, single_device)
    timed = rows[1:] or rows  # NOTE: step 1 includes compiling (capture, search, transform)
    summary = {"samples_per_s": sum(r["samples_per_s"] for r in timed) / len(timed),
               "step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
               "first_step_s": rows[0]["step_time_s"] if rows else 0.0, "global_batch_size": batch}
    log = {"model": model_spec, "mode": "single-device" if single_device else "galvatron",
           "world_size": world, "rank": rank, "steps": rows, "memory": memory, "summary": summary}
    if not single_device:
        from .backend import distributed_model

        dm = distributed_model(model)
        log["plan"] = dm.plan.to_dict() if dm is not None else None   # the plan run (measured candidates in extra)
        if measure and plan is None and log["plan"]:   # this run's measured selection (not a loaded plan's)
            summary["measure"] = log["plan"].get("measure")
    return log


def write_log(path: str, log: dict) -> None:
    """``--log-json``: JSON lines, one record per step (``log["steps"]``, unless the run wrote them
    as it went: the text trainer's), the last one also holding ``"run"``: the summary, per-device
    memory and the plan (so every line stays a step record)."""
    run = {k: v for k, v in log.items() if k not in ("steps", "records")}
    steps = log.get("steps")
    if steps is None:
        with open(path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    steps = [dict(rec) for rec in steps] or [{}]
    steps[-1]["run"] = run
    with open(path, "w") as f:
        for rec in steps:
            f.write(json.dumps(rec) + "\n")


def read_log(path: str) -> dict:
    """A ``--log-json`` file as ``{"steps": [...], **run}``: the step records by step (a resumed
    run's re-run steps replace the first run's) and the last run record."""
    steps: dict[int, dict] = {}
    run: dict = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            run = rec.pop("run", run)
            if "step" in rec:
                steps[rec["step"]] = rec
    return {"steps": [steps[k] for k in sorted(steps)], **run}


def _reference_autocast(device: torch.device, precision: str | None):
    """The single-device mixed-precision reference: PyTorch's own autocast (a no-op for fp32)."""
    from .runtime.precision import precision_policy

    dtype = precision_policy(precision or "fp32").compute_dtype
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _memory(model, opt, device, single_device: bool) -> list[dict]:
    """Per-rank ``{"rank", "states_bytes", "peak_bytes"}`` (all-gathered under torch.distributed)."""
    if single_device:
        states = sum(t.numel() * t.element_size() for t in model.parameters())
        states += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        states += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
        return [{"rank": 0, "states_bytes": int(states), "peak_bytes": peak_bytes(device)}]
    from .backend import distributed_model

    dm = distributed_model(model)
    states = dm.states_bytes(opt)["total"] if dm is not None and hasattr(dm, "states_bytes") else None
    mine = {"rank": dist.get_rank(), "states_bytes": states, "peak_bytes": peak_bytes(device)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def print_log(log: dict, out=None) -> None:
    out = out or sys.stdout   # NOTE: read when called (a redirected or captured stdout)
    s = log["summary"]
    print(f"{log['model']} ({log['mode']}, world {log['world_size']}): {len(log['steps'])} steps, "
          f"{s['samples_per_s']:.2f} samples/s after step 1 (step 1: {s['first_step_s']:.1f}s)", file=out)
    for m in log["memory"]:
        st = "-" if m["states_bytes"] is None else f"{m['states_bytes'] / 2**20:.2f} MiB"
        print(f"  rank {m['rank']}: states {st}, peak {m['peak_bytes'] / 2**20:.1f} MiB", file=out)
    extra = log.get("plan") or {}   # Plan.to_dict: the extra keys at the top level
    if extra.get("measured") and s.get("measure"):   # not a loaded plan's records from an earlier run
        print(f"  measured before step 1 ({extra['measure']['seconds']:.1f} s), chose {extra['chosen']!r}:", file=out)
        from .selection import measured_lines

        for line in measured_lines(extra["measured"]):
            print(f"    {line}", file=out)
