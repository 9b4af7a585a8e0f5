"""What the torch.compile door costs per training step, measured (``galvatron-fx profile``).

A user step through ``torch.compile(model, backend="galvatron")`` is ``opt.zero_grad()``, the
compiled call (dynamo's frame, :class:`~.binding._Runtime`, the program's ``train_step`` run inside
the compiled call) and ``loss.backward()`` (:class:`~.binding._RouteGrads` handing every parameter
its gradient). :func:`measure_door` times that step against the same runtime's ``train_step``
called directly on two small zoo models (1 and 8 gpt-tiny blocks, pure data parallel over the
world), all four in turn run by run, and fits ``seconds = door_call_s + tensors * door_param_s``
over their trainable parameter tensors: the slope is the median over runs of the two models'
excess difference within a run, so a slow spell of the host cancels in the slope too; each
figure is the median of three such rounds (measured: docs/measurements.md, "Figures behind the design"). Every rank of the world calls it; every rank returns the same figures (the
slowest rank's).

What the door costs is dynamo's frame, the backend's call, the program run inside the compiled
call, the gradient routing and ``zero_grad`` (a trace's split: docs/measurements.md, "Figures
behind the design").
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

DOOR_PROBE = {"layers": (1, 8), "hidden": 32, "seq_len": 16, "batch": 4, "repeats": 15, "rounds": 3}
"""The probe models (gpt-tiny blocks), their shapes, the runs timed per round (each runs all four
steps) and the rounds, whose median counts: one round's figure moves between profiles
(measured: docs/measurements.md, "Figures behind the design")."""


def _door_steps(layers: int, cluster, device: torch.device):
    """``(door step, direct step, trainable tensors)`` of a gpt-tiny of ``layers`` blocks compiled
    through the backend: ``zero_grad`` + compiled call + ``backward()``, and the same runtime's
    ``train_step`` called directly."""
    from .. import models
    from .binding import distributed_model

    torch.manual_seed(0)
    model, args = models.build("gpt-tiny", device="cpu", layers=layers, hidden=DOOR_PROBE["hidden"], heads=2,
                               seq_len=DOOR_PROBE["seq_len"], vocab=64, batch=DOOR_PROBE["batch"])
    model = model.to(device)
    args = tuple(a.to(device) for a in args)
    params = [p for p in model.parameters() if p.requires_grad]
    compiled = torch.compile(model, backend="galvatron", fullgraph=True, dynamic=False,
                             options={"cluster": cluster, "precision": "fp32",
                                      "constraints": {"pp": 1, "micro_batches": 1, "tp": 1, "sdp": ["none"],
                                                      "ckpt": False, "cp": 1}})

    def door():
        for p in params:
            p.grad = None
        compiled(*args).backward()

    door()   # compiles: capture, search, transform
    dm = distributed_model(compiled)
    return door, (lambda: dm.train_step(*args)), len(params)


def profile_with_door(out: str | None = None, progress: bool = True, **kwargs):
    """What ``galvatron-fx profile`` measures, from Python: :meth:`Cluster.profile` of the live world
    (``kwargs``: its options) and, in a world of two or more ranks, the door's figures
    (:func:`measure_door`), which ``Cluster.profile`` alone leaves at 0 (it sits below the backend);
    written to ``out`` by rank 0. Every rank calls it."""
    import dataclasses

    from ..cluster import Cluster

    cluster = Cluster.profile(out=None, progress=progress, **kwargs)
    cluster = dataclasses.replace(cluster, **measure_door(cluster))
    cluster.save_profile(out, kwargs.get("group"), progress)
    return cluster


def measure_door(cluster, repeats: int = DOOR_PROBE["repeats"]) -> dict[str, float]:
    """``{"door_call_s", "door_param_s"}`` of this world (module docstring); every rank calls it.
    ``cluster``: the profiled cluster the probe models' (pure DP) plans are searched on. A world of
    one has no door (the backend runs the captured graph as it is): zeros."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {"door_call_s": 0.0, "door_param_s": 0.0}
    from ..cluster_timing import Timer, stable_figures
    from ..distributed import pick_device

    device = pick_device()
    (door_s, direct_s, n_s), (door_l, direct_l, n_l) = (_door_steps(n, cluster, device) for n in DOOR_PROBE["layers"])
    timer = Timer(device, dist.group.WORLD, repeats, 2)

    def measure_round() -> dict[str, float]:
        runs = timer.interleaved({"door_s": door_s, "direct_s": direct_s, "door_l": door_l, "direct_l": direct_l})
        small = [d - t for d, t in zip(runs["door_s"], runs["direct_s"])]
        large = [d - t for d, t in zip(runs["door_l"], runs["direct_l"])]
        per_tensor = max(statistics.median((b - a) / (n_l - n_s) for a, b in zip(small, large)), 0.0)
        return {"door_call_s": max(statistics.median(small) - n_s * per_tensor, 0.0), "door_param_s": per_tensor}

    best, _spread = stable_figures(measure_round, min_rounds=DOOR_PROBE["rounds"], max_rounds=DOOR_PROBE["rounds"],
                                   pick=statistics.median, noise=("door_call_s", "door_param_s"))
    torch._dynamo.reset()
    return best
