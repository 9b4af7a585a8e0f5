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
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from . import resume as resumer
from . import watch
from .errors import ConfigError, TrainingError
from .watch import Board


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
               measure: int = 0, init: str | None = None, save_every: int = 0, ckpt_dir: str = "checkpoints",
               resume: bool = False, log_json: str | None = None, seed: int = 0, overrides: dict | None = None,
               timeout: float | None = None, tensorboard: str | None = None, progress=None) -> dict:
    """Train the config at ``config_spec`` on ``data`` (module docstring); returns the log
    ``{"records": [...], "summary": {...}}`` (rank 0's; every rank computes the same figures).

    Raises :class:`~galvatron_fx.errors.TrainingError` on a non-finite loss or gradient norm
    (fp32, bf16-mixed; fp16-mixed skips such steps and rescales) and when a collective fails
    because a peer died or stayed silent longer than ``timeout`` seconds."""
    from . import checkpoint
    from .distributed import init_distributed, pick_device

    path = _check_args(config_spec, steps, global_batch_size, seq_len)
    init_distributed(timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = progress if (progress and rank == 0) else (lambda _msg: None)
    auto = resumer.restart_count() > 0
    if save_every or resume or auto:
        resumer.check_stopped(ckpt_dir, clear=rank == 0)
    point = resumer.find(ckpt_dir) if (resume or auto) else None
    if (resume or auto) and point is None:
        say(f"no checkpoint in {ckpt_dir}: starting at step 1")
    run = _build(path, data, seq_len, global_batch_size, seed, overrides, point, world, plan,
                 {"cluster": cluster, "memory_budget": memory_budget, "precision": precision,
                  "measure": measure or None}, init, say)
    dm = run["dm"]
    opt = torch.optim.AdamW(param_groups(dm.named_parameters(), weight_decay), lr=lr, eps=1e-8)
    sched = schedule(opt, steps, warmup if warmup is not None else max(1, min(100, steps // 10)))
    start = 0
    if point is not None:
        start = checkpoint.load(dm, opt, point.path)
        with warnings.catch_warnings():   # the schedule's steps of the loaded run: no optimizer step here
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            for _ in range(start):
                sched.step()
        say(f"loaded {point.path}: continuing at step {start + 1}")
        if log_json and rank == 0:
            resumer.trim_log(log_json, start)
    before = resumer.last_beat(ckpt_dir) if point is not None else None
    loop = _Loop(dm, opt, sched, run, pick_device(), steps=steps, clip=clip, save_every=save_every,
                 ckpt_dir=ckpt_dir, cluster=cluster, say=say,
                 log=open(log_json, "a" if point is not None else "w") if (log_json and rank == 0) else None,
                 board=Board(tensorboard) if (tensorboard and rank == 0) else None)
    try:
        records = loop.run(start, lambda: say(resumer.restart_line(point, world, run["plan_why"], _labels(dm),
                                                                   before, time.time())) if point else None)
    finally:
        loop.close()
    timed = records[1:] or records   # NOTE: step 1 includes the first-use costs
    searched = getattr(dm, "plan", None) if run["plan"] is None else None   # a given plan carries its own records
    tokens_per_step = global_batch_size * seq_len
    summary = {"first_loss": records[0]["loss"] if records else None,
               "last_loss": records[-1]["loss"] if records else None,
               "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / max(1, len(timed)),
               "steps": len(records), "tokens": tokens_per_step * len(records), "tokenizer": run["kind"],
               "plan": _labels(dm) or None, "start_step": start,
               "measured": searched and searched.extra.get("measured"),   # this run's measured selection
               "measure": searched and searched.extra.get("measure")}
    return {"records": records, "summary": summary, "rank": rank}


def _check_args(config_spec: str, steps: int, global_batch_size: int, seq_len: int) -> str:
    from .models.hf_config import config_path

    path = config_path(config_spec)
    if path is None:
        raise ConfigError(f"{config_spec!r} is not a transformers config.json (or a directory holding one)")
    if "RANK" not in os.environ and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("galvatron-fx train --data runs under torchrun (e.g. torchrun --nproc-per-node 2 -m "
                          "galvatron_fx.cli train CONFIG --data FILE)")
    for name, value in (("--steps", steps), ("--global-batch-size", global_batch_size), ("--seq-len", seq_len)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    return path


def _build(path, data, seq_len, global_batch_size, seed, overrides, point, world, plan, options, init, say) -> dict:
    """Data, model (meta device, captured), plan (:func:`galvatron_fx.resume.choose_plan`), the
    distributed model with its weights: ``{"dm", "blocks", "kind", "config", "n_params", "plan",
    "plan_why"}``."""
    from . import capture, transform
    from .models.hf_config import from_config, load_config

    config = load_config(path)
    tokens, kind = tokenize(data, os.path.dirname(os.path.abspath(path)), int(config.vocab_size))
    blocks = TextBlocks(tokens, seq_len, global_batch_size, seed)
    say(f"{data}: {tokens.numel():,} tokens ({kind}), {blocks.blocks.shape[0]} blocks of {seq_len}, "
        f"{blocks.per_epoch} steps per epoch")
    # NOTE: built and captured on the meta device; each rank materialises only its parts below
    model, _ = from_config(path, device="meta", seq_len=seq_len, batch=1, seed=seed, **(overrides or {}))
    n_params = sum(p.numel() for p in model.parameters())
    example = {k: v.to("meta") for k, v in blocks.batch_at(0).items()}
    gm = capture(model, (), kwargs=example, method="dynamo")
    the_plan, why = resumer.choose_plan(point, world, plan)
    if the_plan is not None:
        dm = transform(gm, plan=the_plan)
    else:
        dm = transform(gm, global_batch_size=global_batch_size, **{k: v for k, v in options.items() if v is not None})
    if init:
        dm.load_pretrained(init, model=model)
    else:
        dm.init_weights(seed=seed, model=model)
    return {"dm": dm, "blocks": blocks, "kind": kind, "config": config, "n_params": n_params,
            "plan": the_plan, "plan_why": why}


def _labels(dm) -> list[str]:
    return sorted({lp.strategy.label for lp in dm.plan.layers}) if hasattr(dm, "plan") else []


class _Loop:
    """The steps of one run: batches, step, clip, checks, records, checkpoints, heartbeat."""

    def __init__(self, dm, opt, sched, run: dict, device, *, steps, clip, save_every, ckpt_dir, cluster, say,
                 log, board):
        from .planner import resolve_cluster

        self.dm, self.opt, self.sched, self.run_info, self.device = dm, opt, sched, run, device
        self.steps, self.clip, self.save_every, self.ckpt_dir, self.say = steps, clip, save_every, ckpt_dir, say
        self.log, self.board = log, board
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        plan = getattr(dm, "plan", None)
        self.peak_flops = _peak(resolve_cluster(cluster) if cluster is not None else None, plan)
        self.per_token = flops_per_token(run["config"], run["n_params"], run["blocks"].blocks.shape[1])
        self.tokens_per_step = run["blocks"].batch * run["blocks"].blocks.shape[1]
        self.estimate = max((watch.estimated_peak(plan, r) or 0 for r in range(self.world)), default=0) or None \
            if plan is not None else None
        self.checks_finite = getattr(plan, "precision", "fp32") != "fp16-mixed"   # fp16: skip-and-rescale
        self.eta = watch.Eta()

    def run(self, start: int, after_first) -> list[dict]:
        from .distributed import synchronize

        index, size = self.dm.input_shard   # NOTE: each rank hands train_step only its shard of the batch
        records = []
        for step in range(start, self.steps):
            batch = {k: v[index::size].to(self.device) for k, v in self.run_info["blocks"].batch_at(step).items()}
            t0 = time.perf_counter()
            try:
                loss = self.dm.train_step(**batch)
                norm = self.dm.clip_grad_norm_(self.clip)
                self._check_finite(step + 1, float(loss), float(norm))
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                synchronize(self.device)
                dt = time.perf_counter() - t0
                rec = self._record(step + 1, float(loss), float(norm), dt)
            except (RuntimeError, dist.DistError) as exc:
                _raise_if_peer_lost(exc, step + 1)
                raise
            records.append(rec)
            if step == start:
                after_first()
            try:
                self._save(step + 1)
            except (RuntimeError, dist.DistError, CheckpointException) as exc:
                _raise_if_peer_lost(exc, step + 1, "of the checkpoint write ")
                raise
        return records

    def _check_finite(self, step: int, loss: float, norm: float) -> None:
        if not self.checks_finite or (math.isfinite(loss) and math.isfinite(norm)):
            return
        from . import checkpoint

        last = checkpoint.latest(self.ckpt_dir) if self.save_every else None
        msg = (f"step {step}: the loss is {loss} and the gradient norm {norm} under "
               f"{getattr(self.dm.plan, 'precision', 'fp32')}: stopped before the optimizer step "
               + (f"(the newest checkpoint, {last}, is intact)" if last else "(no checkpoint saved yet)")
               + "; lower --lr, raise --warmup or check the data")
        if self.rank == 0 and self.save_every:
            resumer.mark_stopped(self.ckpt_dir, step, msg)
        raise TrainingError(msg, every_rank=True)

    def _record(self, step: int, loss: float, norm: float, dt: float) -> dict:
        rec = {"step": step, "loss": loss, "grad_norm": norm, "lr": float(self.opt.param_groups[0]["lr"]),
               "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt, "time": time.time()}
        rec["mfu"] = rec["tokens_per_s"] * self.per_token / (self.peak_flops * self.world) if self.peak_flops else None
        per_rank = watch.peaks(self.device)
        rec["peak_bytes"], rec["estimate_bytes"] = max(per_rank), self.estimate
        self.eta.add(dt)
        if self.log is not None:
            self.log.write(json.dumps(rec) + "\n")
            self.log.flush()
        if self.board is not None:
            self.board.write(rec, per_rank)
        if self.rank == 0 and self.save_every:
            resumer.beat(self.ckpt_dir, step, self.world)
        mfu = f"  mfu {100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else ""
        est = f" (plan {self.estimate / 2**30:.2f} + reserve)" if self.estimate else ""
        self.say(f"step {step:>5}/{self.steps}  loss {loss:.4f}  grad_norm {norm:.3f}  lr {rec['lr']:.2e}  "
                 f"{rec['tokens_per_s']:,.0f} tok/s{mfu}  {watch.peak_word(self.device)} {rec['peak_bytes'] / 2**30:.2f} GiB{est}  "
                 f"eta {self.eta.remaining(self.steps - step)}")
        return rec

    def _save(self, step: int) -> None:
        from . import checkpoint

        if self.save_every and step % self.save_every == 0:
            where = os.path.join(self.ckpt_dir, f"step-{step}")
            checkpoint.save(self.dm, self.opt, where, step=step, config=self.run_info["config"])
            self.say(f"saved {where}")

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.board is not None:
            self.board.close()


def _raise_if_peer_lost(exc: BaseException, step: int, what: str = "") -> None:
    """A collective that failed because a peer died or hung: one :class:`TrainingError` line
    (``what``: which collective, e.g. the checkpoint write's; DCP wraps its ranks' failures in a
    ``CheckpointException``: the first rank's failure is the one named)."""
    inner = exc
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))[0]
    text = str(inner)
    if not (isinstance(inner, dist.DistError) or any(k in text for k in (
            "gloo", "Gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out"))):
        return
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(inner).__name__)
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise TrainingError(f"step {step}: a collective {what}failed on rank {rank} ({first[:240]}): a peer died "
                        "or stayed silent past the collective timeout (--timeout); under torchrun --max-restarts "
                        "the workers restart and resume from the newest checkpoint") from exc


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
