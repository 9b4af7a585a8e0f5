"""The pipeline schedules a plan may name, one :class:`Schedule` record each, looked up by name.

Every part that treats schedules differently reads the record instead of comparing names: the plan's
checks and the pipeline algebra (:mod:`galvatron_fx.solver.schedules`), the search's configuration
loop (:mod:`galvatron_fx.solver.engine`), the cost model's split backward
(:mod:`galvatron_fx.solver.objective`) and the runtime, which builds the ``torch.distributed.
pipelining`` schedule class it names (:mod:`galvatron_fx.runtime.pipeline`). Pure data: the
runtime and the solver both import it, neither the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule.

    ``torch_class``: the ``torch.distributed.pipelining.schedules`` class the runtime runs it with;
    ``chunks_per_rank``: the virtual stages it runs on each pipeline rank when fixed (1: one chunk,
    the class takes a single stage; 2: a V), None when any ``v`` (interleaved; the search tries
    ``v >= min_searched_chunks``);
    ``v_shape``: rank ``r`` runs chunks ``r`` and ``2p - 1 - r`` (else chunk ``c`` on rank ``c % p``);
    ``split_backward``: the backward runs as an input-gradient pass and a later weight-gradient pass
    (zero bubble); ``min_stages``: the pipeline ranks it needs; ``searched``: the search tries it
    unpinned (GPipe only when pinned: the same time as 1F1B under the cost model, never less memory);
    ``microbatches_cover_stages``: torch's class needs at least as many micro-batches as stages
    (``pp * v``) in a pipeline.
    """

    name: str
    torch_class: str
    chunks_per_rank: int | None = 1
    min_searched_chunks: int = 1
    v_shape: bool = False
    split_backward: bool = False
    min_stages: int = 1
    searched: bool = True
    microbatches_cover_stages: bool = False

    @property
    def single_chunk(self) -> bool:
        """One chunk per rank (GPipe, 1F1B): torch's class takes one stage, not a list."""
        return self.chunks_per_rank == 1

    @property
    def default_chunks_per_rank(self) -> int:
        """``v`` a plan gets when it does not say."""
        return self.chunks_per_rank or 1


SCHEDULE: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "ScheduleGPipe", searched=False),
    Schedule("1f1b", "Schedule1F1B", microbatches_cover_stages=True),
    Schedule("interleaved-1f1b", "ScheduleInterleaved1F1B", chunks_per_rank=None, min_searched_chunks=2),
    Schedule("interleaved-zb", "ScheduleInterleavedZeroBubble", chunks_per_rank=None, split_backward=True,
             min_stages=2),
    Schedule("zbv", "ScheduleZBVZeroBubble", chunks_per_rank=2, v_shape=True, split_backward=True, min_stages=2),
    Schedule("dualpipev", "ScheduleDualPipeV", chunks_per_rank=2, v_shape=True, split_backward=True, min_stages=2,
             microbatches_cover_stages=True),
)}
"""Every schedule a plan may name (the plan JSON's ``schedule``), by name."""


def schedule_record(name: str) -> Schedule:
    """The record of schedule ``name``; :class:`ConfigError` naming the choices otherwise."""
    try:
        return SCHEDULE[name]
    except (KeyError, TypeError):
        raise ConfigError(f"plan schedule must be one of {list(SCHEDULE)}, got {name!r}") from None
