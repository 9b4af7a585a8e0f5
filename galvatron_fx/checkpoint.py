"""Sharded, plan-portable, atomic training checkpoints on ``torch.distributed.checkpoint`` (DCP).

    gfx.checkpoint.save(dist_model, optimizer, "ckpt/step-100", step=100)    # collective
    pending = gfx.checkpoint.save(dm, opt, path, step=100, async_save=True)  # training goes on
    pending.result()                                                         # path, once complete
    step = gfx.checkpoint.load(dist_model, optimizer, "ckpt/step-100")       # collective, any plan
    gfx.checkpoint.consolidate("ckpt/step-100", "export/")                   # one process: safetensors
    state = gfx.checkpoint.consolidate("ckpt/step-100")                      # or fqn -> tensor
    path = gfx.checkpoint.latest("ckpt")                                     # newest complete one

What is stored. One DCP tensor per original parameter FQN and per optimizer state of it, each the
*global* (unsharded) tensor as a table of chunks; **every rank writes only elements it holds**, at
their global offsets (:mod:`galvatron_fx.runtime.chunks`: its dim-0 slice of each TP-local
parameter slice, as boxes of the global tensor: one box, cut only at fused q/k/v blocks), no gathering:

=========================  ===================================================================
``model.<fqn>``            the parameter's fp32 masters
``optim.<fqn>.<key>``      an elementwise optimizer state of it (AdamW: ``exp_avg``,
                           ``exp_avg_sq``), same chunks; a 0-dim one (``step``) whole
=========================  ===================================================================

plus ``galvatron_checkpoint.json`` (the completion marker: step, world size, the saving plan's
shape, optimizer hyper-parameters), ``plan.json`` (the saving plan, which a restart on a world of
the same size runs again: :mod:`galvatron_fx.resume`) and, when ``save(..., config=...)`` got a transformers config,
``hf_config.json``. Each element is written by exactly one rank: DP replicas split ownership as
ZeRO shards would (dim-0 slices), TP rank 0 writes what TP keeps whole, stages own their layers; DCP checks that
the chunks tile every tensor. On load, :func:`load` asks for the elements its plan holds (any
plan, any world size) and DCP reads them from whichever chunks overlap, straight into the flat
buffers and optimizer states.

Atomicity. :func:`save` writes into ``<path>.tmp-<step>``. DCP's coordinator commits a save only
after every rank's data is written (``StorageWriter.finish``); its ``CommittingWriter`` then
writes the marker (fsynced) and renames the directory into place (an older ``path`` is moved aside
first and removed after). A rank killed mid-save leaves only the ``.tmp-`` directory, which has no
marker, which :func:`load` refuses with :class:`IncompleteCheckpointError` and :func:`latest`
skips; the previous checkpoint is untouched. An ``async_save`` commits the same way, from DCP's
background thread. All ranks must see one shared filesystem (the usual DCP assumption).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future

import torch
import torch.distributed as dist

from .errors import ConfigError

MARKER = "galvatron_checkpoint.json"
HF_CONFIG = "hf_config.json"
PLAN_FILE = "plan.json"
FORMAT = "galvatron_fx.checkpoint/2"
#: formats :func:`load` reads (/1: whole tensors, the same entries; DCP reshards them the same way)
READABLE = ("galvatron_fx.checkpoint/1", FORMAT)


class IncompleteCheckpointError(ConfigError):
    """A checkpoint directory without its completion marker (a save that did not finish)."""


class CorruptCheckpointError(ConfigError):
    """A complete checkpoint whose files are missing, truncated or unreadable."""


class AsyncSave:
    """A save in flight (``save(..., async_save=True)``): :meth:`result` waits for it and returns
    the checkpoint path (re-raising a failure); :meth:`done` polls. The next :func:`save` or
    :func:`load` on this process waits for it first."""

    def __init__(self, future: Future, path: str):
        self._future, self.path = future, path

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        self._future.result(timeout)
        return self.path


_PENDING: list[AsyncSave] = []
_GROUP: dict[str, object] = {}   # "world": the default group it was made in, "group": DCP's group


# ----------------------------------------------------------------------------- public API
def save(dist_model, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
         step: int = 0, async_save: bool = False, config=None) -> str | AsyncSave:
    """Write the masters (and optimizer states) of ``dist_model`` to ``path`` atomically; collective.

    Args:
        dist_model: what :func:`galvatron_fx.transform` returned (pp = 1 or pp > 1).
        optimizer: an optimizer over ``dist_model.parameters()`` or ``None`` (parameters only).
        path: the checkpoint directory (replaced if it exists, only once the new one is complete).
        step: the training step, returned by :func:`load`.
        async_save: copy this rank's pieces (its share of the states) and return an
            :class:`AsyncSave` at once; DCP writes them in a background thread while training
            goes on.
        config: the model's transformers config (a ``PretrainedConfig``, its dict, or the model
            itself), stored so that :func:`consolidate` can write ``config.json`` for
            ``from_pretrained``.
    Returns the path (or, with ``async_save``, the pending save).

    Memory: a synchronous save hands DCP views of the buffers, pieces of at most one bucket
    (``bucket_bytes``): no copy on CPU; from an accelerator DCP copies the pieces to host memory.
    An async save holds a host copy of this rank's pieces until they are written.
    """
    import torch.distributed.checkpoint as dcp

    from .runtime.sharded_state import ChunkSavePlanner, CommittingWriter, save_state

    _wait_pending()
    path = os.fspath(path)
    tmp = f"{path}.tmp-{int(step)}"
    stage = _stage(dist_model)
    pg = _checkpoint_group()
    rank = dist.get_rank()
    marker = _marker(dist_model, optimizer, step) if rank == 0 else None
    hf = _hf_config(config)   # on every rank: a bad config fails everywhere, before any collective
    if rank == 0:
        if os.path.exists(tmp):   # left over from a save that was killed
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        dist_model.plan.save(os.path.join(tmp, PLAN_FILE))
        if hf is not None:
            with open(os.path.join(tmp, HF_CONFIG), "w") as f:
                json.dump(hf, f, indent=1, sort_keys=True)
    dist.barrier(group=pg)
    writer = CommittingWriter(tmp, lambda: _commit(tmp, path, marker))
    if not async_save:
        dcp.save(save_state(stage, optimizer), storage_writer=writer, planner=ChunkSavePlanner(), process_group=pg)
        return path
    from torch.distributed.checkpoint.staging import AsyncStager

    class _Staged(AsyncStager):   # save_state(copy=True) is the staging copy already
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

    future = dcp.async_save(save_state(stage, optimizer, copy=True), storage_writer=writer,
                            planner=ChunkSavePlanner(), process_group=pg, async_stager=_Staged())
    pending = AsyncSave(future, path)
    _PENDING.append(pending)
    return pending


def load(dist_model, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> int:
    """Restore ``dist_model`` (and ``optimizer``) from a checkpoint saved under *any* plan and world
    size of the same model; collective. Every replica ends consistent (ZeRO-2's whole buffers are
    re-gathered). Returns the saved step.

    Raises:
        IncompleteCheckpointError: ``path`` has no completion marker (an interrupted save).
        ConfigError: no checkpoint at ``path``, or it lacks parameters of this model.
    """
    import torch.distributed.checkpoint as dcp

    from .runtime.sharded_state import ChunkLoadPlanner, load_state

    path = os.fspath(path)
    _wait_pending()   # this process's async save may be the one to load
    marker = read_marker(path)
    stage = _stage(dist_model)
    if optimizer is not None:
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        theirs = {id(p) for p in stage.parameters()}
        if not mine & theirs or not mine <= theirs:
            raise ConfigError("the optimizer does not hold this model's parameters; build it over "
                              "dist_model.parameters() before gfx.checkpoint.load")
    reader = dcp.FileSystemReader(path)
    metadata = _checked_metadata(reader, path)
    state, finish = load_state(stage, optimizer, metadata, path)
    try:
        with torch.no_grad():
            dcp.load(state, storage_reader=reader, planner=ChunkLoadPlanner(), process_group=_checkpoint_group())
    except Exception as exc:   # DCP raises on every rank (it gathers the readers' failures)
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise CorruptCheckpointError(f"checkpoint {path!r} could not be read ({type(exc).__name__}: {first[:300]}); "
                                     "it is corrupt or not this model's: delete it to resume from the previous "
                                     "one") from exc
    finish()
    if optimizer is not None:
        _restore_hparams(optimizer, marker.get("param_groups") or [])
    return int(marker["step"])


def consolidate(path: str | os.PathLike, out_dir: str | os.PathLike | None = None, *,
                optimizer: bool = False):
    """The whole checkpoint in one process, no process group needed.

    With ``out_dir``: write the original model's state dict (the masters, original FQNs, tied
    weights under one name) as ``out_dir/model.safetensors``, streamed tensor by tensor (memory:
    about the largest tensor), plus ``config.json`` when the save recorded a transformers config,
    so that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads the trained weights; returns
    ``out_dir``. Without: returns ``fqn -> tensor`` that ``original_model.load_state_dict(state,
    strict=False)`` accepts (the whole model in memory); with ``optimizer=True`` the keys keep their
    ``model.`` / ``optim.`` prefixes (and the optimizer states are included).
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    read_marker(path)
    _checked_metadata(dcp.FileSystemReader(path), path)
    from .consolidation import stream_safetensors, tensor_entries

    entries = tensor_entries(path, optimizer=optimizer)
    if out_dir is None:
        state = _read(path, {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in entries.items()})
        return state if optimizer else {k[len("model."):]: v for k, v in state.items()}
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    names = {k: (k if optimizer else k[len("model."):]) for k in entries}
    stream_safetensors(os.path.join(out_dir, "model.safetensors"), entries, names,
                       lambda want: _read(path, want))
    hf = os.path.join(path, HF_CONFIG)
    if os.path.isfile(hf):
        with open(hf) as f:
            config = json.load(f)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
    return out_dir


