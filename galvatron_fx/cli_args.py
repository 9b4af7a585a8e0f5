"""The ``galvatron-fx`` command line's arguments: the parser (one line per mistake, never the usage
dump), the argument types, and the checks that need only the arguments and the cluster, made
before any capture or search. :mod:`galvatron_fx.cli` runs the commands."""

from __future__ import annotations

import argparse
import os
import re

from . import models
from .errors import ConfigError
from .models.hf_config import config_path


def memory_budget_arg(text: str, cluster) -> int:
    """``--memory-budget``: bytes with a unit, at most the device's memory (checked before any work)."""
    from .units import format_bytes, parse_bytes

    if text.strip().replace(".", "", 1).isdigit():
        raise ConfigError(f"--memory-budget {text}: give a unit, e.g. {text}GiB (a bare number would be bytes)")
    budget = parse_bytes(text, "memory budget")
    if budget > cluster.device_memory:
        raise ConfigError(f"--memory-budget {text} exceeds the device memory of {cluster.name} "
                          f"({format_bytes(cluster.device_memory)}); give at most that")
    return budget


def check_output(path: str | None, flag: str) -> None:
    """An output file's directory exists and is writable, checked before the search."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: no such directory {folder}; create it first")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: directory {folder} is not writable")


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def check_degrees(args: argparse.Namespace, world: int, where: str) -> None:
    """Pinned degrees that cannot split ``world`` devices, and ``--ep`` on a transformers config
    without experts, refused by name before the capture."""
    from .solver.configs import divisors

    cons = pipeline_constraints(args)
    ok = ", ".join(map(str, divisors(world)))
    for key, what in (("pp", "pipeline"), ("ep", "expert-parallel"), ("cp", "context-parallel")):
        values = cons.get(key)
        for v in values if isinstance(values, list) else [values] if values else []:
            if v < 1 or world % v:
                raise ConfigError(f"--{key} {getattr(args, key)}: a {what} degree must divide the {world} devices of "
                                  f"{where}; use one of {ok}")
    if any(e > 1 for e in cons.get("ep", [])) and config_path(args.model):
        from .models.hf_config import load_config

        cfg = load_config(config_path(args.model))
        if not any(getattr(cfg, k, None) for k in _EXPERT_KEYS):
            raise ConfigError(f"--ep {args.ep}: {args.model} is a dense model (its config names no experts); drop --ep")


def pipeline_constraints(args: argparse.Namespace) -> dict:
    """Search constraints from ``--pp`` / ``--schedule`` / ``--virtual-stages`` / ``--ckpt`` /
    ``--offload`` / ``--ep`` / ``--cp`` / ``--cp-kind`` (those given)."""
    out = {k: getattr(args, k) for k in ("pp", "schedule", "virtual_stages", "micro_batches")
           if getattr(args, k, None) is not None}
    if getattr(args, "ckpt", None) is not None:   # --ckpt [full | selective]: every layer; --no-ckpt: none
        out["ckpt"] = {"full": "all", "selective": "selective", "selective-op": "selective-op",
                       "none": False}[args.ckpt]
    if getattr(args, "offload", None) is not None:   # --offload: every ZeRO layer; --no-offload: none
        out["offload"] = "optimizer" if args.offload else False
    for key, example in (("ep", "4 or 1,2,4,8"), ("cp", "4 or 1,2,4,8")):
        if getattr(args, key, None):
            try:
                out[key] = [int(e) for e in str(getattr(args, key)).split(",")]
            except ValueError:
                raise ConfigError(f"--{key} takes degrees like {example}, got {getattr(args, key)!r}") from None
    if getattr(args, "cp_kind", None):
        out["cp_kind"] = args.cp_kind
    out.update(dimension_constraints(getattr(args, "constrain", None) or []))
    return out


def dimension_constraints(items: list[str]) -> dict:
    """``--constrain KEY=VALUE`` (repeatable): a search constraint a registered dimension adds
    (:func:`galvatron_fx.dims.constraint_keys`), so a dimension reaches the command line without a
    flag of its own. VALUE: ``true`` / ``false``, an integer, a comma-separated list, or a word."""
    from . import dims

    known = dims.constraint_keys()
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            raise ConfigError(f"--constrain {item!r}: use KEY=VALUE with KEY one of {', '.join(known)}")
        out[key] = _constraint_value(text.strip())
    return out


def _constraint_value(text: str):
    if "," in text:
        return [_constraint_value(t.strip()) for t in text.split(",") if t.strip()]
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def add_calibrate_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-calibrate", action="store_true",
                   help="with --measure and --cluster FILE: do not write the time scales fitted to the measured "
                        "candidates into FILE (default: write them, so the next search starts closer)")


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    from .planner import CP_MIN_SEQ
    from .solver.schedules import SCHEDULES

    p.add_argument("--pp", type=_positive_int, metavar="N", help="pin the pipeline degree of the search")
    p.add_argument("--schedule", choices=list(SCHEDULES),
                   help="pin the pipeline schedule (default: search all but gpipe)")
    p.add_argument("--virtual-stages", type=_positive_int, metavar="V",
                   help="pin the chunks per pipeline rank (interleaved schedules; default: searched)")
    p.add_argument("--micro-batches", type=_positive_int, metavar="N",
                   help="pin the micro-batches per step (default: searched)")
    ckpt = p.add_mutually_exclusive_group()
    ckpt.add_argument("--ckpt", nargs="?", const="full", choices=("full", "selective", "selective-op"),
                      metavar="MODE",
                      help="--ckpt: checkpoint every layer fully; --ckpt selective: every layer selectively "
                           "(matmul and attention outputs kept, the rest recomputed); --ckpt selective-op: "
                           "torchtitan's op policy (every second linear matmul recomputed too); default: "
                           "searched per layer (none, selective, full)")
    ckpt.add_argument("--no-ckpt", dest="ckpt", action="store_const", const="none",
                      help="checkpoint no layer")
    offload = p.add_mutually_exclusive_group()
    offload.add_argument("--offload", action="store_const", const=True,
                         help="CPU offload on every ZeRO layer: optimizer states and fp32 masters in host memory, "
                              "the optimizer stepping on the host (default: searched per layer where the cluster "
                              "has a host)")
    offload.add_argument("--no-offload", dest="offload", action="store_const", const=False, help="offload no layer")
    p.add_argument("--ep", metavar="N[,N...]",
                   help="expert-parallel degrees the MoE layers may take (e.g. 8, or 1,2,4,8; default: searched)")
    p.add_argument("--cp", metavar="N[,N...]",
                   help="context-parallel degrees the layers may take (e.g. 4: every layer that can splits its "
                        "sequence over 4 ranks; 1,2,4: searched per layer; default: searched from sequences of "
                        f"{CP_MIN_SEQ} positions, else 1)")
    p.add_argument("--constrain", action="append", metavar="KEY=VALUE",
                   help="a search constraint of a registered dimension (repeatable), e.g. --constrain "
                        "offload=optimizer; the keys are listed in docs/search.md")
    p.add_argument("--cp-kind", choices=["ring", "ulysses"],
                   help="context-parallel attention: ring (key / value shards passed around) or ulysses "
                        "(all-to-alls over heads); default: both searched")


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_count = _int_at_least(0, "a non-negative integer")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _bytes_arg(text: str) -> float:
    """A byte size with a unit (``--reserve``), zero allowed."""
    from .units import parse_bytes

    if text.strip().lstrip("-").replace(".", "", 1).isdigit():
        if float(text) == 0:   # no reserve: needs no unit
            return 0
        raise argparse.ArgumentTypeError(f"give a unit, e.g. {text}GiB (a bare number would be bytes)")
    try:
        value = parse_bytes(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


class _OneLineParser(argparse.ArgumentParser):
    """Argument mistakes in one line on stderr (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def join_negative_values(argv: list[str]) -> list[str]:
    """``--memory-budget -16GiB`` as ``--memory-budget=-16GiB``: argparse takes a value that starts
    with ``-`` and a digit for an option, then reports "expected one argument"; joined, the value
    reaches its own check ("must be positive")."""
    out: list[str] = []
    for tok in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", tok):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="galvatron-fx",
        description="Automatic hybrid parallelism (DP, ZeRO, TP, PP, checkpointing) for PyTorch models.")
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"galvatron-fx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    _add_layers(sub)
    _add_plan(sub)
    _add_show(sub)
    _add_profile(sub)
    _add_train(sub)
    _add_consolidate(sub)
    return parser


