"""The ``galvatron-fx`` command line.

Subcommands are small functions registered in :data:`COMMANDS`; each gets the parsed arguments and
returns an exit status. Errors on bad input are one line on stderr and a non-zero exit, never a
traceback (set ``GALVATRON_DEBUG=1`` to see it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import models
from .cli_args import (
    build_parser,
    check_degrees,
    check_output,
    join_negative_values,
    memory_budget_arg,
    pipeline_constraints,
)
from .dims.offload import check_host
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
    if getattr(args, "float8", False):
        from .models.float8 import convert_to_float8, float8_count

        convert_to_float8(model)   # NOTE: an export capture refuses it, saying why (Float8Linear.forward)
        args.float8_note = f"{float8_count(model)} Float8 linears"
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
    budget = memory_budget_arg(args.memory_budget, cluster) if args.memory_budget else cluster.device_memory
    check_output(args.json, "--json")
    check_output(getattr(args, "plot", None), "--plot")
    check_degrees(args, cluster.world_size, cluster.name)
    check_host(cluster, pipeline_constraints(args).get("offload"), "--offload")
    keep: list = []
    gm = _capture_for_planning(args, keep)
    _check_applies(args, gm)
    cost = {"precision": resolve_precision(cluster, args.precision, args.dtype,
                                           True if args.mixed_precision else None)}
    if args.reserve is not None:
        cost["reserve_bytes"] = args.reserve
    cost.update({k: True for k in ("fused_pointwise", "async_tp") if getattr(args, k, False)})
    rank = 0
    if args.measure:   # under torchrun: every rank times the candidates (galvatron_fx/selection.py)
        from .distributed import init_distributed, shutdown

        rank, world = init_distributed()
        cost.update(measure=args.measure, world_size=world)
    t0 = time.perf_counter()
    plan = search(gm, cluster, budget, args.global_batch_size, progress=progress,
                  constraints=pipeline_constraints(args) or None, **cost)
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
               f"memory budget {args.memory_budget or 'the device memory'}", getattr(args, "defaults_note", None),
               getattr(args, "float8_note", None)]
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
                          "record per step, the last with the run's summary)")
    check_output(args.log_json, "--log-json")
    if args.data is not None or config_path(args.model):
        return _train_text(args)
    if args.plan and not os.path.isfile(args.plan):
        raise ConfigError(f"--plan {args.plan!r}: no such file")
    log = train(args.model, steps=args.steps, plan=args.plan, memory_budget=args.memory_budget,
                global_batch_size=args.global_batch_size, cluster=args.cluster, reserve=args.reserve,
                single_device=args.single_device, lr=args.lr, seed=args.seed,
                overrides=parse_overrides(args.set), progress=progress, precision=args.precision,
                measure=0 if args.plan else args.measure, constraints=pipeline_constraints(args) or None)
    return _report(log, args, print_log)


def _report(log: dict, args: argparse.Namespace, show) -> int:
    """Rank 0 shows a training log and writes ``--log-json`` (the step records, the last with the
    run's summary: the text trainer wrote its steps as it ran); every rank leaves the process group."""
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
                     log_json=args.log_json, seed=args.seed, overrides=overrides, timeout=args.timeout,
                     tensorboard=args.tensorboard, progress=progress)
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


COMMANDS = {"layers": cmd_layers, "plan": cmd_plan, "show": cmd_show, "profile": cmd_profile, "train": cmd_train,
            "consolidate": cmd_consolidate}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    if args.command == "train":
        args.lr_given = args.lr is not None
        args.lr = args.lr if args.lr is not None else 1e-3
    try:
        return COMMANDS[args.command](args)
    except GalvatronError as exc:
        if os.environ.get("GALVATRON_DEBUG"):
            raise
        if getattr(exc, "every_rank", False) and os.environ.get("RANK", "0") != "0":
            return 2   # the same line as rank 0's
        print(f"galvatron-fx {args.command}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        for line in str(exc).splitlines()[1:]:
            print(f"  {line.strip()}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
