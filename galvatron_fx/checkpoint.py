"""Plan-portable, atomic training checkpoints on ``torch.distributed.checkpoint`` (DCP).

    gfx.checkpoint.save(dist_model, optimizer, "ckpt/step-100", step=100)    # collective
    step = gfx.checkpoint.load(dist_model, optimizer, "ckpt/step-100")       # collective, any plan
    state = gfx.checkpoint.consolidate("ckpt/step-100")                      # no process group
    model.load_state_dict(state, strict=False)                               # the original nn.Module
    path = gfx.checkpoint.latest("ckpt")                                     # newest complete one

What is stored (plan independent). One DCP entry per original parameter FQN and per optimizer
state of it, always the *whole* tensor, whatever the plan sharded:

=========================  ===================================================================
``model.<fqn>``            the full parameter (flat-buffer slice, ZeRO shards gathered over DP,
                           TP shards reassembled with ``sharding.unshard``)
``optim.<fqn>.<key>``      an elementwise optimizer state of it, reassembled the same way
                           (AdamW: ``exp_avg``, ``exp_avg_sq``), or a 0-dim one (``step``)
=========================  ===================================================================

plus ``galvatron_checkpoint.json`` (the completion marker: step, world size, the saving plan's
shape, optimizer hyper-parameters). Because the entries are plan independent, a checkpoint saved
under one plan loads under any other plan of the same model (DP2 -> TP2, TP2 -> PP2, ZeRO-3 -> a
searched plan, fewer devices after a failure): :func:`load` reads the whole tensors its rank's
layers need and cuts this rank's TP shard and ZeRO shard out of them.

NOTE: why whole tensors rather than DTensor/ShardedTensor local shards. A layer's ZeRO shard is a
range of a flat buffer of *TP-local* parameter slices, possibly of several fused q/k/v blocks:
not a rectangular piece of any original parameter, which DCP's resharding needs. Gathering to
whole tensors is exact and simple; DCP's planner then de-duplicates the replicated entries, so each
tensor is written once, by one rank (``dedup_save_plans``), in parallel over the ranks that own
different tensors (pipeline stages write their own layers). The cost is one transient whole copy
of a layer's states per rank while saving: fine for the models a CPU test or a restart handles,
and the place to switch to per-parameter local shards when states outgrow a rank.

Atomicity. :func:`save` writes into ``<path>.tmp-<step>``; after a barrier rank 0 writes the marker
(fsynced) and renames the directory into place (an older ``path`` is moved aside first and removed
after). A rank killed mid-save leaves only the ``.tmp-`` directory, which has no marker and which
:func:`load` refuses with :class:`IncompleteCheckpointError`; the previous checkpoint is untouched.
All ranks must see one shared filesystem (the usual DCP assumption).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist

from .errors import ConfigError

MARKER = "galvatron_checkpoint.json"
FORMAT = "galvatron_fx.checkpoint/1"


class IncompleteCheckpointError(ConfigError):
    """A checkpoint directory without its completion marker (a save that did not finish)."""


# ----------------------------------------------------------------------------- public API
def save(dist_model, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
         step: int = 0) -> str:
    """Write model (and optimizer) state of ``dist_model`` to ``path`` atomically; collective.

    Args:
        dist_model: what :func:`galvatron_fx.transform` returned (pp = 1 or pp > 1).
        optimizer: ``dist_model.optimizer(...)`` or ``None`` (parameters only).
        path: the checkpoint directory (replaced if it exists, only once the new one is complete).
        step: the training step, returned by :func:`load`.
    Returns the path.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp-{int(step)}"
    rank = dist.get_rank()
    if rank == 0 and os.path.exists(tmp):   # left over from a save that was killed
        shutil.rmtree(tmp)
    dist.barrier()
    state = state_dict(dist_model, optimizer)
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()
    if rank == 0:
        _write_marker(tmp, dist_model, optimizer, step)
        old = f"{path}.old-{int(step)}"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    dist.barrier()
    return path