def _add_layers(sub) -> None:
    """The ``layers`` command's arguments."""
    p = sub.add_parser("layers", help="capture a model and print its layers",
                       description="Capture MODEL (a zoo name or package.module:factory) and print its layers.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--method", default="dynamo", choices=["dynamo", "export", "fx"], help="capture front end")
    p.add_argument("--seq-len", type=_positive_int, metavar="N", help="sequence length of the example inputs")
    p.add_argument("--device", default="meta", choices=["meta", "cpu"],
                   help="build zoo models on meta (no weight memory; default) or cpu")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="model override, e.g. --set layers=4 --set hidden=256 (repeatable)")
    p.add_argument("--tp", type=_positive_int, metavar="N",
                   help="also report what tensor parallelism of degree N shards in each layer, and why the rest stays whole")
    p.add_argument("--sp", action="store_true", help="with --tp: analyse with sequence parallelism")
    p.add_argument("--tp-details", action="store_true", help="with --tp: list every parameter of every layer")
    p.add_argument("--json", metavar="PATH", help="also write the layer list as JSON")


def _add_plan(sub) -> None:
    """The ``plan`` command's arguments."""
    p = sub.add_parser("plan", help="search a parallel plan for a model on a cluster",
                       description="Search the best hybrid-parallel plan for MODEL (built on the meta device: "
                                   "no weight memory) on CLUSTER under a per-device memory budget. MODEL is a "
                                   "transformers config.json (or its directory), a zoo name ("
                                   + ", ".join(models.names()) + ") or package.module:factory.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--cluster", required=True, help="preset (e.g. 8xA100-80GB, 2x8xH100-80GB) or cluster JSON")
    p.add_argument("--memory-budget", help="per-device budget, e.g. 16GiB (default: the device memory)")
    p.add_argument("--global-batch-size", type=_positive_int, help="samples per step (default: chosen for throughput)")
    p.add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed"],
                   help="training precision (fp32 master weights and optimizer states, compute in bf16 / "
                        "fp16); default by cluster: bf16-mixed on A100/H100/H200, fp16-mixed on V100 / RTX "
                        "TITAN, fp32 on CPU / local")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="legacy spelling: bf16 / fp16 mean "
                   "--precision bf16-mixed / fp16-mixed")
    p.add_argument("--mixed-precision", action="store_true", help="legacy: with --dtype bf16|fp16")
    p.add_argument("--reserve", type=_bytes_arg, help="framework reserve per device (default 1GiB)")
    p.add_argument("--method", choices=["dynamo", "export", "fx"],
                   help="capture front end (default fx; dynamo for a transformers config)")
    p.add_argument("--seq-len", type=_positive_int, metavar="N", help="sequence length of the example inputs")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="model override (repeatable)")
    p.add_argument("--float8", action="store_true",
                   help="plan the model with Float8 linears (galvatron_fx.models.float8.convert_to_float8: "
                        "fp8 matmuls, the output projection in 16 bits), as a Float8 training run has them; "
                        "needs fp8 tensor cores (H100 / H200) and a dynamo or fx capture")
    p.add_argument("--fused-pointwise", action="store_true",
                   help="price the ops outside matmuls and attention as torch.compile fuses them (for a run "
                        "that compiles its model; default: eagerly, as this runtime runs them)")
    p.add_argument("--async-tp", action="store_true",
                   help="price each sequence-parallel all-gather / reduce-scatter pipelined against its "
                        "matmuls, as torch's async TP runs them (default: blocking, as this runtime runs them)")
    p.add_argument("--baselines", action="store_true",
                   help="also estimate DP, ZeRO-3, TP, PP, 3D, DP+TP, DP+PP and Megatron-style (megatron)")
    p.add_argument("--measure", type=_count, default=0, metavar="K",
                   help="under torchrun: time the K best plans and the baselines on the live ranks (the model's "
                        "parts randomly initialised) and keep the fastest (default 0: the estimate's best)")
    add_calibrate_arg(p)
    p.add_argument("--json", metavar="PATH", help="write the plan JSON (with baselines) to PATH")
    p.add_argument("--plot", metavar="PATH", help="draw the plan (PNG/SVG/PDF; needs matplotlib)")
    _add_pipeline_args(p)


