"""The ``galvatron-fx`` command line.

Subcommands are small functions registered in :data:`COMMANDS`; each gets the parsed arguments and
returns an exit status. Errors on bad input are one line on stderr and a non-zero exit, never a
traceback (set ``GALVATRON_DEBUG=1`` to see it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from . import models
from .errors import ConfigError, GalvatronError
from .models.hf_config import config_path


def progress(msg: str) -> None:
    """Progress output: stderr, so that stdout stays parseable."""
    print(f"[galvatron-fx] {msg}", file=sys.stderr, flush=True)


def parse_overrides(items: list[str] | None, seq_len: int | None = None) -> dict:
    """``["layers=2", "hidden=64", "depths=[2,2]"]`` -> ``{"layers": 2, "hidden": 64, "depths": [2, 2]}``
    (``seq_len``: the ``--seq-len`` option, the example inputs' sequence length)."""
    out = {} if seq_len is None else {"seq_len": int(seq_len)}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. --set layers=2)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_layers(args: argparse.Namespace) -> int:
    """Capture MODEL and print its layer list."""
    from . import layers

    t0 = time.perf_counter()
    model, example_args = models.load(args.model, device=args.device, overrides=parse_overrides(args.set, args.seq_len))
    progress(f"capturing {args.model} with method={args.method} on {args.device}")
    gm = _capture(model, example_args, args.method)
    records = layers(gm)
    info = gm.meta["galvatron"]
    from .sharding.experts import describe, layer_blocks

    moe = {i: describe(b) for i, b in layer_blocks(gm).items()}
    report = None
    if args.tp is not None:
        from .sharding.report import tp_report

        report = tp_report(gm, args.tp, sp=args.sp)
    if args.json:
        rows = [{"index": r.index, "name": r.name, "kind": r.kind, "signature": r.signature,
                 "params": len(r.params), "nodes": len(r.nodes), "consumes_from": r.consumes_from}
                for r in records]
        for row, rep in zip(rows, report or []):
            row["tp_report"] = rep.to_dict()
        for row in rows:
            row["experts"] = moe.get(row["index"])
        _write_json(args.json, {"model": args.model, "method": args.method, "grouping": info.grouping,
                                "fingerprint": info.fingerprint, "layers": rows})
    sigs: dict[str, str] = {}
    print(f"{args.model}: {len(records)} layers ({info.grouping}), captured by {args.method} "
          f"in {time.perf_counter() - t0:.1f}s, fingerprint {info.fingerprint[:12]}")
    tp_col = f"  tp={args.tp}{' sp' if args.sp else ''}" if report else ""
    moe_col = f"  {'experts (ep splits them)':<34}" if moe else ""
    print(f"{'#':>4}  {'name':<28} {'kind':<6} {'sig':<4} {'params':>12} {'nodes':>6}  {'reads from':<10}"
          f"{moe_col}{tp_col}")
    params = {n.meta["galvatron"].param.fqn: n.meta["galvatron"].param
              for n in gm.graph.nodes if n.op == "get_attr" and n.meta["galvatron"].param}
    for k, r in enumerate(records):
        sig = sigs.setdefault(r.signature, chr(ord("A") + len(sigs)) if len(sigs) < 26 else "?")
        numel = sum(params[p].numel for p in r.params)
        cell = f"  {report[k].summary()}" if report else ""
        experts = f"  {moe.get(r.index, '-'):<34}" if moe else ""
        print(f"{r.index:>4}  {r.name:<28} {r.kind:<6} {sig:<4} {numel:>12,} {len(r.nodes):>6}  "
              f"{','.join(map(str, r.consumes_from)) or '-':<10}{experts}{cell}")
    if report:
        _print_tp_details(report, every=args.tp_details)
    return 0


def _print_tp_details(report, every: bool) -> None:
    """What stays whole under TP and why: every parameter (``every``), else the layers that shard
    nothing or run some linear / embedding replicated, once per distinct explanation."""
    seen: set[tuple] = set()
    for rep in report:
        if every:
            print("\n".join(rep.lines()))
            continue
        notable = rep.notable_whole()
        key = (rep.summary(), tuple(sorted(set(notable.values()))))
        if not notable or key in seen:
            continue
        seen.add(key)
        print(f"layer {rep.layer} {rep.name}: {rep.summary()}")
        for fqn, why in notable.items():
            print(f"    replicated  {fqn}: {why}")


PLAN_SEQ_CAP = 8192
"""Longest context a transformers config plans at by default (longer ones say so and take
``--seq-len`` to go beyond): the pre-training length of today's long-context models."""


