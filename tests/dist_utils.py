"""Run a function on several gloo ranks on 127.0.0.1 (the project's multi-process test helper).

    from tests.dist_utils import run_distributed

    def _body(rank, world_size, scale):      # module level, so that spawn can pickle it
        return rank * scale

    assert run_distributed(_body, 2, 10) == [0, 10]

Each rank runs in a fresh spawned process with ``GALVATRON_DEVICE=cpu`` and ``GALVATRON_BACKEND=gloo``
(so library code picks the device matching the gloo group) and one intra-op thread (the test machine
is small). Return values must be picklable. If a rank raises, :class:`DistributedTestError` carries
that rank's traceback; if the ranks do not finish within ``timeout`` seconds, the survivors are
killed and the error names the ranks that did not report.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` failed or timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, threads: int, results) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "GALVATRON_DEVICE": "cpu", "GALVATRON_BACKEND": "gloo",
    })
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: B036 - the parent must hear about any failure
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the values by rank.

    ``fn`` must be importable at module level (spawn pickles it by name). ``timeout`` is in seconds
    for the whole run. Raises :class:`DistributedTestError` with the first failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, threads, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise DistributedTestError(f"ranks {missing} did not finish within {timeout:.0f}s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    raise DistributedTestError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before reporting"
                    ) from None
                continue
            if not ok:
                raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]