def load(dist_model, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> int:
    """Restore ``dist_model`` (and ``optimizer``) from a checkpoint saved under *any* plan of the
    same model; collective. Returns the saved step.

    Raises:
        IncompleteCheckpointError: ``path`` has no completion marker (an interrupted save).
        ConfigError: no checkpoint at ``path``, or it lacks parameters of this model.
    """
    path = os.fspath(path)
    marker = read_marker(path)
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stage = _stage(dist_model)
    flat_params = {id(s.flat_param) for s in stage.stores}
    if optimizer is not None:
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not flat_params <= mine:
            raise ConfigError("the optimizer does not hold this model's parameters; build it with "
                              "dist_model.optimizer(...) before gfx.checkpoint.load")
    want: dict[str, torch.Tensor] = {}
    opt_keys: dict[str, list[str]] = {}
    for s in stage.stores:
        for fqn, _shape in zip(s.fqns, s.shapes):
            key = f"model.{fqn}"
            if key not in meta:
                raise ConfigError(f"checkpoint {path!r} has no parameter {fqn!r}: it was saved for another "
                                  "model; load a checkpoint of this model or start from scratch")
            want[key] = torch.empty(meta[key].size, dtype=meta[key].properties.dtype)
            if optimizer is not None:
                prefix = f"optim.{fqn}."
                keys = [k[len(prefix):] for k in meta if k.startswith(prefix)]
                opt_keys[fqn] = keys
                for k in keys:
                    m = meta[prefix + k]
                    want[prefix + k] = torch.empty(m.size, dtype=m.properties.dtype)
    dcp.load(want, checkpoint_id=path)
    with torch.no_grad():
        for s in stage.stores:
            s.load_full(_local_buffer(s, stage, lambda fqn: want[f"model.{fqn}"]))
            if optimizer is None:
                continue
            keys = opt_keys[s.fqns[0]] if s.fqns else []
            st = {}
            for k in keys:
                first = want[f"optim.{s.fqns[0]}.{k}"]
                if first.dim() == 0:
                    st[k] = first.clone()
                else:
                    st[k] = _my_shard(s, _local_buffer(s, stage, lambda fqn: want[f"optim.{fqn}.{k}"]))
            optimizer.state[s.flat_param] = st
    if optimizer is not None:
        _restore_hparams(optimizer, marker.get("param_groups") or [])
    return int(marker["step"])


def consolidate(path: str | os.PathLike, *, optimizer: bool = False) -> dict[str, torch.Tensor]:
    """The whole checkpoint in one process, no process group needed: ``fqn -> tensor`` that
    ``original_model.load_state_dict(state, strict=False)`` accepts (tied weights appear under one
    name). With ``optimizer=True`` the keys keep their ``model.`` / ``optim.`` prefixes."""
    path = os.fspath(path)
    read_marker(path)
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
            if hasattr(m, "size") and (optimizer or k.startswith("model."))}
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(want, checkpoint_id=path, no_dist=True)
    if optimizer:
        return want
    return {k[len("model."):]: v for k, v in want.items()}


def latest(root: str | os.PathLike) -> str | None:
    """The complete checkpoint under ``root`` with the highest step (``None`` if there is none);
    interrupted saves (``*.tmp-*``, no marker) are skipped."""
    root = os.fspath(root)
    best = None
    for name in os.listdir(root) if os.path.isdir(root) else []:
        full = os.path.join(root, name)
        if ".tmp-" in name or ".old-" in name or not os.path.isfile(os.path.join(full, MARKER)):
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
    if not os.path.isdir(path):
        parent = os.path.dirname(path) or "."
        tmp = [n for n in (os.listdir(parent) if os.path.isdir(parent) else [])
               if n.startswith(os.path.basename(path) + ".tmp-")]
        hint = f" (found the interrupted save {tmp[0]!r}, which is never loaded)" if tmp else ""
        raise ConfigError(f"no checkpoint at {path!r}{hint}; pass the directory gfx.checkpoint.save wrote, "
                          "or gfx.checkpoint.latest(root) for the newest complete one")
    marker = os.path.join(path, MARKER)
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
    if data.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path!r} has format {data.get('format')!r}, expected {FORMAT!r}")
    return data


