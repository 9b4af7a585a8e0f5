"""``galvatron-fx train CONFIG --data FILE``: train a transformers config on a text file (under torchrun).

    torchrun --nproc-per-node 2 -m galvatron_fx.cli train llama-tiny/config.json --data corpus.txt \\
        --seq-len 128 --global-batch-size 8 --steps 200 --lr 3e-4 --log-json log.jsonl

What one run does (every rank the same, collectives in the same order):

1. *Tokens*: the file through ``tokenizer.json`` beside the config (the ``tokenizers`` package), else
   its UTF-8 bytes (the config's vocabulary must hold 256 ids); cut into blocks of ``seq_len``
   tokens (causal LMs: ``labels = input_ids``, the model shifts them). Step ``k`` takes blocks
   ``[k B, (k + 1) B)`` of the shuffled block order (a seeded permutation per epoch).
2. *Model*: ``AutoModelFor...from_config`` on the meta device (no process holds the whole model),
   captured there; after ``gfx.transform`` each rank initialises only its parts
   (``dist_model.init_weights(seed)``: the same weights under every plan) or, with ``--init DIR``,
   reads only its pieces of ``DIR``'s safetensors (``dist_model.load_pretrained``); ``use_cache`` off.
3. *Plan*: ``--plan PATH``, else rank 0 searches one (``--cluster``, default the profiled live world;
   ``--memory-budget``) for the captured model (dynamo, keyword inputs) and every rank runs it; with
   ``--measure K`` (the default, 4) the K best plans and the baselines are timed on the ranks first
   and the fastest runs (:mod:`galvatron_fx.selection`).
4. *Loop*: ``gfx.transform``; AdamW over param groups by name (no weight decay on biases and norms),
   linear warm-up then cosine decay to 10 % of ``--lr``; per step ``dist_model.train_step(**batch)``,
   ``dist_model.clip_grad_norm_(--clip)`` (every plan, pipelines included), optimizer and schedule
   steps. Logged per step: loss, gradient norm (before clipping), learning rate, tokens/s and MFU
   (``6 N + 12 L h s`` FLOPs per token, over the world's peak from the cluster description).
5. *Checkpoints*: ``--save-every N`` writes sharded DCP checkpoints (:mod:`galvatron_fx.checkpoint`)
   into ``--ckpt-dir``; ``--resume`` loads the newest complete one (any plan) and continues at its
   step, the data position included.

Each rank hands ``train_step`` only its shard of every global batch (``dist_model.input_shard``,
``DistributedSampler``'s rows); the file is tokenised once per rank.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from .errors import ConfigError


# ------------------------------------------------------------------------------ data
def tokenize(path: str, config_dir: str, vocab: int) -> tuple[torch.Tensor, str]:
    """``(token ids of the file, "tokenizer.json" | "bytes")``."""
    if not os.path.isfile(path):
        raise ConfigError(f"--data {path!r}: no such file")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    tok = os.path.join(config_dir, "tokenizer.json")
    if os.path.isfile(tok):
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(tok).encode(text).ids
        kind = "tokenizer.json"
    else:
        if vocab < 256:
            raise ConfigError(f"the config's vocab_size {vocab} cannot hold byte tokens (256); put a "
                              f"tokenizer.json beside the config or raise vocab_size")
        ids = list(text.encode("utf-8"))
        kind = "bytes"
    out = torch.tensor(ids, dtype=torch.long)
    if out.numel() and int(out.max()) >= vocab:
        raise ConfigError(f"{tok} produces token id {int(out.max())} >= the config's vocab_size {vocab}")
    return out, kind


class TextBlocks:
    """The file's tokens as ``seq_len`` blocks, served ``batch`` at a time in a seeded order per epoch."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch: int, seed: int = 0):
        n = tokens.numel() // seq_len
        if n < batch:
            raise ConfigError(f"the data holds {n} blocks of {seq_len} tokens, fewer than one global batch of "
                              f"{batch}: use a larger file, a shorter --seq-len or a smaller --global-batch-size")
        self.blocks = tokens[:n * seq_len].view(n, seq_len)
        self.batch, self.seed = batch, seed
        self.per_epoch = n // batch

    def batch_at(self, step: int) -> dict[str, torch.Tensor]:
        """The global batch of step ``step`` (0-based): inputs and labels."""
        epoch, k = divmod(step, self.per_epoch)
        order = torch.randperm(self.blocks.shape[0], generator=torch.Generator().manual_seed(self.seed + epoch))
        ids = self.blocks[order[k * self.batch:(k + 1) * self.batch]]
        return {"input_ids": ids, "labels": ids.clone()}


