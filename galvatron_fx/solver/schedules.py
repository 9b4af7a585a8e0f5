"""Pipeline schedules: names, which rank runs which chunk, what a plan may combine, the bubble and
the micro-batches each chunk holds at its peak (pure, no torch).

A plan with ``pp = p`` pipeline ranks and ``virtual_stages = v`` cuts its layers into ``p * v``
contiguous chunks (``plan.stages``, in layer order). ``gpipe`` and ``1f1b`` run one chunk per rank
(``v = 1``); ``interleaved-1f1b`` (Megatron-LM, Narayanan et al., SC'21) runs ``v`` chunks per rank,
chunk ``c`` on pipeline rank ``c % p``, which cuts the bubble from ``(p - 1)`` to ``(p - 1) / v``
micro-batch times at the price of ``v`` times the stage-to-stage sends.
The zero-bubble schedules (:data:`ZERO_BUBBLE`: ``interleaved-zb``, ZB1P of Qi et al., ICLR'24,
``v`` chunks round-robin as interleaved 1F1B; ``zbv``, their ZB-V, two chunks per rank in a V;
``dualpipev``, DeepSeek's DualPipe cut to a V) split each backward into an input-gradient pass
``I`` (sent on at once) and a weight-gradient pass ``W`` run later to fill the bubble. A
micro-batch's activations stay held from its ``F`` to its ``W`` (torch's split retains the whole
autograd graph until ``W``), and a checkpointed layer recomputes its forward in both passes.

The rank orders are those of ``torch.distributed.pipelining``, which the runtime runs:
:func:`rank_order` rebuilds ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (warm-up forwards,
then one forward and one backward, then the remaining backwards) and takes the zero-bubble
schedules' action lists from torch's own generators, so that the memory model counts what the
runtime holds. :func:`step_slots` prices the zero-bubble bubble by running those lists with equal
``F``, ``I`` and ``W`` times per chunk (:func:`_makespan`: the ZB paper's and torch's assumption,
a backward twice a forward).
"""

from __future__ import annotations

import functools

from ..errors import ConfigError
from ..schedule import SCHEDULE, schedule_record

SCHEDULES = tuple(SCHEDULE)
"""Every schedule a plan may name (the plan JSON's ``schedule``; :data:`galvatron_fx.schedule.SCHEDULE`)."""
ZERO_BUBBLE = tuple(n for n, s in SCHEDULE.items() if s.split_backward)
"""Schedules splitting the backward into input- and weight-gradient passes (module docstring)."""
V_SHAPED = tuple(n for n, s in SCHEDULE.items() if s.v_shape)
"""Schedules placing two chunks per rank in a V (rank ``r`` runs chunks ``r`` and ``2p - 1 - r``)."""


def default_virtual_stages(schedule: str) -> int:
    """``v`` a schedule implies when the plan does not say: 2 for the V shapes, else 1."""
    return schedule_record(schedule).default_chunks_per_rank


