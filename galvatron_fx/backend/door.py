"""What the torch.compile door costs per training step, measured (``galvatron-fx profile``).

A user step through ``torch.compile(model, backend="galvatron")`` is ``opt.zero_grad()``, the
compiled call (dynamo's frame, :class:`~.binding._Runtime`, the program's ``train_step`` run inside
the compiled call) and ``loss.backward()`` (:class:`~.binding._RouteGrads` handing every parameter
its gradient). :func:`measure_door` times that step against the same runtime's ``train_step``
called directly, paired run by run, on two small zoo models (1 and 4 gpt-tiny blocks, pure data
parallel over the world), and fits ``seconds = door_call_s + tensors * door_param_s`` over their
trainable parameter tensors. Every rank of the world calls it; every rank returns the same figures
(the slowest rank's).

Traced on gpt-tiny (4 layers, 69 tensors, pp2 m2, 2 gloo ranks, 2026-12-03): the door's step 1.6 ms
over ``train_step``: dynamo's frame 0.3 ms, the backend's call 0.15 ms, the program inside the
compiled call ~0.6 ms slower than called directly, the gradient routing 0.35 ms, ``zero_grad`` 0.13 ms.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DOOR_PROBE = {"layers": (1, 4), "hidden": 32, "seq_len": 16, "batch": 4, "repeats": 15}
"""The probe models (gpt-tiny blocks), their shapes, and the paired runs timed per model."""


def _door_seconds(layers: int, cluster, repeats: int) -> tuple[float, int]:
    """``(seconds per step beyond train_step, trainable tensors)`` of the door on a gpt-tiny of
    ``layers`` blocks: the median over ``repeats`` paired runs of their difference, each run the
    slowest rank's (:meth:`~galvatron_fx.cluster_profile.Timer.excess`)."""
    from .. import models
    from ..cluster_profile import Timer
    from ..distributed import pick_device
    from .binding import distributed_model

    device = pick_device()
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

    def direct():
        dm.train_step(*args)

    excess = Timer(device, dist.group.WORLD, repeats, 2).excess(direct, {"door": door})["door"]
    torch._dynamo.reset()
    return max(excess, 0.0), len(params)


def measure_door(cluster, repeats: int = DOOR_PROBE["repeats"]) -> dict[str, float]:
    """``{"door_call_s", "door_param_s"}`` of this world (module docstring); every rank calls it.
    ``cluster``: the profiled cluster the probe models' (pure DP) plans are searched on. A world of
    one has no door (the backend runs the captured graph as it is): zeros."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {"door_call_s": 0.0, "door_param_s": 0.0}
    small, large = (_door_seconds(n, cluster, repeats) for n in DOOR_PROBE["layers"])
    per_tensor = max(large[0] - small[0], 0.0) / max(large[1] - small[1], 1)
    return {"door_call_s": max(small[0] - small[1] * per_tensor, 0.0), "door_param_s": per_tensor}
