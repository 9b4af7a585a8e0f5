"""Watching a training run: peak memory per device beside the plan's estimate, an ETA, TensorBoard.

* :func:`peak_bytes`: this process's peak device memory (CUDA ``max_memory_allocated``; on CPU
  the process's peak RSS, which also counts Python and torch themselves).
* :func:`peaks` gathers every rank's peak (one small all-gather of int64s per call), and
  :func:`estimated_peak` reads the plan's estimate for a rank's stage, so that a step record
  holds both: a memory model that is wrong shows in the log.
* :class:`Eta` turns step times into a remaining-time estimate (the mean of the recent steps).
* :class:`Board` writes the step records as TensorBoard scalars through
  ``torch.utils.tensorboard`` (the optional ``tensorboard`` package:
  ``pip install 'galvatron-fx[tensorboard]'``).
"""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from .errors import ConfigError


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory on ``device`` so far (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def peaks(device: torch.device) -> list[int]:
    """Every rank's :func:`peak_bytes` (collective)."""
    mine = torch.tensor([peak_bytes(device)], dtype=torch.int64, device=device)
    if not (dist.is_available() and dist.is_initialized()):
        return [int(mine)]
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t) for t in out]


def estimated_peak(plan, rank: int) -> int | None:
    """The plan's estimated peak tensor bytes on ``rank``'s device (its pipeline stage's), if recorded.

    The search's fixed headroom (``reserve_bytes``: the CUDA context, allocator slack) is left
    out: what remains prices the tensors that ``max_memory_allocated`` counts."""
    estimate = getattr(plan, "estimate", None) or {}
    per_stage = estimate.get("memory_bytes_per_device")
    if not per_stage:
        return None
    stage = rank // max(1, plan.world_size // plan.pp)
    value = per_stage[min(stage, len(per_stage) - 1)]
    reserve = (estimate.get("per_device") or {}).get("reserve_bytes") or 0
    return int(value - reserve) if value is not None else None


def peak_word(device: torch.device) -> str:
    """What :func:`peak_bytes` measures on ``device``, for the step line."""
    return "peak" if device.type == "cuda" else "peak rss"


class Eta:
    """Remaining time from the mean of the last ``window`` step times."""

    def __init__(self, window: int = 20):
        self.window, self.times = window, []

    def add(self, seconds: float) -> None:
        self.times = (self.times + [seconds])[-self.window:]

    def remaining(self, steps_left: int) -> str:
        if not self.times:
            return "?"
        s = int(round(sum(self.times) / len(self.times) * steps_left))
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


#: step-record key -> TensorBoard tag
SCALARS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
           "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
           "peak_bytes": "memory/peak_bytes_max", "estimate_bytes": "memory/estimate_bytes_max"}


class Board:
    """TensorBoard event files in ``log_dir`` (rank 0 only): one scalar per :data:`SCALARS` key and
    ``memory/peak_bytes/rank<r>`` per rank, at the record's ``step``."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(f"--tensorboard {log_dir}: the tensorboard package is not installed; "
                              "pip install 'galvatron-fx[tensorboard]' (or tensorboard)") from exc
        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict, per_rank_peaks: list[int] | None = None) -> None:
        step = int(record["step"])
        for key, tag in SCALARS.items():
            value = record.get(key)
            if value is not None:
                self.writer.add_scalar(tag, float(value), step)
        for r, b in enumerate(per_rank_peaks or []):
            self.writer.add_scalar(f"memory/peak_bytes/rank{r}", float(b), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