# ------------------------------------------------------------------- plan-independent state
def state_dict(dist_model, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """This rank's plan-independent entries (see the module docstring); collective over the
    layers' DP and TP groups. Every rank holding a layer returns its whole tensors."""
    stage = _stage(dist_model)
    out: dict[str, torch.Tensor] = {}
    for s in stage.stores:
        _add_whole(out, "model.", "", s, stage, s.flat_param.data)
        if optimizer is None:
            continue
        st = optimizer.state.get(s.flat_param, {})
        for k in sorted(st):
            v = st[k]
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() == 0:
                for fqn in s.fqns:
                    out[f"optim.{fqn}.{k}"] = v.detach().clone()
            elif v.shape == s.flat_param.shape:
                _add_whole(out, "optim.", f".{k}", s, stage, v.detach())
    return out


def _add_whole(out, prefix, suffix, s, stage, local: torch.Tensor) -> None:
    from .runtime.data_parallel import _gathered_copy
    from .runtime.module import _unshard

    full = local if s.mode == "none" else _gathered_copy(local, s.padded, s.dp_ranks)
    for fqn, off, shape in zip(s.fqns, s.offsets, s.shapes):
        t = full[off:off + math.prod(shape)].view(shape)
        if fqn in stage._tp_shards:
            info, ranks = stage._tp_shards[fqn]
            t = _unshard(t, info, ranks)
        out[f"{prefix}{fqn}{suffix}"] = t.detach().clone()


def _local_buffer(s, stage, whole_of) -> torch.Tensor:
    """The layer's padded flat buffer on this rank (TP-local slices) from whole tensors."""
    from .sharding import shard_tensor

    buf = torch.zeros(s.padded, dtype=s.flat_param.dtype)
    for fqn, off, shape in zip(s.fqns, s.offsets, s.shapes):
        t = whole_of(fqn)
        if fqn in stage._tp_shards:
            info, ranks = stage._tp_shards[fqn]
            t = shard_tensor(t, info, ranks.index(stage.rank))
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"checkpoint parameter {fqn!r} has shape {tuple(t.shape)}, this model needs "
                              f"{tuple(shape)} (per rank); it was saved for a different model configuration")
        buf[off:off + t.numel()].copy_(t.reshape(-1))
    return buf.to(s.flat_param.device)


def _my_shard(s, full: torch.Tensor) -> torch.Tensor:
    if s.mode == "none":
        return full
    lo = s.dp_index * s.shard_numel
    return full[lo:lo + s.shard_numel].clone()


def _stage(dist_model):
    """The :class:`~.runtime.module.DistributedModel` of this rank (a pipeline's stage)."""
    from .runtime.module import DistributedModel

    stage = getattr(dist_model, "stage", dist_model)
    if not isinstance(stage, DistributedModel):
        raise ConfigError("gfx.checkpoint needs the module gfx.transform returned, "
                          f"got {type(dist_model).__name__}")
    return stage


def _write_marker(tmp: str, dist_model, optimizer, step: int) -> None:
    plan = dist_model.plan
    groups = []
    for g in (optimizer.param_groups if optimizer is not None else []):
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                       if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))})
    data = {"format": FORMAT, "step": int(step), "world_size": dist.get_world_size(), "time": time.time(),
            "plan": {"pp": plan.pp, "micro_batches": plan.micro_batches,
                     "layers": [[lp.tp, lp.dp, lp.sdp] for lp in plan.layers]},
            "param_groups": groups}
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _restore_hparams(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    """Saved hyper-parameters (lr after a scheduler, betas, ...) into every param group: the model's
    parameters are flat per layer, so all groups share one set (see ``DistributedModel.optimizer``)."""
    if not saved:
        return
    for g in optimizer.param_groups:
        for k, v in saved[0].items():
            if k in g:
                g[k] = tuple(v) if isinstance(g[k], tuple) else v