def _config_seq_len(spec: str, given: int | None) -> tuple[int | None, str]:
    """``(sequence length, where it came from)`` for a transformers config MODEL: ``--seq-len``, or
    the config's own context length (``max_position_embeddings`` / ``n_positions``) up to
    :data:`PLAN_SEQ_CAP`."""
    from .models.hf_config import load_config

    if given:
        return given, "--seq-len"
    cfg = load_config(config_path(spec))
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if not limit:
        return None, "the zoo default (the config names no context length)"
    if limit > PLAN_SEQ_CAP:
        return PLAN_SEQ_CAP, (f"capped from the config's {limit} positions; --seq-len {limit} plans at the full "
                              "context")
    return int(limit), "the config's context length"


def _capture_for_planning(args: argparse.Namespace, keep: list | None = None):
    overrides = parse_overrides(args.set, args.seq_len)
    method = args.method
    if config_path(args.model):
        overrides.setdefault("batch", 2)   # NOTE: the plan's global batch is separate; meta costs nothing
        method = method or "dynamo"        # NOTE: transformers models do not trace with fx
        seq, source = _config_seq_len(args.model, args.seq_len)
        if seq:
            overrides["seq_len"] = seq
        args.seq_note = f"seq_len {seq or '?'} ({source})"
        from .models.hf_config import defaulted_sizes

        left = defaulted_sizes(config_path(args.model))
        if left:
            args.defaults_note = f"{', '.join(left)} (transformers' defaults: {args.model} does not set them)"
    model, example_args = models.load(args.model, device="meta", overrides=overrides)
    if keep is not None:
        keep.append(model)   # the captured graph holds it weakly; measuring initialises from it
    method = method or "fx"
    progress(f"capturing {args.model} on the meta device (method={method})")
    return _capture(model, example_args, method)


def _capture(model, example, method: str):
    """Capture a loaded model; a factory may give its example inputs as keywords (a dict), as
    transformers models are called."""
    from . import capture

    if isinstance(example, dict):
        return capture(model, (), kwargs=example, method=method)
    return capture(model, example, method=method)


def _budget(text: str, cluster) -> int:
    """``--memory-budget``: bytes with a unit, at most the device's memory (checked before any work)."""
    from .units import format_bytes, parse_bytes

    if text.strip().replace(".", "", 1).isdigit():
        raise ConfigError(f"--memory-budget {text}: give a unit, e.g. {text}GiB (a bare number would be bytes)")
    budget = parse_bytes(text, "memory budget")
    if budget > cluster.device_memory:
        raise ConfigError(f"--memory-budget {text} exceeds the device memory of {cluster.name} "
                          f"({format_bytes(cluster.device_memory)}); give at most that")
    return budget