# ------------------------------------------------------------------------------ optimizer
def param_groups(named, weight_decay: float) -> list[dict]:
    """AdamW groups by name: no weight decay on biases and norms (1-D parameters)."""
    decay, plain = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        (plain if name.endswith("bias") or "norm" in name.lower() or len(p.spec.global_shape) < 2
         else decay).append(p)
    return [g for g in (dict(params=decay, weight_decay=weight_decay), dict(params=plain, weight_decay=0.0))
            if g["params"]]


def schedule(opt, steps: int, warmup: int):
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10 % at ``steps``."""
    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        t = (k - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def flops_per_token(config, params: int, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N`` for the weights plus ``12 L h s`` for attention (PaLM's MFU)."""
    layers = getattr(config, "num_hidden_layers", 0) or getattr(config, "num_layers", 0)
    hidden = getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0)
    return 6.0 * params + 12.0 * layers * hidden * seq_len


# ------------------------------------------------------------------------------ run
def train_text(config_spec: str, data: str, *, seq_len: int = 128, global_batch_size: int = 8, steps: int = 100,
               lr: float = 3e-4, weight_decay: float = 0.1, warmup: int | None = None, clip: float = 1.0,
               plan: str | None = None, cluster=None, memory_budget=None, precision: str | None = None,
               measure: int = 0,
               init: str | None = None, save_every: int = 0, ckpt_dir: str = "checkpoints",
               resume: bool = False, log_json: str | None = None, seed: int = 0, overrides: dict | None = None,
               progress=None) -> dict:
    """Train the config at ``config_spec`` on ``data`` (module docstring); returns the log
    ``{"records": [...], "summary": {...}}`` (rank 0's; every rank computes the same figures)."""
    # NOTE: one function (102 lines): the training loop as a user writes it, top to bottom (data, plan, model, optimizer, steps, checkpoints)
    from . import capture, checkpoint, transform
    from .distributed import init_distributed, pick_device, synchronize
    from .models.hf_config import config_path, from_config, load_config
    from .plan import Plan
    from .planner import resolve_cluster

    path = config_path(config_spec)
    if path is None:
        raise ConfigError(f"{config_spec!r} is not a transformers config.json (or a directory holding one)")
    if "RANK" not in os.environ and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("galvatron-fx train --data runs under torchrun (e.g. torchrun --nproc-per-node 2 -m "
                          "galvatron_fx.cli train CONFIG --data FILE)")
    for name, value in (("--steps", steps), ("--global-batch-size", global_batch_size), ("--seq-len", seq_len)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = pick_device()
    config = load_config(path)
    tokens, kind = tokenize(data, os.path.dirname(os.path.abspath(path)), int(config.vocab_size))
    blocks = TextBlocks(tokens, seq_len, global_batch_size, seed)
    say = progress if (progress and rank == 0) else (lambda _msg: None)
    say(f"{data}: {tokens.numel():,} tokens ({kind}), {blocks.blocks.shape[0]} blocks of {seq_len}, "
        f"{blocks.per_epoch} steps per epoch")
    # NOTE: built and captured on the meta device; each rank materialises only its parts below
    model, _ = from_config(path, device="meta", seq_len=seq_len, batch=1, seed=seed, **(overrides or {}))
    n_params = sum(p.numel() for p in model.parameters())
    example = {k: v.to("meta") for k, v in blocks.batch_at(0).items()}
    gm = capture(model, (), kwargs=example, method="dynamo")
    if plan is not None:
        the_plan = Plan.load(plan)
        dm = transform(gm, plan=the_plan)
    else:
        options = {k: v for k, v in {"cluster": cluster, "memory_budget": memory_budget,
                                     "precision": precision, "measure": measure or None}.items() if v is not None}
        dm = transform(gm, global_batch_size=global_batch_size, **options)
        the_plan = dm.plan if hasattr(dm, "plan") else None
    if init:
        dm.load_pretrained(init, model=model)
    else:
        dm.init_weights(seed=seed, model=model)
    del model
    opt = torch.optim.AdamW(param_groups(dm.named_parameters(), weight_decay), lr=lr, eps=1e-8)
    sched = schedule(opt, steps, warmup if warmup is not None else max(1, min(100, steps // 10)))
    start = 0
    if resume and checkpoint.latest(ckpt_dir):
        start = checkpoint.load(dm, opt, checkpoint.latest(ckpt_dir))
        for _ in range(start):
            sched.step()
        say(f"resumed from {checkpoint.latest(ckpt_dir)} at step {start}")
    cl = resolve_cluster(cluster) if cluster is not None else None
    peak = _peak(cl, the_plan)
    per_token = flops_per_token(config, n_params, seq_len)
    records = []
    log = open(log_json, "a" if resume else "w") if (log_json and rank == 0) else None
    tokens_per_step = global_batch_size * seq_len
    index, size = dm.input_shard   # NOTE: each rank hands train_step only its shard of the batch
    for step in range(start, steps):
        batch = {k: v[index::size].to(device) for k, v in blocks.batch_at(step).items()}
        t0 = time.perf_counter()
        loss = dm.train_step(**batch)
        norm = dm.clip_grad_norm_(clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": float(loss), "grad_norm": float(norm),
               "lr": float(opt.param_groups[0]["lr"]), "tokens_per_s": tokens_per_step / dt,
               "step_time_s": dt}
        rec["mfu"] = rec["tokens_per_s"] * per_token / (peak * world) if peak else None
        records.append(rec)
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        mfu = f"  mfu {100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else ""
        say(f"step {step + 1:>5}/{steps}  loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  lr "
            f"{rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s{mfu}")
        if save_every and (step + 1) % save_every == 0:
            checkpoint.save(dm, opt, os.path.join(ckpt_dir, f"step-{step + 1}"), step=step + 1, config=config)
            say(f"saved {os.path.join(ckpt_dir, f'step-{step + 1}')}")
    if log is not None:
        log.close()
    timed = records[1:] or records   # NOTE: step 1 includes the first-use costs
    searched = getattr(dm, "plan", None) if plan is None else None   # NOTE: a loaded plan carries its measuring run's records
    summary = {"first_loss": records[0]["loss"] if records else None,
               "last_loss": records[-1]["loss"] if records else None,
               "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / max(1, len(timed)),
               "steps": len(records), "tokens": tokens_per_step * len(records), "tokenizer": kind,
               "plan": sorted({lp.strategy.label for lp in dm.plan.layers}) if hasattr(dm, "plan") else None,
               "measured": searched and searched.extra.get("measured"),   # this run's measured selection
               "measure": searched and searched.extra.get("measure")}
    return {"records": records, "summary": summary, "rank": rank}


def _peak(cluster, plan) -> float | None:
    """Per-device peak FLOP/s for the MFU: the given cluster's, else the plan's recorded cluster's."""
    c = cluster
    if c is None and plan is not None and plan.cluster:
        from .cluster import Cluster

        try:
            c = Cluster.from_dict(plan.cluster)
        except ConfigError:
            c = None
    if c is None:
        return None
    dtype = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(getattr(plan, "precision", "fp32"), "fp32")
    peaks = getattr(c, "peak_flops", {}) or {}
    return float(peaks.get(dtype) or peaks.get("fp32") or 0.0) or None


def print_summary(log: dict, out=None) -> None:
    out = out or sys.stdout   # NOTE: read when called (a redirected or captured stdout)
    s = log["summary"]
    print(f"trained {s['steps']} steps ({s['tokens']:,} tokens, {s['tokenizer']}): loss {s['first_loss']:.4f} -> "
          f"{s['last_loss']:.4f}, {s['tokens_per_s']:,.0f} tokens/s; plan {s['plan']}", file=out)
    from .selection import measured_lines

    for line in measured_lines(s.get("measured") or []):   # the measured final selection's candidates
        print(f"  {line}", file=out)