def latest(root: str | os.PathLike) -> str | None:
    """The complete checkpoint under ``root`` with the highest step (``None`` if there is none);
    interrupted saves (``*.tmp-*``, no marker) are skipped. A ``*.old-*`` directory (a replaced
    checkpoint, removed once its successor is in place) counts only if its successor is missing,
    i.e. the saver died between the two renames."""
    root = os.fspath(root)
    best = None
    names = os.listdir(root) if os.path.isdir(root) else []
    for name in names:
        full = os.path.join(root, name)
        if ".tmp-" in name or not os.path.isfile(os.path.join(full, MARKER)):
            continue
        if ".old-" in name and name.rsplit(".old-", 1)[0] in names:
            continue
        try:
            step = read_marker(full)["step"]
        except ConfigError:
            continue
        if best is None or step > best[0]:
            best = (step, full)
    return best[1] if best else None


def read_marker(path: str) -> dict:
    """The completion marker of checkpoint ``path`` (raises if missing: the save did not finish)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        parent = os.path.dirname(path) or "."
        tmp = [n for n in (os.listdir(parent) if os.path.isdir(parent) else [])
               if n.startswith(os.path.basename(path) + ".tmp-")]
        hint = f" (found the interrupted save {tmp[0]!r}, which is never loaded)" if tmp else ""
        raise ConfigError(f"no checkpoint at {path!r}{hint}; pass the directory gfx.checkpoint.save wrote, "
                          "or gfx.checkpoint.latest(root) for the newest complete one")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker) and ".tmp-" not in os.path.basename(path) and \
            os.path.isfile(os.path.join(path, ".metadata")):   # save() renames a directory only once it is marked
        raise ConfigError(f"{path!r} holds a torch.distributed.checkpoint but no {MARKER}: it was not written by "
                          "gfx.checkpoint.save (another program's checkpoint?); galvatron_fx loads only its own "
                          "(export from the other program to safetensors and start with --init DIR)")
    if not os.path.isfile(marker):
        raise IncompleteCheckpointError(
            f"checkpoint {path!r} is incomplete (no {MARKER}: its save was interrupted) and is never "
            "loaded; load the previous checkpoint (gfx.checkpoint.latest(root)) and delete this directory")
    try:
        with open(marker) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise IncompleteCheckpointError(f"checkpoint {path!r} has an unreadable {MARKER} ({exc}); "
                                        "load the previous checkpoint") from exc
    if data.get("format") not in READABLE:
        raise ConfigError(f"checkpoint {path!r} has format {data.get('format')!r}, expected one of {READABLE}")
    return data


# ------------------------------------------------------------------------------ internals
def _commit(tmp: str, path: str, marker: dict) -> None:
    """Rank 0, once every rank's data and DCP's metadata are on disk: the marker, then the rename."""
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    old = f"{path}.old-{marker['step']}"
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    if os.path.exists(old):
        shutil.rmtree(old)


def _checked_metadata(reader, path: str):
    """DCP's metadata of ``path``, after checking that every data file it indexes is there and long
    enough (a truncated or missing file is named here, before any rank starts reading)."""
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise CorruptCheckpointError(f"checkpoint {path!r}: its index {os.path.join(path, '.metadata')!r} is "
                                     f"unreadable ({type(exc).__name__}: {str(exc)[:200]}); delete the checkpoint "
                                     "to resume from the previous one") from exc
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"holds {have} bytes where its index needs {size} (truncated)"
            raise CorruptCheckpointError(f"checkpoint {path!r} is corrupt: data file {file!r} {what}; delete the "
                                         "checkpoint to resume from the previous one")
    return metadata


def _checkpoint_group():
    """A gloo group over the world for DCP's collectives (created once per world, collectively).

    NOTE: a group of its own because an async save runs DCP's collectives from a background thread
    while training runs its own; gloo because DCP coordinates on CPU tensors."""
    if _GROUP.get("world") is not dist.group.WORLD:   # first save, or a re-initialised world
        from .distributed import group_timeout

        _GROUP.update(world=dist.group.WORLD, group=dist.new_group(backend="gloo", timeout=group_timeout()))
    return _GROUP["group"]


def _wait_pending() -> None:
    while _PENDING:
        _PENDING.pop(0).result()


def _read(path: str, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``want`` (key -> an empty whole tensor) filled from checkpoint ``path`` in this process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(want, checkpoint_id=path, no_dist=True)
    return want


def _stage(dist_model):
    """The :class:`~.runtime.module.DistributedModel` of this rank (a pipeline's stage; a
    :class:`~.runtime.chunk_set.ChunkSet` when the rank runs several chunks)."""
    from .runtime.chunk_set import ChunkSet
    from .runtime.module import DistributedModel

    stage = getattr(dist_model, "stage", dist_model)
    if not isinstance(stage, (DistributedModel, ChunkSet)):
        raise ConfigError("gfx.checkpoint needs the module gfx.transform returned, "
                          f"got {type(dist_model).__name__}")
    return stage


def _hf_config(config) -> dict | None:
    """A transformers config (or the model holding one, or its dict) as the dict of ``config.json``."""
    if config is None:
        return None
    model = config if isinstance(config, torch.nn.Module) else None
    config = getattr(model, "config", config)
    if isinstance(config, dict):
        return dict(config)
    if not hasattr(config, "to_json_string"):
        raise ConfigError(f"config= takes a transformers PretrainedConfig, its dict or the model, "
                          f"got {type(config).__name__}")
    data = json.loads(config.to_json_string(use_diff=False))   # what save_pretrained writes
    if not data.get("architectures") and model is not None:
        data["architectures"] = [type(model).__name__]
    return data


def _marker(dist_model, optimizer, step: int) -> dict:
    plan = dist_model.plan
    groups = []
    for g in (optimizer.param_groups if optimizer is not None else []):
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                       if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))})
    return {"format": FORMAT, "step": int(step), "world_size": dist.get_world_size(), "time": time.time(),
            "plan": {"pp": plan.pp, "micro_batches": plan.micro_batches,
                     "layers": [[lp.tp, lp.dp, lp.sdp] for lp in plan.layers]},
            "param_groups": groups}


def _restore_hparams(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    """Saved hyper-parameters (lr after a scheduler, betas, ...) into the param groups: group ``i``
    from saved group ``i`` when the counts match (groups built the same way), else the first saved
    group into every group (a checkpoint of an earlier version, whose one group held everything)."""
    if not saved:
        return
    same = len(saved) == len(optimizer.param_groups)
    for i, g in enumerate(optimizer.param_groups):
        for k, v in saved[i if same else 0].items():
            if k in g:
                g[k] = tuple(v) if isinstance(g[k], tuple) else v