def check_schedule(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> None:
    """Raise :class:`ConfigError` naming the problem and the fix when a plan cannot combine these."""
    sch = schedule_record(schedule)
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"plan virtual_stages must be an integer >= 1, got {v!r}")
    if sch.single_chunk and v != 1:
        raise ConfigError(f"schedule {schedule!r} runs one chunk per pipeline rank, but virtual_stages={v}; "
                          "use virtual_stages=1, or schedule='interleaved-1f1b' for several chunks per rank")
    if sch.v_shape and v != sch.chunks_per_rank:
        raise ConfigError(f"schedule {schedule!r} places two chunks per rank in a V; set virtual_stages=2 (got {v})")
    if pp < sch.min_stages:
        raise ConfigError(f"schedule {schedule!r} splits the backward to fill a pipeline's bubble: it needs pp >= "
                          f"{sch.min_stages}; with pp=1 use '1f1b'")
    if v > 1 and pp < 2:
        raise ConfigError(f"virtual_stages={v} needs a pipeline (pp >= 2); with pp=1 use virtual_stages=1")
    if schedule.startswith("interleaved") and pp > 1:
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            ok = [k for k in range(pp, 4 * pp + 1) if k % max(1, k // pp) == 0]
            raise ConfigError(f"schedule {schedule!r} with pp={pp} runs micro-batches in rounds of "
                              f"{micro_batches // rounds}: micro_batches={micro_batches} must be a multiple of "
                              f"{rounds} rounds; use one of {ok[:8]}")
    if sch.microbatches_cover_stages and pp > 1 and micro_batches < pp * v:
        other = " (or schedule='gpipe')" if sch.single_chunk else ""
        raise ConfigError(f"schedule {schedule!r} needs at least as many micro-batches as pipeline stages: "
                          f"micro_batches >= pp * virtual_stages = {pp * v}, got {micro_batches}; raise "
                          f"micro_batches{other}")


def chunk_rank(schedule: str, chunk: int, pp: int) -> int:
    """The pipeline rank (position in the pipe, 0..p-1) running chunk ``chunk``."""
    if schedule_record(schedule).v_shape:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def rank_chunks(schedule: str, rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The chunks pipeline rank ``rank`` runs, in chunk order."""
    return [c for c in range(pp * virtual_stages) if chunk_rank(schedule, c, pp) == rank]


def rank_order(schedule: str, rank: int, pp: int, virtual_stages: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """Pipeline rank ``rank``'s compute order: ``(kind, local chunk, micro-batch)``, kind ``"F"``,
    ``"B"`` (a whole backward) or, under a zero-bubble schedule, ``"I"`` / ``"W"`` (its input- and
    weight-gradient passes), as ``torch.distributed.pipelining`` runs it (module docstring)."""
    p, v, m = pp, virtual_stages, micro_batches
    if schedule == "gpipe":
        return [("F", 0, k) for k in range(m)] + [("B", 0, k) for k in range(m)]
    if schedule in ZERO_BUBBLE:
        mine = rank_chunks(schedule, rank, p, v)
        return [(kind, mine.index(c), k) for kind, c, k in _torch_actions(schedule, p, v, m)[rank]]
    if schedule not in ("1f1b", "interleaved-1f1b"):
        raise ConfigError(f"no rank order for schedule {schedule!r}; use one of {list(SCHEDULES)}")
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


TORCH_SCHEDULES = {n: s.torch_class for n, s in SCHEDULE.items()}
"""Plan schedule -> the ``torch.distributed.pipelining.schedules`` class the runtime runs it with."""


@functools.lru_cache(maxsize=256)
def _torch_actions(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple:
    """Per pipeline rank, ``(kind, chunk, micro-batch)`` in the order torch's zero-bubble schedule
    class runs them (``kind`` ``F`` / ``I`` / ``W`` / ``B``; an overlapped forward-backward pair
    as its two actions, forward first, idle markers dropped).

    NOTE: the lists come from the class's own generator (``_calculate_single_rank_operations``,
    plus ``_add_bubbles_to_actions`` for ``interleaved-zb``, as its ``__init__`` runs them), called
    on the few attributes they read, so no process group or stage is needed; tests/test_schedules.py
    checks them against the order the runtime records."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts

    p, v, m = pp, virtual_stages, micro_batches
    cls = getattr(ts, TORCH_SCHEDULES[schedule])
    rounds = max(1, m // p)
    ns = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m, num_stages=p * v,
                         number_of_rounds=rounds, microbatches_per_round=m // rounds, pipeline_order={})
    for r in range(p):
        ns.pipeline_order[r] = cls._calculate_single_rank_operations(ns, r)
    if schedule == "interleaved-zb":
        ns.pipeline_order = cls._add_bubbles_to_actions(ns, p * v)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    out = []
    for r in range(p):
        seq = []
        for a in ns.pipeline_order[r]:
            for sub in (getattr(a, "sub_actions", None) or [a]) if a is not None else []:
                seq.append((kinds[sub.computation_type.name], sub.stage_index, sub.microbatch_index))
        out.append(tuple(seq))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _makespan(schedule: str, pp: int, virtual_stages: int, micro_batches: int, transfer: float = 0.0) -> float:
    """The step's length, in chunk-pass times, when every rank runs :func:`rank_order` with ``F``,
    ``I`` and ``W`` one time unit per chunk (``B`` two): an action starts when its rank is free and
    its inputs exist (the previous chunk's forward, the next chunk's input gradient, its own
    ``I`` for a ``W``), an input from another rank ``transfer`` units after it was made (0: sends
    take no time, as the model prices them apart). NOTE: torch runs chunk 0's ``I`` as nothing and
    its ``W`` as the whole backward, and so does this."""
    return _simulate(schedule, pp, virtual_stages, micro_batches, transfer)[0]


def _simulate(schedule: str, pp: int, virtual_stages: int, micro_batches: int, transfer: float = 0.0,
              delayed: frozenset = frozenset(), delay: float = 0.0) -> tuple[float, list, list]:
    """:func:`_makespan`'s simulation: ``(makespan, spans, asks)``, ``spans[r]`` rank ``r``'s
    ``(start, end, waited)`` per action in its order (``waited``: the rank idled before it),
    ``asks`` every cross-rank input as ``(receiving action, input, sending rank, index of the
    sending action in its rank's order, made at, asked at)`` (asked: when the receiving rank was
    free to start the action). An input in ``delayed`` (a ``(receiving action, input)`` pair)
    arrives ``delay`` after it is both made and asked for, if later than it would."""
    p, v, m = pp, virtual_stages, micro_batches
    n = p * v
    owner = {c: r for r in range(p) for c in rank_chunks(schedule, r, p, v)}
    orders = [[(kind, rank_chunks(schedule, r, p, v)[c], k) for kind, c, k in rank_order(schedule, r, p, v, m)]
              for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    made_by: dict[tuple[str, int, int], int] = {}   # output -> index of the action making it
    clock, at = [0.0] * p, [0] * p
    spans: list[list[tuple[float, float, bool]]] = [[] for _ in range(p)]
    asks: list[tuple] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while at[r] < len(orders[r]):
                kind, c, k = action = orders[r][at[r]]
                if kind == "F":
                    deps = [("F", c - 1, k)] if c else []
                elif kind in ("I", "B"):
                    deps = [("F", c, k)] + ([("G", c + 1, k)] if c + 1 < n else [])
                else:
                    deps = [("G", c, k)]
                if any(d not in done for d in deps):
                    break
                cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[kind]
                if c == 0 and kind in ("I", "W"):
                    cost = 0.0 if kind == "I" else 2.0
                start = clock[r]
                for d in deps:
                    if owner[d[1]] == r:
                        start = max(start, done[d])
                        continue
                    asks.append((action, d, owner[d[1]], made_by[d], done[d], clock[r]))
                    start = max(start, done[d] + transfer)
                    if (action, d) in delayed:
                        start = max(start, max(done[d], clock[r]) + delay)
                end = start + cost
                spans[r].append((start, end, start > clock[r]))
                clock[r] = done[action] = end
                made_by[action] = at[r]
                if kind in ("I", "B"):
                    done[("G", c, k)] = end   # the input gradient the previous chunk waits for
                    made_by[("G", c, k)] = at[r]
                at[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ConfigError(f"schedule {schedule!r} (pp={p}, v={v}, m={m}) does not progress")
    return max(clock), spans, asks


def send_waited(schedule: str, order: list[tuple[str, int, int]], index: int) -> int:
    """The index in a rank's ``order`` of the action before which the rank waits for the sends of
    action ``index`` (``len(order)``: at the step's end), as ``torch.distributed.pipelining`` runs
    them. ``ScheduleGPipe`` waits for the forward sends after the last forward, the backward sends
    at the end. ``Schedule1F1B`` fires a warm-up forward's send and waits for it after the next
    forward, fuses the last warm-up forward's send and every steady-state send with the next
    receive (waited before the next action), and waits for a cool-down backward's send after the
    next backward. The action-list runtimes (interleaved, zero-bubble) wait for their sends at the
    step's end."""
    n = len(order)
    kind = order[index][0]
    if schedule == "gpipe":
        return next((i for i, a in enumerate(order) if a[0] == "B"), n) if kind == "F" else n
    if schedule != "1f1b":
        return n
    if kind == "F":
        warmup = next((i for i, a in enumerate(order) if a[0] != "F"), n)
        return index + 2 if index < warmup - 1 else index + 1
    return index + 1 if any(a[0] == "F" for a in order[index + 1:]) else min(index + 2, n)


@functools.lru_cache(maxsize=1024)
def late_transfers(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> float:
    """How many cross-rank inputs a step waits an extra wake-up for: the growth of the step
    (:func:`_makespan`, unit chunk passes, sends free) per unit of delay on every input whose
    sender is computing, its send not yet waited for (:func:`send_waited`), when the input is both
    made and asked for. Each such input costs the cluster's ``p2p_wakeup_s`` beyond its transfer:
    a point-to-point send (gloo's, and NCCL's) moves only once its receiver has posted the receive,
    and then needs the sender's communication thread, which waits for a core while the sender
    computes (measured: docs/measurements.md, "Figures behind the design"). A sender computes if it runs an
    action begun before that time, or begun then without having waited. A 1F1B sender that fuses
    its send with the receive it waits on next does not keep the input waiting. An input asked for
    before it is made is written by the sender's own ``isend`` if the sender learnt of the receive
    while waiting, and always under the action-list runtimes, which post their receives ahead
    (``RECV_F`` / ``RECV_B`` actions). pp 2, m 2 / 4 / 8: GPipe 2 / 6 / 14 (each input but the last
    of each pass: the sender is on to its next micro-batch), 1F1B 1 / 1 / 1 (rank 0's first warm-up
    forward), interleaved 1F1B v 2: 3 / 8 / 20 (tests/test_schedules.py)."""
    p, v, m = pp, virtual_stages, micro_batches
    _, spans, asks = _simulate(schedule, p, v, m)
    orders = [rank_order(schedule, r, p, v, m) for r in range(p)]

    def busy(rank: int, t: float, first: int = 0, last: int | None = None) -> bool:
        """Computing at ``t`` (or starting then without having waited) an action in ``[first, last)``."""
        return any(a < t < b or (a == t < b and not waited) for a, b, waited in spans[rank][first:last])

    def idles(rank: int, t0: float, t1: float) -> bool:
        """Waiting at some time in ``[t0, t1]`` (its communication thread then has a core)."""
        return not busy(rank, t0) or any(waited and t0 < a <= t1 for a, _, waited in spans[rank])

    def early_ask_served(sender: int, made_at: float, asked: float) -> bool:
        """An input asked for before it is made that the sender's own ``isend`` writes: the sender
        learnt of the receive while waiting, or (action-list runtimes) the receive was posted ahead."""
        return asked < made_at and (not SCHEDULE[schedule].single_chunk or idles(sender, asked, made_at))

    late = frozenset((action, d) for action, d, sender, made, made_at, asked in asks
                     if busy(sender, max(made_at, asked), made + 1, send_waited(schedule, orders[sender], made))
                     and not early_ask_served(sender, made_at, asked))
    eps = 1e-3
    return (_simulate(schedule, p, v, m, delayed=late, delay=eps)[0] - _makespan(schedule, p, v, m)) / eps


def critical_transfers(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> float:
    """How many cross-rank transfers lie on a step's critical path when they are short against a
    chunk pass: the growth of :func:`_makespan` per unit of ``transfer`` (at pp 2: GPipe 2, 1F1B
    ``m``, interleaved 1F1B v 2: 6, for m = 2, 4, 8). Each such transfer, and the wait for the
    sending rank before it, adds to the step; the others hide behind compute. Not priced yet
    (``benchmarks/pipeline_waits.py`` measures what each costs)."""
    eps = 1e-3
    return (_makespan(schedule, pp, virtual_stages, micro_batches, eps)
            - _makespan(schedule, pp, virtual_stages, micro_batches)) / eps


@functools.lru_cache(maxsize=4096)
def _chunk_in_flight(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> tuple[int, ...]:
    """:func:`chunk_in_flight`, vectorised: the running count of each chunk over :func:`rank_order`'s
    events (chunks as it numbers them: ``(step // per_round) % v`` forward, mirrored backward)."""
    import numpy as np

    if schedule != "interleaved-1f1b":   # held from F to its B (zero-bubble: to its W)
        order = rank_order(schedule, rank, pp, virtual_stages, micro_batches)
        chunk = np.array([c for _, c, _ in order])
        delta = np.array([{"F": 1, "I": 0}.get(k, -1) for k, _, _ in order])
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
    (forwarded, not yet backwarded; zero-bubble: not yet through ``W``) in :func:`rank_order`. The memory model charges every chunk its
    own peak, an upper bound of the rank's peak (equal for one chunk per rank; for interleaved 1F1B
    the chunks peak one micro-batch apart, so the bound is at most ``v - 1`` micro-batches over)."""
    return list(_chunk_in_flight(schedule, pp, virtual_stages, micro_batches, rank))


def _steady(schedule: str, pp: int, micro_batches: int) -> int:
    """A micro-batch count with the same per-chunk peaks as ``micro_batches`` under a zero-bubble
    schedule: from ``2p`` on the peaks stop growing (two rounds of the same size for the
    interleaved one, ``2p`` for the V shapes; tests/test_schedules.py checks it on torch's lists),
    which keeps the search from building action lists of thousands of micro-batches."""
    m = micro_batches
    if schedule not in ZERO_BUBBLE or m < 2 * pp:
        return m
    return 2 * (m // (m // pp)) if schedule == "interleaved-zb" else 2 * pp


def chunk_peaks(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[int, ...]:
    """:func:`chunk_in_flight` of every chunk of the plan's ``stages``, in chunk order."""
    return _chunk_peaks(schedule, pp, virtual_stages, _steady(schedule, pp, micro_batches))


@functools.lru_cache(maxsize=1024)
def _chunk_peaks(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[int, ...]:
    out = [0] * (pp * virtual_stages)
    for k in range(pp):
        for c, q in zip(rank_chunks(schedule, k, pp, virtual_stages),
                        _chunk_in_flight(schedule, pp, virtual_stages, micro_batches, k)):
            out[c] = q
    return tuple(out)


def chunk_wgrad_peaks(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[int, ...]:
    """Every chunk's most micro-batches between their input- and weight-gradient passes (zero-bubble
    schedules; 0 otherwise, and for chunk 0, whose ``I`` torch runs as nothing), in chunk order."""
    return _chunk_wgrad_peaks(schedule, pp, virtual_stages, _steady(schedule, pp, micro_batches))


@functools.lru_cache(maxsize=1024)
def _chunk_wgrad_peaks(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[int, ...]:
    out = [0] * (pp * virtual_stages)
    if schedule not in ZERO_BUBBLE:
        return tuple(out)
    for actions in _torch_actions(schedule, pp, virtual_stages, micro_batches):
        held = [0] * (pp * virtual_stages)
        for kind, c, _mb in actions:
            if c and kind in ("I", "W"):
                held[c] += 1 if kind == "I" else -1
                out[c] = max(out[c], held[c])
    return tuple(out)


def step_slots(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> float:
    """The step time in units of one micro-batch's forward + backward through all of a rank's
    chunks (the slowest rank's): ``m`` of work plus the bubble, ``p - 1`` (GPipe, 1F1B) or
    ``(p - 1) / v`` (interleaved 1F1B: each warm-up slot is one chunk, ``1 / v`` of the rank's work);
    zero-bubble schedules: torch's action lists run with equal ``F`` / ``I`` / ``W`` times
    (:func:`_makespan`), divided by a rank's ``3 v`` chunk passes per micro-batch."""
    m, p, v = micro_batches, pp, virtual_stages
    if schedule_record(schedule).single_chunk:
        return m + p - 1
    if schedule == "interleaved-1f1b":
        return m + (p - 1) / v
    if schedule in ZERO_BUBBLE:
        return _zb_slots(schedule, p, v, m)
    raise ConfigError(f"no time model for schedule {schedule!r}; use one of {list(SCHEDULES)}")


@functools.lru_cache(maxsize=1024)
def _zb_slots(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> float:
    """Zero-bubble slots: with ``m >= p`` (every searched pipeline) the closed forms the simulation
    gives (tests/test_schedules.py checks them against it): ``m + (p - 1) / (3 v)``, ZB-V
    ``m + max((p - 1) / 6, (2p - m - 1) / 3)`` (its warm-up needs ``2p - 1`` micro-batches to fill
    the V); fewer micro-batches than stages: the simulation itself."""
    p, v, m = pp, virtual_stages, micro_batches
    if m < p:
        return _makespan(schedule, p, v, m) / (3 * v)
    if schedule == "zbv":
        return m + max((p - 1) / 6, (2 * p - m - 1) / 3)
    return m + (p - 1) / (3 * v)
