"""The ``galvatron-fx`` command line.

Subcommands are small functions registered in :data:`COMMANDS`; each gets the parsed arguments and
returns an exit status. Errors on bad input are one line on stderr and a non-zero exit, never a
traceback (set ``GALVATRON_DEBUG=1`` to see it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from .errors import ConfigError, GalvatronError


def progress(msg: str) -> None:
    """Progress output: stderr, so that stdout stays parseable."""
    print(f"[galvatron-fx] {msg}", file=sys.stderr, flush=True)


def parse_overrides(items: list[str] | None) -> dict:
    """``["layers=2", "hidden=64", "depths=[2,2]"]`` -> ``{"layers": 2, "hidden": 64, "depths": [2, 2]}``."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. --set layers=2)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def load_model(spec: str, device: str = "meta", overrides: dict | None = None):
    """``MODEL`` argument -> ``(model, example_args)``: a zoo name or ``package.module:factory``."""
    from . import models

    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot load model factory {spec!r}: {exc}") from None
        result = factory(**(overrides or {}))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ConfigError(f"model factory {spec!r} must return (model, example_inputs)")
        return result
    return models.build(spec, device=device, **(overrides or {}))


def cmd_layers(args: argparse.Namespace) -> int:
    """Capture MODEL and print its layer list."""
    from . import capture, layers

    t0 = time.perf_counter()
    model, example_args = load_model(args.model, device=args.device, overrides=parse_overrides(args.set))
    progress(f"capturing {args.model} with method={args.method} on {args.device}")
    gm = capture(model, example_args, method=args.method)
    records = layers(gm)
    info = gm.meta["galvatron"]
    if args.json:
        rows = [{"index": r.index, "name": r.name, "kind": r.kind, "signature": r.signature,
                 "params": len(r.params), "nodes": len(r.nodes), "consumes_from": r.consumes_from}
                for r in records]
        _write_json(args.json, {"model": args.model, "method": args.method, "grouping": info.grouping,
                                "fingerprint": info.fingerprint, "layers": rows})
    sigs: dict[str, str] = {}
    print(f"{args.model}: {len(records)} layers ({info.grouping}), captured by {args.method} "
          f"in {time.perf_counter() - t0:.1f}s, fingerprint {info.fingerprint[:12]}")
    print(f"{'#':>4}  {'name':<28} {'kind':<6} {'sig':<4} {'params':>12} {'nodes':>6}  reads from")
    params = {n.meta["galvatron"].param.fqn: n.meta["galvatron"].param
              for n in gm.graph.nodes if n.op == "get_attr" and n.meta["galvatron"].param}
    for r in records:
        sig = sigs.setdefault(r.signature, chr(ord("A") + len(sigs)) if len(sigs) < 26 else "?")
        numel = sum(params[p].numel for p in r.params)
        print(f"{r.index:>4}  {r.name:<28} {r.kind:<6} {sig:<4} {numel:>12,} {len(r.nodes):>6}  "
              f"{','.join(map(str, r.consumes_from)) or '-'}")
    return 0


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    progress(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="galvatron-fx",
        description="Automatic hybrid parallelism (DP, ZeRO, TP, PP, checkpointing) for PyTorch models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("layers", help="capture a model and print its layers",
                       description="Capture MODEL (a zoo name or package.module:factory) and print its layers.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--method", default="dynamo", choices=["dynamo", "export", "fx"], help="capture front end")
    p.add_argument("--device", default="meta", choices=["meta", "cpu"],
                   help="build zoo models on meta (no weight memory; default) or cpu")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="model override, e.g. --set layers=4 --set hidden=256 (repeatable)")
    p.add_argument("--json", metavar="PATH", help="also write the layer list as JSON")
    p.set_defaults(func=cmd_layers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
