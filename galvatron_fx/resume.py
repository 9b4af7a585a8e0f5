"""Resuming a training run after a restart: which checkpoint, which plan, what was lost.

Under torchrun's elastic agent (``--max-restarts N``, ``--nnodes MIN:MAX``) a dead worker makes the
agent stop the others and start the whole group again; the new workers see
``TORCHELASTIC_RESTART_COUNT`` > 0. The train command then (:func:`galvatron_fx.text_train.train_text`):

1. takes the newest *complete* checkpoint under ``--ckpt-dir`` (:func:`find`; a save that was cut
   off has no marker and is skipped, :func:`galvatron_fx.checkpoint.latest`);
2. runs the plan stored in it when the world has the same size, else searches one for the world
   that is left (:func:`choose_plan`);
3. loads it (any plan, any world size) and continues at its step: the data order is a function
   of the step and the global batch only, so the batches are those the uninterrupted run sees;
4. once the first resumed step is done, prints one line (:func:`restart_line`): the world before
   and after, the plan, the step it resumed from and the steps redone, and the seconds from the
   last step before the failure to the first resumed step (rank 0's heartbeat, :func:`beat`).

A run stopped on purpose (a non-finite loss: :func:`mark_stopped`) stays stopped across the
agent's restarts: the restarted workers fail at once with the same line instead of repeating the
steps to the same NaN. A launch by hand (restart count 0) clears the mark.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from .errors import TrainingError

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
HEARTBEAT = "progress.json"
STOPPED = "stopped.json"


def restart_count() -> int:
    """How many times torchrun's agent restarted this worker group (0: the first launch)."""
    try:
        return int(os.environ.get(RESTART_ENV, "0"))
    except ValueError:
        return 0


@dataclass
class ResumePoint:
    """The checkpoint a run continues from."""

    path: str
    step: int
    world_size: int       # the saving run's world
    plan: object | None   # the saving run's plan (a Plan), when the checkpoint stores it


def find(ckpt_dir: str) -> ResumePoint | None:
    """The newest complete checkpoint under ``ckpt_dir`` (``None``: nothing to resume)."""
    from . import checkpoint
    from .plan import Plan

    path = checkpoint.latest(ckpt_dir)
    if path is None:
        return None
    marker = checkpoint.read_marker(path)
    stored = os.path.join(path, checkpoint.PLAN_FILE)
    plan = Plan.load(stored) if os.path.isfile(stored) else None
    return ResumePoint(path, int(marker["step"]), int(marker.get("world_size", 0)), plan)


def choose_plan(point: ResumePoint | None, world: int, given_path: str | None) -> tuple[object | None, str]:
    """``(plan to run or None: search one, why)`` for a world of ``world`` ranks: the ``--plan``
    file if it was made for this world; else the checkpoint's own plan if the world kept its size;
    else none (search)."""
    from .plan import Plan

    if given_path is not None:
        given = Plan.load(given_path)
        if given.world_size == world:
            return given, f"the plan {given_path}"
        if point is None:
            return given, f"the plan {given_path}"   # a first launch: transform names the mismatch
        return None, f"searched for {world} ranks ({given_path} is for {given.world_size})"
    if point is not None and point.plan is not None and point.plan.world_size == world:
        return point.plan, f"the checkpoint's plan ({world} ranks)"
    if point is not None:
        return None, f"searched for {world} ranks (the checkpoint ran on {point.world_size})"
    return None, "searched"


# ------------------------------------------------------------------------------ heartbeat
def beat(ckpt_dir: str, step: int, world: int) -> None:
    """Rank 0, after each step: the step and the time it finished (atomically replaced)."""
    os.makedirs(ckpt_dir, exist_ok=True)
    _write_json(os.path.join(ckpt_dir, HEARTBEAT),
                {"step": int(step), "time": time.time(), "world_size": int(world), "restart": restart_count()})


def last_beat(ckpt_dir: str) -> dict | None:
    """The previous attempt's last heartbeat (``None`` if there is none or it is unreadable)."""
    return _read_json(os.path.join(ckpt_dir, HEARTBEAT))


def restart_line(point: ResumePoint, world: int, plan_why: str, labels: list[str], before: dict | None,
                 resumed_at: float) -> str:
    """The one line a restart prints once its first step is done."""
    attempt = restart_count()
    who = f"restart {attempt} (torchrun)" if attempt else "resumed by hand"
    old = (before or {}).get("world_size") or point.world_size
    lost = (f"world {old} -> {world} ranks ({old - world} lost)" if old and old > world
            else f"world {old} -> {world} ranks" if old and old != world else f"same world ({world} ranks)")
    last = (before or {}).get("step")
    redo = f"; steps {point.step + 1}-{last} redone" if last and last > point.step else ""
    took = (f"; recovery {resumed_at - before['time']:.1f} s (last step before the failure -> first resumed "
            "step done)" if before and before.get("time") else "")
    plan = ", ".join(labels) if labels else "?"
    return f"{who}: {lost}; plan {plan_why}: {plan}; resumed at step {point.step} from {point.path}{redo}{took}"


# ------------------------------------------------------------------------------ stop mark
def mark_stopped(ckpt_dir: str, step: int, message: str) -> None:
    """Rank 0: the run stopped on purpose at ``step`` (an agent restart must not retry it)."""
    os.makedirs(ckpt_dir, exist_ok=True)
    _write_json(os.path.join(ckpt_dir, STOPPED), {"step": int(step), "message": message, "time": time.time()})


def check_stopped(ckpt_dir: str, clear: bool = True) -> None:
    """Under an agent restart, re-raise a stop of an earlier attempt; on a launch by hand, clear it
    (``clear``: rank 0 only; every rank reads the mark)."""
    path = os.path.join(ckpt_dir, STOPPED)
    mark = _read_json(path)
    if mark is None:
        return
    if restart_count() > 0:
        raise TrainingError(f"{mark['message']} (stopped before this restart; {path} holds the reason: "
                            "fix the cause and launch again)", every_rank=True)
    if clear:
        try:
            os.remove(path)
        except OSError:
            pass


def trim_log(path: str, step: int) -> None:
    """Rank 0, resuming at ``step``: drop the JSON-lines records of later steps (redone now)."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except ValueError:   # a line cut off by the kill
                continue
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
