"""The pure search core: strategy space, per-stage DP and pipeline partition.

Everything here takes numpy arrays, plain numbers and dataclasses (never a GraphModule or a process
group), so it can be unit-tested and benchmarked alone.

* :mod:`.strategy` — :class:`Strategy` and :func:`strategy_space` (the per-stage decision tree and
  its pruning :data:`RULES`).
* :mod:`.dp` — :func:`solve_stage`: exact DP over layers x strategies x discretised memory.
* :mod:`.stage` — :func:`solve_stage_exact`: one stage's optimum exact in bytes, with the largest
  transient of the chosen strategies.
* :mod:`.pipeline` — :func:`partition_stages` / :func:`partition_min_max` (min-max contiguous stage
  split, full or lazily pruned) and the pipeline time / in-flight micro-batch formulas.
* :mod:`.tables` / :mod:`.engine` — the per-configuration tables and the outer search over the
  whole space (:class:`~.engine.Engine`).
"""

from .dp import StageSolution, memory_units, solve_stage
from .pipeline import (
    SCHEDULES,
    Partition,
    balanced_split,
    even_split,
    in_flight_microbatches,
    partition_min_max,
    partition_stages,
    pipeline_step_time,
)
from .stage import ExactStage, solve_stage_exact, stage_min_memory
from .strategy import (
    RULES,
    SDP_KINDS,
    Rule,
    Strategy,
    candidate_counts,
    paper_comparable_count,
    rejecting_rules,
    strategy_space,
)

__all__ = [
    "RULES",
    "SCHEDULES",
    "SDP_KINDS",
    "ExactStage",
    "Partition",
    "Rule",
    "StageSolution",
    "Strategy",
    "candidate_counts",
    "balanced_split",
    "even_split",
    "in_flight_microbatches",
    "memory_units",
    "paper_comparable_count",
    "partition_min_max",
    "partition_stages",
    "pipeline_step_time",
    "rejecting_rules",
    "solve_stage",
    "solve_stage_exact",
    "stage_min_memory",
    "strategy_space",
]
