"""Small runtime helpers: which device and backend this process uses, and a few torch.distributed shims.

The device and backend come from the environment, never from a hard-coded choice:

* ``GALVATRON_DEVICE`` (``cuda`` | ``cpu`` | any ``torch.device`` string) overrides the device;
  otherwise it is ``cuda`` when CUDA is available, else ``cpu``.
* ``GALVATRON_BACKEND`` (``nccl`` | ``gloo`` | ...) overrides the process-group backend;
  otherwise it is ``nccl`` when the device is CUDA, else ``gloo``.

With several CUDA devices per node, rank ``LOCAL_RANK`` (set by torchrun) uses ``cuda:LOCAL_RANK``.

Collective timeout: ``GALVATRON_DIST_TIMEOUT_S`` (seconds, default 600; the train command's
``--timeout``) bounds how long a collective waits for a peer that is alive but silent (a rank that
*died* closes its sockets and its peers fail at once; see docs/reliability.md). torch's own
default is 30 minutes.

Restarts under torchrun: the elastic agent hands every attempt the *same* TCPStore (its shared
rendezvous store, ``TORCHELASTIC_USE_AGENT_STORE``), which still holds the previous attempt's
process-group keys; a restarted worker that reads them connects to dead peers' ports and waits
out the timeout (pytorch/pytorch#135712; torch 2.13, gloo and NCCL alike). So under the agent,
rank 0 of each attempt serves a fresh store of its own and publishes its port through the agent's
store; the other ranks take the published port only once a live store answers on it with this
attempt's token (:func:`_attempt_store`). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on torchrun
avoids the shared store altogether (c10d rendezvous only).
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import time
import uuid

import torch
import torch.distributed as dist

from .errors import ConfigError

DEVICE_ENV = "GALVATRON_DEVICE"
BACKEND_ENV = "GALVATRON_BACKEND"
TIMEOUT_ENV = "GALVATRON_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0


def local_rank() -> int:
    """This process's rank inside its node (``LOCAL_RANK``, default 0)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def pick_device() -> torch.device:
    """The device this process computes on (see the module docstring for the rules)."""
    wanted = os.environ.get(DEVICE_ENV, "").strip()
    if wanted:
        try:
            device = torch.device(wanted)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"{DEVICE_ENV}={wanted!r} is not a torch device; use e.g. 'cuda' or 'cpu'") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{DEVICE_ENV}={wanted!r} but CUDA is not available; unset it or use 'cpu'")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
    return device


def pick_backend(device: torch.device | None = None) -> str:
    """The torch.distributed backend matching ``device`` (default :func:`pick_device`)."""
    wanted = os.environ.get(BACKEND_ENV, "").strip()
    if wanted:
        return wanted
    device = device if device is not None else pick_device()
    return "nccl" if device.type == "cuda" else "gloo"


def collective_timeout() -> datetime.timedelta:
    """How long a collective waits for its peers (``GALVATRON_DIST_TIMEOUT_S``, default 600 s)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds; unset it or use e.g. 300")
    return datetime.timedelta(seconds=seconds)


_TIMEOUT: list[datetime.timedelta] = []   # what init_distributed gave the default group


def group_timeout() -> datetime.timedelta:
    """The timeout of the groups the package creates beside the default one (torch would give them
    its own default, 30 minutes under gloo): the default group's from :func:`init_distributed`,
    else :func:`collective_timeout`."""
    return _TIMEOUT[-1] if _TIMEOUT else collective_timeout()


def shutdown() -> None:
    """Tear the default process group down (collectively) before the process exits.

    NOTE: a gloo group left alive at interpreter exit can abort the process from its destructor
    ("terminate called without an active exception"), which torchrun reports as a failed rank. So
    can a finished collective's work object that cyclic garbage (a training run's model and its
    hooks) still holds when the interpreter finalizes: destroying it then takes the GIL mid
    teardown (pytorch/pytorch#179291). Collect that garbage first, while Python is whole (the
    train command's ZeRO-3 run aborted so once in CI)."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    """Wait until all queued work on ``device`` has finished (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init_distributed(timeout: float | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment unless it already is.

    Uses :func:`pick_backend`, ``init_method='env://'`` (under torchrun's elastic agent, a fresh
    store per attempt: the module docstring) and ``timeout`` seconds (default
    :func:`collective_timeout`) for every collective; on CUDA also selects the local device.
    Returns ``(rank, world_size)``.
    """
    if not dist.is_initialized():
        device = pick_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"the collective timeout must be a positive number of seconds, got {timeout}")
        timeout = datetime.timedelta(seconds=timeout) if timeout is not None else collective_timeout()
        _TIMEOUT.append(timeout)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend=pick_backend(device), store=_attempt_store(rank, world, timeout),
                                    rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend=pick_backend(device), init_method="env://", timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


_SERVED: list = []   # rank 0's store of this attempt, alive as long as the process


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta):
    """A TCPStore only this attempt's workers use (see the module docstring).

    Rank 0 starts one on a free port and publishes ``port:token`` in the agent's store; the others
    read the published value until a store answers on that port holding the same token (a value
    left by an earlier attempt names a port whose server died with it: refused, so read again)."""
    host = os.environ.get("MASTER_ADDR", "localhost")
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    key = "galvatron_fx/attempt_store"
    if rank == 0:
        token = uuid.uuid4().hex
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        store.set("token", token)
        _SERVED.append(store)
        agent.set(key, f"{store.port}:{token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, token = agent.get(key).decode().split(":")
        try:
            socket.create_connection((host, int(port)), timeout=2).close()   # quiet probe: c10d logs failed connects
            store = dist.TCPStore(host, int(port), world, is_master=False, timeout=datetime.timedelta(seconds=5))
            if store.get("token").decode() == token:
                store.set_timeout(timeout)
                return store
        except (OSError, RuntimeError, dist.DistError):   # refused (an earlier attempt's port) or a stranger
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no store of this restart attempt answered within "
                               f"{timeout.total_seconds():.0f} s (rank 0 did not start?)")
        time.sleep(0.1)


def is_distributed() -> bool:
    """True when torch.distributed is available and its default group is initialised."""
    return dist.is_available() and dist.is_initialized()


# NOTE: torch renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and deprecated
# the old names; use whichever this torch has (both accept async_op). The only shim in the package.
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """All-gather ``inp`` from every rank of ``group`` into the flat ``output`` (rank order);
    returns the work handle when ``async_op``."""
    return _AG(output, inp, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``inp`` over ``group`` and keep this rank's equal slice in ``output``; returns the work
    handle when ``async_op``."""
    return _RS(output, inp, group=group, async_op=async_op)