def _add_show(sub) -> None:
    """The ``show`` command's arguments."""
    p = sub.add_parser("show", help="print a saved plan", description="Print PLAN.json as a table.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--plot", metavar="PATH", help="also draw the plan (PNG/SVG/PDF; needs matplotlib)")


def _add_profile(sub) -> None:
    """The ``profile`` command's arguments."""
    p = sub.add_parser("profile", help="measure the local cluster (run under torchrun for several ranks)",
                       description="Measure collective bandwidth/latency, overlap slowdown and compute "
                                   "throughput of the torch.distributed world (or this process).")
    p.add_argument("--out", metavar="PATH", help="write the cluster JSON to PATH")
    p.add_argument("--repeats", type=_positive_int, default=7, metavar="N",
                   help="timed runs per figure and round (median; default 7): fewer is faster and noisier")


def _add_train(sub) -> None:
    """The ``train`` command's arguments."""
    p = sub.add_parser("train", help="train a model with a plan (run under torchrun)",
                       description="Train MODEL on synthetic data with torch.compile(backend='galvatron') under "
                                   "torchrun (gloo on CPU, NCCL on GPU), or eagerly with --single-device; or "
                                   "train a transformers config.json on a text file: MODEL=CONFIG --data FILE.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--data", metavar="FILE", help="text file to train a config.json MODEL on (tokenizer.json "
                   "beside the config, else bytes)")
    p.add_argument("--seq-len", type=_positive_int, metavar="N", help="tokens per sample (--data; default 128)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm (--data; default 1.0)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (--data; not on norms, biases)")
    p.add_argument("--warmup", type=_count, help="linear warm-up steps (--data; default steps/10, at most 100)")
    p.add_argument("--init", metavar="DIR", help="start from from_pretrained(DIR) weights (--data)")
    p.add_argument("--save-every", type=_count, default=0, metavar="N", help="sharded checkpoint every N steps (--data)")
    p.add_argument("--ckpt-dir", default="checkpoints", help="checkpoint directory (--data; default ./checkpoints)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir (--data; "
                   "automatic when torchrun's agent restarts the workers)")
    p.add_argument("--timeout", type=_positive_float, metavar="SECONDS", help="collective timeout: a peer silent "
                   "this long ends the run with an error (--data; default 600, or GALVATRON_DIST_TIMEOUT_S)")
    p.add_argument("--tensorboard", metavar="DIR", help="write loss, grad norm, lr, tokens/s, MFU and per-device "
                   "peak memory as TensorBoard scalars into DIR (--data; pip install 'galvatron-fx[tensorboard]')")
    p.add_argument("--log-json", metavar="PATH", help="the training log, JSON lines (rank 0): one record per step "
                   "(loss, grad_norm, lr, throughput; mfu with --data), the last one also holding \"run\": the "
                   "summary, per-device memory and the plan; galvatron_fx.train.read_log reads it back")
    p.add_argument("--plan", metavar="PATH", help="plan JSON to run (default: search one at the first step)")
    p.add_argument("--measure", type=_count, default=4, metavar="K",
                   help="without --plan: time the K best plans by estimate and the baselines on the live world "
                        "for a few steps each and train the fastest (default 4; 0: the estimate's best)")
    add_calibrate_arg(p)
    p.add_argument("--steps", type=_positive_int, default=10, help="optimizer steps (default 10)")
    _add_pipeline_args(p)
    p.add_argument("--memory-budget", help="per-device budget for the search, e.g. 16GiB")
    p.add_argument("--global-batch-size", type=_positive_int, help="samples per step (zoo models: sets batch)")
    p.add_argument("--cluster", help="preset or cluster JSON for the search (default: profile the world)")
    p.add_argument("--reserve", type=_bytes_arg, help="framework reserve per device for the search (default 1GiB)")
    p.add_argument("--single-device", action="store_true", help="train eagerly in this one process (reference)")
    p.add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed"],
                   help="training precision: fp32 masters and optimizer states, compute in bf16 / fp16 "
                        "(default: the plan's, else the cluster's)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default 1e-3; 3e-4 with --data)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="model override (repeatable)")
    p.add_argument("--json", metavar="PATH", help=argparse.SUPPRESS)   # NOTE: the former log flag, refused by name


def _add_consolidate(sub) -> None:
    """The ``consolidate`` command's arguments."""
    p = sub.add_parser("consolidate", help="export a checkpoint as safetensors (one process)",
                       description="Read checkpoint CKPT (gfx.checkpoint.save, any plan) in this one process "
                                   "and write the original model's state dict as DIR/model.safetensors, tensor "
                                   "by tensor (memory: about the largest tensor), plus DIR/config.json when the "
                                   "save recorded a transformers config (then from_pretrained(DIR) loads it).")
    p.add_argument("checkpoint", metavar="CKPT", help="a complete checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")