def _check_output(path: str | None, flag: str) -> None:
    """An output file's directory exists and is writable, checked before the search."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: no such directory {folder}; create it first")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: directory {folder} is not writable")


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _check_degrees(args: argparse.Namespace, world: int, where: str) -> None:
    """Pinned degrees that cannot split ``world`` devices, and ``--ep`` on a transformers config
    without experts, refused by name before the capture."""
    from .solver.engine import divisors

    cons = _pipeline_constraints(args)
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


def _check_applies(args: argparse.Namespace, gm) -> None:
    """Refuse, by name, a dimension pinned on a model where it cannot apply (before the search)."""
    from .sharding.experts import expert_layers

    if getattr(args, "ep", None) and any(int(x) > 1 for x in str(args.ep).split(",") if x.strip().isdigit()) \
            and not expert_layers(gm):
        raise ConfigError(f"--ep {args.ep}: {args.model} has no mixture-of-experts layer to split by expert; "
                          "drop --ep")


def cmd_plan(args: argparse.Namespace) -> int:
    """Search a plan for MODEL on a cluster under a memory budget; optionally print baselines."""
    from .api import search
    from .planner import baselines, resolve_cluster, resolve_precision, speedups
    from .selection import measured_lines

    cluster = resolve_cluster(args.cluster)
    budget = _budget(args.memory_budget, cluster) if args.memory_budget else cluster.device_memory
    _check_output(args.json, "--json")
    _check_output(getattr(args, "plot", None), "--plot")
    _check_degrees(args, cluster.world_size, cluster.name)
    keep: list = []
    gm = _capture_for_planning(args, keep)
    _check_applies(args, gm)
    cost = {"precision": resolve_precision(cluster, args.precision, args.dtype,
                                           True if args.mixed_precision else None)}
    if args.reserve is not None:
        cost["reserve_bytes"] = args.reserve
    rank = 0
    if args.measure:   # under torchrun: every rank times the candidates (galvatron_fx/selection.py)
        from .distributed import init_distributed, shutdown

        rank, world = init_distributed()
        cost.update(measure=args.measure, world_size=world)
    t0 = time.perf_counter()
    plan = search(gm, cluster, budget, args.global_batch_size, progress=progress,
                  constraints=_pipeline_constraints(args) or None, **cost)
    if args.measure:
        shutdown()
    if rank != 0:
        return 0
    progress(f"search took {time.perf_counter() - t0:.2f}s")
    _calibrate(args, plan.extra.get("measure"))
    from .sharding.sequence import sequence_length

    seq = sequence_length(gm)
    if seq:
        plan.extra["seq_len"] = int(seq)
    assumed = [getattr(args, "seq_note", None) or (f"seq_len {seq}" if seq else None),
               f"global batch {plan.global_batch_size} ({'given' if args.global_batch_size else 'searched'})",
               f"precision {plan.precision} ({'given' if args.precision or args.dtype else 'the cluster default'})",
               f"memory budget {args.memory_budget or 'the device memory'}", getattr(args, "defaults_note", None)]
    print("assumed: " + "; ".join(a for a in assumed if a))
    print(plan.explain())
    for line in measured_lines(plan.extra.get("measured", [])):
        print(f"  {line}")
    data = plan.to_dict()
    if args.baselines:
        progress("estimating baselines")
        base = baselines(gm, cluster, budget, plan.global_batch_size, **cost)
        ups = speedups(plan, base)
        _print_baselines(plan, base, ups)
        data["baselines"] = base
        data["speedups"] = ups  # searched throughput / each baseline's (null where it is oom)
    if args.json:
        from .plan import Plan

        Plan.from_dict(data).save(args.json)
        progress(f"wrote {args.json}")
    _maybe_plot(plan, args.plot)
    return 0


def _pipeline_constraints(args: argparse.Namespace) -> dict:
    """Search constraints from ``--pp`` / ``--schedule`` / ``--virtual-stages`` / ``--ep`` / ``--cp`` /
    ``--cp-kind`` (those given)."""
    out = {k: getattr(args, k) for k in ("pp", "schedule", "virtual_stages", "micro_batches")
           if getattr(args, k, None) is not None}
    if getattr(args, "ckpt", None) is not None:   # --ckpt: every layer; --no-ckpt: none
        out["ckpt"] = "all" if args.ckpt else False
    for key, example in (("ep", "4 or 1,2,4,8"), ("cp", "4 or 1,2,4,8")):
        if getattr(args, key, None):
            try:
                out[key] = [int(e) for e in str(getattr(args, key)).split(",")]
            except ValueError:
                raise ConfigError(f"--{key} takes degrees like {example}, got {getattr(args, key)!r}") from None
    if getattr(args, "cp_kind", None):
        out["cp_kind"] = args.cp_kind
    return out


def _add_calibrate_arg(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--ckpt", action=argparse.BooleanOptionalAction, default=None,
                   help="--ckpt: checkpoint every layer; --no-ckpt: none (default: searched per layer)")
    p.add_argument("--ep", metavar="N[,N...]",
                   help="expert-parallel degrees the MoE layers may take (e.g. 8, or 1,2,4,8; default: searched)")
    p.add_argument("--cp", metavar="N[,N...]",
                   help="context-parallel degrees the layers may take (e.g. 4: every layer that can splits its "
                        "sequence over 4 ranks; 1,2,4: searched per layer; default: searched from sequences of "
                        f"{CP_MIN_SEQ} positions, else 1)")
    p.add_argument("--cp-kind", choices=["ring", "ulysses"],
                   help="context-parallel attention: ring (key / value shards passed around) or ulysses "
                        "(all-to-alls over heads); default: both searched")


def _maybe_plot(plan, path: str | None) -> None:
    if path:
        from .plot import plot_plan

        progress(f"wrote {plot_plan(plan, path)}")


def _print_baselines(plan, base: dict, ups: dict) -> None:
    """The baselines' estimates beside the searched plan's (``plan --baselines``, ``show``)."""
    print(f"\nbaselines (same cost model, global batch {plan.global_batch_size}):")
    print(f"  {'strategy':<10} {'samples/s':>12} {'peak memory':>12}  {'speedup':>7}  configuration")
    for name, est in base.items():
        if est == "oom":
            print(f"  {name:<10} {'oom':>12} {'-':>12}  {'-':>7}")
        else:
            up = ups.get(name)
            print(f"  {name:<10} {est['throughput_samples_s']:>12.3f} "
                  f"{max(est['memory_bytes_per_device']) / 2**30:>11.2f}G  {f'{up:.2f}x' if up else '-':>7}  "
                  f"{est.get('config', '')}")
    print(f"  {'searched':<10} {plan.estimate['throughput_samples_s']:>12.3f} "
          f"{max(plan.estimate['memory_bytes_per_device']) / 2**30:>11.2f}G")


def cmd_show(args: argparse.Namespace) -> int:
    """Print a saved plan as a table, and the baselines stored with it."""
    from .plan import Plan

    plan = Plan.load(args.plan)
    print(plan.explain())
    with open(args.plan) as f:
        stored = json.load(f)
    if isinstance(stored.get("baselines"), dict):
        _print_baselines(plan, stored["baselines"], stored.get("speedups") or {})
    _maybe_plot(plan, args.plot)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure the local torch.distributed world (run under torchrun) or this process."""
    from .cluster import Cluster
    from .distributed import init_distributed, shutdown

    if "RANK" in os.environ:
        init_distributed()
    if "RANK" in os.environ:   # and the torch.compile door's own cost per step (a world of one has none)
        from .backend.door import profile_with_door

        cluster = profile_with_door(out=args.out, progress=True, repeats=args.repeats)
    else:
        cluster = Cluster.profile(out=args.out, progress=True, repeats=args.repeats)
    shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        print(cluster.summary())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train MODEL under torchrun with the galvatron backend (or eagerly with --single-device); a
    transformers config with ``--data FILE`` trains on that text (:mod:`galvatron_fx.text_train`)."""
    from .train import print_log, train

    if args.json:
        raise ConfigError(f"train --json {args.json}: the training log is --log-json {args.json} (JSON lines: one "
                          "record per step, then the run's summary)")
    _check_output(args.log_json, "--log-json")
    if args.data is not None or config_path(args.model):
        return _train_text(args)
    if args.plan and not os.path.isfile(args.plan):
        raise ConfigError(f"--plan {args.plan!r}: no such file")
    log = train(args.model, steps=args.steps, plan=args.plan, memory_budget=args.memory_budget,
                global_batch_size=args.global_batch_size, cluster=args.cluster, reserve=args.reserve,
                single_device=args.single_device, lr=args.lr, seed=args.seed,
                overrides=parse_overrides(args.set), progress=progress, precision=args.precision,
                measure=0 if args.plan else args.measure, constraints=_pipeline_constraints(args) or None)
    return _report(log, args, print_log)


def _report(log: dict, args: argparse.Namespace, show) -> int:
    """Rank 0 shows a training log and ends ``--log-json`` with the run's record (after the step
    records: the text trainer wrote its own as it ran); every rank leaves the process group."""
    from .distributed import shutdown
    from .train import write_log

    if log["rank"] == 0:
        show(log)
        if args.log_json:
            write_log(args.log_json, log)
            progress(f"wrote {args.log_json}")
        # NOTE: the summary has this run's measured selection only: a loaded plan's fit was applied by its run
        _calibrate(args, log["summary"].get("measure"))
    shutdown()
    return 0


def _calibrate(args: argparse.Namespace, measure: dict | None) -> None:
    """Rank 0, after a measured search: write its fit (the time scales, galvatron_fx/selection.py)
    into the ``--cluster`` JSON file, so that the next search on it starts closer; not for a preset,
    a profile of the live world or ``--no-calibrate``."""
    from .cluster import Cluster

    fit = (measure or {}).get("fit")
    if not fit or args.no_calibrate or not args.cluster or not os.path.isfile(args.cluster):
        return
    Cluster.load(args.cluster).calibrated(fit).save(args.cluster)
    progress(f"calibrated {args.cluster} to the {measure.get('fitted_candidates')} measured candidates near the "
             f"fastest: stage time x {fit['time_scale']:.3g}, "
             f"pipelined x {fit['pipeline_time_scale']:.3g} on top (their median estimate error "
             f"{100 * measure['error_before']:.0f} % -> {100 * measure['error_after']:.0f} %; --no-calibrate: keep it)")


def _train_text(args: argparse.Namespace) -> int:
    from .text_train import print_summary, train_text

    if args.data is None:
        raise ConfigError(f"{args.model} is a transformers config: give --data FILE (a text file to train on)")
    if not config_path(args.model):
        raise ConfigError(f"--data trains a transformers config.json (or a directory holding one), not {args.model!r}")
    if args.single_device:
        raise ConfigError("--single-device is for zoo / factory models; --data runs under torchrun")
    if args.plan and not os.path.isfile(args.plan):
        raise ConfigError(f"--plan {args.plan!r}: no such file")
    overrides = parse_overrides(args.set)
    log = train_text(args.model, args.data, seq_len=args.seq_len or 128, global_batch_size=args.global_batch_size or 8,
                     steps=args.steps, lr=args.lr if args.lr_given else 3e-4, weight_decay=args.weight_decay,
                     warmup=args.warmup, clip=args.clip, plan=args.plan, cluster=args.cluster,
                     memory_budget=args.memory_budget, precision=args.precision, init=args.init,
                     measure=0 if args.plan else args.measure,
                     save_every=args.save_every, ckpt_dir=args.ckpt_dir, resume=args.resume,
                     log_json=args.log_json, seed=args.seed, overrides=overrides, progress=progress)
    return _report(log, args, print_summary)


def cmd_consolidate(args: argparse.Namespace) -> int:
    """Write checkpoint CKPT's model weights as safetensors (+ config.json) into --out, one process."""
    from .checkpoint import consolidate

    out = consolidate(args.checkpoint, args.out)
    progress(f"wrote {os.path.join(out, 'model.safetensors')}"
             + (" and config.json" if os.path.isfile(os.path.join(out, "config.json")) else ""))
    return 0


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    progress(f"wrote {path}")


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


