"""Profiled mode: time a layer's real forward and backward on the local device, with a disk cache.

:func:`profile_layer` runs an extracted layer (:mod:`galvatron_fx.cost.extract`) with random
weights in its tensor-parallel shapes (column-parallel weights split on rows, row-parallel on
columns, vocab-parallel embeddings on rows; reshapes after sharded ops get their head counts
divided) at several micro-batch sizes, and fits ``seconds = a * n + c`` for forward and backward.
Each timed run chains :data:`CHAIN` forwards before their backwards, as a step holds its layers'
activations (:func:`time_layer`).
With ``ckpt`` the layer runs under the runtime's own
:func:`~galvatron_fx.runtime.checkpointing.checkpoint_layer`, so backward includes the recomputation. When the sharded layer cannot run (an op with a baked full-width size the
reshape rule does not cover) the unsharded times are scaled by the share of sharded FLOPs and the
record says ``"method": "scaled"``. A layer whose graph bakes in the capture batch size runs at that
size only, and its times are taken proportional to the samples. Device constants baked into the
graph are retargeted to the profiling device (:meth:`LayerGraph.on_device`), so layers of a model
captured on the meta device are profiled too.

Results are cached as one JSON file per key under :func:`cache_dir` (``$GALVATRON_CACHE``, else
``~/.cache/galvatron_fx``), keyed by layer signature, ``(tp, sp, ckpt)``, device name, dtype and the
sizes, so a second annotation re-profiles nothing. ``PROFILE_CALLS`` counts real profiling runs.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..ir import short_hash
from ..runtime.checkpointing import checkpoint_layer
from .extract import LayerGraph
from .measure import Affine, make_inputs

CACHE_ENV = "GALVATRON_CACHE"
PROFILE_SIZES = (1, 2, 4)
PROFILE_CALLS = {"count": 0}
"""Number of layer profiling runs in this process (tests check that the cache prevents them)."""


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The profile cache folder: ``path``, else ``$GALVATRON_CACHE``, else ``~/.cache/galvatron_fx``."""
    if path is None:
        path = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "galvatron_fx"
    return Path(path)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{platform.processor() or 'unknown'}:{torch.get_num_threads()}t"


def _reshape_sizes(node: torch.fx.Node, args: tuple, x: torch.Tensor) -> tuple:
    """``args`` of a view/reshape/unflatten with the head (or hidden) count divided to fit ``x``."""
    full = node.args[0].meta["val"]
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    dim = args[1] if name == "unflatten" else -1
    ratio = int(full.shape[dim]) // max(int(x.shape[dim]), 1)
    if ratio <= 1:
        return args
    if name == "unflatten":
        dim, sizes = args[1], list(args[2])
        sizes[0] //= ratio
        return (args[0], dim, tuple(sizes)) + tuple(args[3:])
    sizes = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
    last = int(full.shape[-1])
    for i in range(len(sizes)):
        if math.prod(s for s in sizes[i:]) == last and sizes[i] % ratio == 0:
            sizes[i] //= ratio
            return (args[0], tuple(sizes))
    raise RuntimeError(f"cannot shard the sizes of {node.format_node()}")


class _ShardedRunner(torch.fx.Interpreter):
    """Runs a layer with TP-sharded weights, fixing reshapes of sharded tensors; records the fixed
    sizes (``fixed``: node name -> args) so that :func:`_sharded_module` can bake them in."""

    RESHAPES = ("view", "reshape", "unflatten")

    def __init__(self, gm):
        super().__init__(gm)
        self.fixed: dict[str, tuple] = {}

    def run_node(self, n):
        self._node = n
        return super().run_node(n)

    def _call(self, kind, target, args, kwargs):
        node = self._node
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if name in self.RESHAPES and isinstance(args[0], torch.Tensor) and isinstance(node.args[0], torch.fx.Node):
            args = _reshape_sizes(node, args, args[0])
            self.fixed[node.name] = args[1:]
        return getattr(super(), kind)(target, args, kwargs)

    def call_function(self, target, args, kwargs):
        return self._call("call_function", target, args, kwargs)

    def call_method(self, target, args, kwargs):
        return self._call("call_method", target, args, kwargs)


def _sharded_module(gm: torch.fx.GraphModule, args: list) -> torch.fx.GraphModule:
    """A copy of ``gm`` that runs on ``args`` (TP-sharded weights) at generated-code speed: one
    :class:`_ShardedRunner` pass finds the reshape sizes, which the copy then takes as constants.

    NOTE: timing the fx Interpreter itself would add its per-node Python cost (tens of us) to every
    op, which the runtime's generated code does not pay; sizes are baked for this input shape only."""
    runner = _ShardedRunner(gm)
    with torch.no_grad():
        runner.run(*args)
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.name in runner.fixed:
            node.args = (node.args[0], *runner.fixed[node.name])
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(gm, graph)


def _shards(layer: LayerGraph, tp: int) -> dict[str, tuple[int, int]]:
    """Parameters to shrink to their TP shard for a timed run. Vocabulary-parallel tables keep their
    rows: the runtime masks indices outside a rank's rows, which a plain lookup cannot."""
    vocab = {a.name for n in layer.gm.graph.nodes if layer.roles.get(n.name) == "vocab"
             for a in n.all_input_nodes}
    return {name: (dim, tp) for name, dim in layer.param_shard_dim.items()
            if dim is not None and tp > 1 and name not in vocab}


