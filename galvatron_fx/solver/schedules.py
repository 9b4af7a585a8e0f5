"""Pipeline schedules: names, which rank runs which chunk, what a plan may combine, the bubble and
the micro-batches each chunk holds at its peak (pure, no torch).

A plan with ``pp = p`` pipeline ranks and ``virtual_stages = v`` cuts its layers into ``p * v``
contiguous chunks (``plan.stages``, in layer order). ``gpipe`` and ``1f1b`` run one chunk per rank
(``v = 1``); ``interleaved-1f1b`` (Megatron-LM, Narayanan et al., SC'21) runs ``v`` chunks per rank,
chunk ``c`` on pipeline rank ``c % p``, which cuts the bubble from ``(p - 1)`` to ``(p - 1) / v``
micro-batch times at the price of ``v`` times the stage-to-stage sends.
``interleaved-zb``, ``zbv`` and ``dualpipev`` (zero-bubble, Qi et al., ICLR'24; DeepSeek) are plan
names the runtime does not run yet (:data:`RUNNABLE`).

The rank orders are those of ``torch.distributed.pipelining`` (``Schedule1F1B``,
``ScheduleInterleaved1F1B``: warm-up forwards, then one forward and one backward, then the
remaining backwards), which the runtime runs; :func:`rank_order` rebuilds them so that the memory
model counts what the runtime holds.
"""

from __future__ import annotations

import functools

from ..errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
"""Every schedule a plan may name (the plan JSON's ``schedule``)."""
RUNNABLE = ("gpipe", "1f1b", "interleaved-1f1b")
"""The schedules the runtime and the search implement."""
V_SHAPED = ("zbv", "dualpipev")
"""Schedules placing two chunks per rank in a V (rank ``r`` runs chunks ``r`` and ``2p - 1 - r``)."""


def default_virtual_stages(schedule: str) -> int:
    """``v`` a schedule implies when the plan does not say: 2 for the V shapes, else 1."""
    return 2 if schedule in V_SHAPED else 1


def check_schedule(schedule: str, pp: int, virtual_stages: int, micro_batches: int, *, runnable: bool = False) -> None:
    """Raise :class:`ConfigError` naming the problem and the fix when a plan cannot combine these
    (``runnable``: also when the runtime does not run ``schedule`` yet)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"plan schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"plan virtual_stages must be an integer >= 1, got {v!r}")
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ConfigError(f"schedule {schedule!r} runs one chunk per pipeline rank, but virtual_stages={v}; "
                          "use virtual_stages=1, or schedule='interleaved-1f1b' for several chunks per rank")
    if schedule in V_SHAPED and v != 2:
        raise ConfigError(f"schedule {schedule!r} places two chunks per rank in a V; set virtual_stages=2 (got {v})")
    if v > 1 and pp < 2:
        raise ConfigError(f"virtual_stages={v} needs a pipeline (pp >= 2); with pp=1 use virtual_stages=1")
    if schedule.startswith("interleaved") and pp > 1:
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            ok = [k for k in range(pp, 4 * pp + 1) if k % max(1, k // pp) == 0]
            raise ConfigError(f"schedule {schedule!r} with pp={pp} runs micro-batches in rounds of "
                              f"{micro_batches // rounds}: micro_batches={micro_batches} must be a multiple of "
                              f"{rounds} rounds; use one of {ok[:8]}")
    if schedule == "dualpipev" and micro_batches < 2 * pp:
        raise ConfigError(f"schedule 'dualpipev' needs micro_batches >= 2 * pp = {2 * pp}, got {micro_batches}")
    if runnable and schedule not in RUNNABLE:
        raise ConfigError(f"schedule {schedule!r} is a valid plan but the runtime does not run it yet; "
                          f"use one of {list(RUNNABLE)}")


def chunk_rank(schedule: str, chunk: int, pp: int) -> int:
    """The pipeline rank (position in the pipe, 0..p-1) running chunk ``chunk``."""
    if schedule in V_SHAPED:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def rank_chunks(schedule: str, rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The chunks pipeline rank ``rank`` runs, in chunk order."""
    return [c for c in range(pp * virtual_stages) if chunk_rank(schedule, c, pp) == rank]