def _join_negative_values(argv: list[str]) -> list[str]:
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
    p.set_defaults(func=cmd_layers)

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
    p.add_argument("--baselines", action="store_true",
                   help="also estimate DP, ZeRO-3, TP, PP, 3D, DP+TP, DP+PP and Megatron-style (megatron)")
    p.add_argument("--measure", type=_count, default=0, metavar="K",
                   help="under torchrun: time the K best plans and the baselines on the live ranks (the model's "
                        "parts randomly initialised) and keep the fastest (default 0: the estimate's best)")
    _add_calibrate_arg(p)
    p.add_argument("--json", metavar="PATH", help="write the plan JSON (with baselines) to PATH")
    p.add_argument("--plot", metavar="PATH", help="draw the plan (PNG/SVG/PDF; needs matplotlib)")
    _add_pipeline_args(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("show", help="print a saved plan", description="Print PLAN.json as a table.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--plot", metavar="PATH", help="also draw the plan (PNG/SVG/PDF; needs matplotlib)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("profile", help="measure the local cluster (run under torchrun for several ranks)",
                       description="Measure collective bandwidth/latency, overlap slowdown and compute "
                                   "throughput of the torch.distributed world (or this process).")
    p.add_argument("--out", metavar="PATH", help="write the cluster JSON to PATH")
    p.add_argument("--repeats", type=_positive_int, default=7, metavar="N",
                   help="timed runs per figure and round (median; default 7): fewer is faster and noisier")
    p.set_defaults(func=cmd_profile)

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
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir (--data)")
    p.add_argument("--log-json", metavar="PATH", help="the training log, JSON lines (rank 0): one record per step "
                   "(loss, grad_norm, lr, throughput; mfu with --data), then one {\"run\": ...} record with the "
                   "summary, per-device memory and the plan; galvatron_fx.train.read_log reads it back")
    p.add_argument("--plan", metavar="PATH", help="plan JSON to run (default: search one at the first step)")
    p.add_argument("--measure", type=_count, default=4, metavar="K",
                   help="without --plan: time the K best plans by estimate and the baselines on the live world "
                        "for a few steps each and train the fastest (default 4; 0: the estimate's best)")
    _add_calibrate_arg(p)
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
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("consolidate", help="export a checkpoint as safetensors (one process)",
                       description="Read checkpoint CKPT (gfx.checkpoint.save, any plan) in this one process "
                                   "and write the original model's state dict as DIR/model.safetensors, tensor "
                                   "by tensor (memory: about the largest tensor), plus DIR/config.json when the "
                                   "save recorded a transformers config (then from_pretrained(DIR) loads it).")
    p.add_argument("checkpoint", metavar="CKPT", help="a complete checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    p.set_defaults(func=cmd_consolidate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    if args.command == "train":
        args.lr_given = args.lr is not None
        args.lr = args.lr if args.lr is not None else 1e-3
    try:
        return args.func(args)
    except GalvatronError as exc:
        if os.environ.get("GALVATRON_DEBUG"):
            raise
        print(f"galvatron-fx {args.command}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        for line in str(exc).splitlines()[1:]:
            print(f"  {line.strip()}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