CHAIN = 3
"""Forwards :func:`time_layer` runs back to back, holding their activations, before their backwards
in reverse, as a step runs its layers. A layer timed alone in a loop reuses the memory its previous
iteration freed, warm in cache, and reads under the chained figure and the same layer inside a
training step (measured: docs/measurements.md, "Figures behind the design")."""


def time_layer(layer: LayerGraph, n: int, *, tp: int = 1, ckpt: bool = False, dtype=None, device=None,
               repeats: int = 5, warmup: int = 2, chain: int = CHAIN) -> tuple[float, float]:
    """Median seconds of one forward and one backward of the layer with ``n`` samples: per run,
    ``chain`` forwards on their own inputs, then their backwards in reverse, each pass's time
    divided by ``chain`` (:data:`CHAIN`)."""
    from ..distributed import pick_device, synchronize

    device = device or pick_device()
    inputs = [make_inputs(layer, n, device=device, dtype=dtype, real=True, shard=_shards(layer, tp))
              for _ in range(max(1, chain))]
    gm = layer.on_device(device)
    runner = _sharded_module(gm, inputs[0]) if tp > 1 else gm

    def forward(args) -> list[torch.Tensor]:
        # NOTE: checkpointed as the runtime checkpoints, priced alike
        outs = checkpoint_layer(runner, *args) if ckpt else runner(*args)
        return [o for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor) and o.requires_grad]

    fwd, bwd = [], []
    for i in range(warmup + repeats):
        synchronize(device)
        t0 = time.perf_counter()
        held = [forward(args) for args in inputs]
        synchronize(device)
        t1 = time.perf_counter()
        for outs in reversed(held):
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        synchronize(device)
        t2 = time.perf_counter()
        del held
        for args in inputs:
            for a in args:
                a.grad = None
        if i >= warmup:
            fwd.append((t1 - t0) / len(inputs))
            bwd.append((t2 - t1) / len(inputs))
    return statistics.median(fwd), statistics.median(bwd)


def _time_sizes(layer: LayerGraph, sizes: tuple[int, ...], **kw) -> tuple[tuple[int, ...], list]:
    """``(sizes, times)`` of :func:`time_layer` over ``sizes``, or at the capture batch alone (times
    then taken proportional to the samples) when the graph bakes that batch size in."""
    try:
        return tuple(sizes), [time_layer(layer, n, **kw) for n in sizes]
    except RuntimeError:
        if tuple(sizes) == (layer.batch,):
            raise
        return (layer.batch,), [time_layer(layer, layer.batch, **kw)]


def _fit(ns, ys) -> Affine:
    """Least-squares ``a * n + c`` with ``a, c >= 0`` (a time never falls with more samples, nor
    goes below zero): a negative intercept (noise) refits through the origin, a negative slope
    takes the mean as a constant."""
    k = len(ns)
    mx, my = sum(ns) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in ns)
    a = sum((x - mx) * (y - my) for x, y in zip(ns, ys)) / sxx if sxx else my / mx
    c = my - a * mx
    if a < 0:
        return Affine(0.0, my)
    if c < 0:
        return Affine(sum(x * y for x, y in zip(ns, ys)) / sum(x * x for x in ns), 0.0)
    return Affine(a, c)


def profile_layer(layer: LayerGraph, *, tp: int = 1, sp: bool = False, ckpt: bool = False, dtype=None,
                  sharded_fraction: float = 1.0, sizes: tuple[int, ...] = PROFILE_SIZES,
                  cache: str | os.PathLike | None = None, device=None, repeats: int = 5) -> dict:
    """``{"fwd": Affine, "bwd": Affine, "method": ...}`` seconds per sample count, cached on disk."""
    from ..distributed import pick_device

    device = device or pick_device()
    dtype_name = str(dtype or "native").replace("torch.", "")
    key = dict(version=4, chain=CHAIN, signature=layer.signature, tp=tp, sp=sp, ckpt=ckpt, device=device_name(device),
               dtype=dtype_name, sizes=list(sizes))
    path = cache_dir(cache) / "layers" / f"{short_hash(sorted(key.items()), n=24)}.json"
    if path.exists():
        try:
            rec = json.loads(path.read_text())
            return {"fwd": Affine(*rec["fwd"]), "bwd": Affine(*rec["bwd"]), "method": rec["method"]}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable entry: profile again and overwrite it
    PROFILE_CALLS["count"] += 1
    method = "sharded" if tp > 1 else "direct"
    kw = dict(ckpt=ckpt, dtype=dtype, device=device, repeats=repeats)
    try:
        ns, times = _time_sizes(layer, sizes, tp=tp, **kw)
    except RuntimeError:
        method = "scaled"
        share = sharded_fraction / tp + (1.0 - sharded_fraction)
        ns, times = _time_sizes(layer, sizes, **kw)
        times = [tuple(t * share for t in ts) for ts in times]
    fwd, bwd = _fit(ns, [t[0] for t in times]), _fit(ns, [t[1] for t in times])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**key, "fwd": [fwd.a, fwd.c], "bwd": [bwd.a, bwd.c], "method": method,
                               "times": times}, indent=1))
    tmp.replace(path)
    return {"fwd": fwd, "bwd": bwd, "method": method}
