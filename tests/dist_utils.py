"""Run a function on several gloo ranks on 127.0.0.1 (the project's multi-process test helper).

    from tests.dist_utils import run_distributed

    def _body(rank, world_size, scale):      # module level, so that spawn can pickle it
        return rank * scale

    assert run_distributed(_body, 2, 10) == [0, 10]

Each rank runs in a spawned process with ``GALVATRON_DEVICE=cpu`` and ``GALVATRON_BACKEND=gloo``
(so library code picks the device matching the gloo group) and one intra-op thread (the test machine
is small). Return values must be picklable. If a rank raises, :class:`DistributedTestError` carries
that rank's traceback; if the ranks do not finish within ``timeout`` seconds, the survivors are
killed and the error names the ranks that did not report.

NOTE: CI time. The ranks are a pool kept per (world size, threads) for the whole test session:
spawning 2 / 4 processes, importing torch and forming the gloo group costs 3 / 7 s per call here,
most of a small test. After each function the ranks meet at a barrier (so a test that leaves a
collective unmatched fails itself, not the next one), the environment is restored, dynamo's
caches and the backend's counters are reset; after any failure or timeout the pool is killed and the next call starts a new
one. A function that changes module state must restore it (``try/finally``), or pass
``fresh=True`` to get processes of its own. ``GALVATRON_TEST_POOL=0`` turns the pool off.
"""

from __future__ import annotations

import atexit
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
    import torch.distributed as dist

    try:
        _init(rank, world_size, port, threads)
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


def _init(rank: int, world_size: int, port: int, threads: int) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "GALVATRON_DEVICE": "cpu", "GALVATRON_BACKEND": "gloo",
    })
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def _pool_worker(rank: int, world_size: int, port: int, threads: int, tasks, results) -> None:
    """A pooled rank: form the group once, then run tasks until ``None``."""
    _init(rank, world_size, port, threads)
    import sys

    import torch.distributed as dist

    env = dict(os.environ)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            value = fn(rank, world_size, *args)
            dist.barrier()   # every rank is done with the function's collectives
            results.put((rank, True, value))
        except BaseException:  # noqa: B036 - the parent must hear about any failure
            results.put((rank, False, traceback.format_exc()))
        finally:
            os.environ.clear()
            os.environ.update(env)
            if "torch._dynamo" in sys.modules:
                sys.modules["torch._dynamo"].reset()
            if "galvatron_fx.runtime.groups" in sys.modules:   # each test makes its groups, as a fresh process
                sys.modules["galvatron_fx.runtime.groups"].GROUPS.release()
            if "galvatron_fx.backend.options" in sys.modules:   # the process-wide counters tests read
                sys.modules["galvatron_fx.backend.options"].stats.update(compiles=0, searches=0)
    dist.destroy_process_group()


class _Pool:
    """``world_size`` pooled ranks (see the module docstring)."""

    def __init__(self, world_size: int, threads: int):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, world_size, port, threads, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_POOLS: dict[tuple[int, int], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        for q in pool.tasks:
            q.put(None)
        for p in pool.procs:
            p.join(timeout=5)
        pool.kill()
    _POOLS.clear()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    threads: int = 1, fresh: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the values by rank.

    ``fn`` must be importable at module level (spawn pickles it by name). ``timeout`` is in seconds
    for the whole run. Raises :class:`DistributedTestError` with the first failing rank's traceback.
    ``fresh``: new processes for this call only, not the session's pool.
    """
    if fresh or os.environ.get("GALVATRON_TEST_POOL", "1") == "0":
        return _run_fresh(fn, world_size, args, timeout, threads)
    key = (world_size, threads)
    pool = _POOLS.get(key) or _POOLS.setdefault(key, _Pool(world_size, threads))
    for q in pool.tasks:
        q.put((fn, args))
    try:
        return _collect(pool.procs, pool.results, world_size, timeout)
    except BaseException:
        _POOLS.pop(key, None)
        pool.kill()
        raise


def _run_fresh(fn, world_size: int, args: tuple, timeout: float, threads: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, threads, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done = False
    try:
        values = _collect(procs, results, world_size, timeout)
        done = True
        return values
    finally:
        for p in procs:
            p.join(timeout=5 if done else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs, results, world_size: int, timeout: float) -> list[Any]:
    """Every rank's value from ``results``; :class:`DistributedTestError` on a failure, a death or
    a timeout."""
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
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
    return [values[r] for r in range(world_size)]