def rank_order(schedule: str, rank: int, pp: int, virtual_stages: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """Pipeline rank ``rank``'s compute order: ``(kind, local chunk, micro-batch)``, kind ``"F"`` or
    ``"B"``, as ``torch.distributed.pipelining`` runs it (module docstring)."""
    p, v, m = pp, virtual_stages, micro_batches
    if schedule == "gpipe":
        return [("F", 0, k) for k in range(m)] + [("B", 0, k) for k in range(m)]
    if schedule not in ("1f1b", "interleaved-1f1b"):
        raise ConfigError(f"no rank order for schedule {schedule!r}; use one of {list(RUNNABLE)}")
    if schedule == "1f1b":
        warmup = min(m, p - 1 - rank)
        per_round, v = m, 1
    else:
        per_round = m // max(1, m // p)
        warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    total = m * v
    fwd_done = [0] * v
    bwd_done = [0] * v
    order: list[tuple[str, int, int]] = []

    def forward(step: int) -> None:
        c = (step // per_round) % v
        order.append(("F", c, fwd_done[c]))
        fwd_done[c] += 1

    def backward(step: int) -> None:
        c = v - 1 - ((step - warmup) // per_round) % v
        order.append(("B", c, bwd_done[c]))
        bwd_done[c] += 1

    for step in range(total):
        forward(step)
        if step >= warmup:
            backward(step)
    for step in range(total, total + warmup):
        backward(step)
    return order


@functools.lru_cache(maxsize=4096)
def _chunk_in_flight(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> tuple[int, ...]:
    """:func:`chunk_in_flight`, vectorised: the running count of each chunk over :func:`rank_order`'s
    events (chunks as it numbers them: ``(step // per_round) % v`` forward, mirrored backward)."""
    import numpy as np

    if schedule != "interleaved-1f1b":
        order = rank_order(schedule, rank, pp, virtual_stages, micro_batches)
        chunk = np.array([c for _, c, _ in order])
        delta = np.array([1 if k == "F" else -1 for k, _, _ in order])
    else:
        p, v, m = pp, virtual_stages, micro_batches
        per_round = m // max(1, m // p)
        total = m * v
        warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
        steps = np.arange(total)
        fwd = (steps // per_round) % v
        bwd = v - 1 - (steps // per_round) % v          # backward j runs at step warmup + j
        steady = total - warmup
        chunk = np.concatenate([fwd[:warmup], np.stack([fwd[warmup:], bwd[:steady]], axis=1).ravel(), bwd[steady:]])
        delta = np.concatenate([np.ones(warmup, int), np.tile([1, -1], steady), -np.ones(total - steady, int)])
    held = np.zeros((len(chunk), virtual_stages), dtype=np.int64)
    held[np.arange(len(chunk)), chunk] = delta
    return tuple(int(x) for x in np.maximum(held.cumsum(axis=0).max(axis=0), 0))


def chunk_in_flight(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> list[int]:
    """For each local chunk of pipeline rank ``rank``, the most micro-batches it holds at once
    (forwarded, not yet backwarded) in :func:`rank_order`. The memory model charges every chunk its
    own peak, an upper bound of the rank's peak (equal for one chunk per rank; for interleaved 1F1B
    the chunks peak one micro-batch apart, so the bound is at most ``v - 1`` micro-batches over)."""
    return list(_chunk_in_flight(schedule, pp, virtual_stages, micro_batches, rank))


@functools.lru_cache(maxsize=1024)
def chunk_peaks(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[int, ...]:
    """:func:`chunk_in_flight` of every chunk of the plan's ``stages``, in chunk order."""
    out = [0] * (pp * virtual_stages)
    for k in range(pp):
        for c, q in zip(rank_chunks(schedule, k, pp, virtual_stages),
                        _chunk_in_flight(schedule, pp, virtual_stages, micro_batches, k)):
            out[c] = q
    return tuple(out)


def step_slots(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> float:
    """The step time in units of one micro-batch's forward + backward through all of a rank's
    chunks (the slowest rank's): ``m`` of work plus the bubble, ``p - 1`` (GPipe, 1F1B) or
    ``(p - 1) / v`` (interleaved 1F1B: each warm-up slot is one chunk, ``1 / v`` of the rank's work)."""
    m, p, v = micro_batches, pp, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return m + p - 1
    if schedule == "interleaved-1f1b":
        return m + (p - 1) / v
    raise ConfigError(f"no time model for schedule {schedule!r} yet; use one of {list(RUNNABLE)}")
