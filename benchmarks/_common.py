"""Shared helpers of the benchmark scripts: argument parsing, table printing, JSON output."""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    return p


def machine() -> dict:
    return {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
            "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "cpus": torch.get_num_threads()}


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in headers]] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, r in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 or k == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine(), **data}, f, indent=2, sort_keys=True)
            f.write("\n")
        print(f"wrote {path}")


def ckpt_word(ckpt) -> str:
    """A layer's checkpointing in a plan label: ``" sac"`` (selective), ``" sac-op"`` (torchtitan's op
    policy), ``" ckpt"`` (full) or nothing."""
    return {"selective": " sac", "selective-op": " sac-op"}.get(ckpt, " ckpt") if ckpt else ""


def plan_text(plan) -> str:
    """Short text of a plan: ``pp4 m16 | tp1 ep8 zero2 ckpt`` (distinct layer strategies)."""
    kinds = []
    for lp in plan.layers:
        s = f"tp{lp.tp}" + (f" ep{lp.ep}" if lp.ep > 1 else "") + (f" {lp.sdp}" if lp.sdp != "none" else "") \
            + (" sp" if lp.sp else "") + ckpt_word(lp.ckpt)
        if s not in kinds:
            kinds.append(s)
    return f"pp{plan.pp} m{plan.micro_batches} | " + ", ".join(kinds)


def token_batches(n: int, vocab: int, batch: int, seq: int) -> list[dict]:
    """``n`` batches of ``batch`` random sequences of ``seq`` tokens (no padding: labels = inputs),
    the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append(dict(input_ids=ids, labels=ids.clone()))
    return out


def train_stepper(dm, opt, batches):
    """A training step: ``dm.train_step`` on the next batch (cycling), then ``opt.step()``."""
    k = [0]

    def step():
        dm.train_step(**batches[k[0] % len(batches)])
        opt.step()
        k[0] += 1
    return step


def practitioner(gm, cluster, global_batch_size: int, precision: str) -> dict:
    """The best of the baselines practitioners run (``planner.PRACTITIONER_BASELINES``: Megatron-LM,
    FSDP, FSDP + TP, each searched over its own knobs) at this batch: ``{"practitioner": samples/s,
    "practitioner_plan": "name: configuration"}``, or ``{"practitioner_error": ...}`` when none fits."""
    from galvatron_fx.planner import PRACTITIONER_BASELINES, baselines

    base = baselines(gm, cluster, None, global_batch_size, names=list(PRACTITIONER_BASELINES), precision=precision)
    fits = {k: v for k, v in base.items() if v != "oom"}
    if not fits:
        return {"practitioner_error": "no practitioner baseline fits"}
    name = max(fits, key=lambda k: fits[k]["throughput_samples_s"])
    return {"practitioner": fits[name]["throughput_samples_s"], "practitioner_plan": f"{name}: {fits[name]['config']}"}


def register_attention(name: str, fn) -> str:
    """Register ``fn`` as transformers attention implementation ``name``, with sdpa's mask rule (no
    mask for a causal batch without padding); returns ``name``. NOTE: a name containing "flash" is
    taken by transformers for its flash-attn kernels."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
