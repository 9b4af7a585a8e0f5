"""Shard-only materialisation: a model built on the meta device gets this rank's parts, nothing more.

``gfx.transform`` of a graph captured from a meta-device model gives flat buffers on this process's
device with no values (:class:`~.data_parallel.FlatParams` ``initialized=False``); ``train_step``
refuses them until one of these fills them:

* :func:`init_weights` (``dist_model.init_weights()``): the model's own initialiser, one module at a
  time: each module's parameters are created on the CPU (the module's only), initialised
  (transformers' ``_init_weights`` in its own traversal, ``initialize_weights``; else each module's
  ``reset_parameters``, or ``fn(module)``), this rank's pieces copied into its buffers, and dropped
  again (tied parameters live until the end, so their second owner skips them as transformers
  does). The random stream is consumed exactly as by ``torch.manual_seed(seed);
  model.initialize_weights()`` on one CPU (``reset_parameters`` in module order otherwise), so every
  plan starts from the same full weights as one device would. Memory: the largest module's
  parameters, transiently.
* :func:`load_pretrained` (``dist_model.load_pretrained(DIR)``): a ``save_pretrained`` directory's
  safetensors (one file or an index of shards), each rank reading only the bytes of its pieces.
* ``dist_model.load_state_dict(whole tensors)`` and ``gfx.checkpoint.load`` (sharded DCP) too.

Under ``torch.compile(backend="galvatron")`` the option ``init`` runs the first two after the
compile (``"weights"``, or a directory); the model's own parameters, bound to the program's
buffers, get their values in place.

Buffers (rotary frequencies, position ids) are small and whole: meta buffers of the model are
materialised on the CPU (transformers' initialiser computes rotary ones), copied into the program,
and any buffer still on the meta device afterwards is named in one error.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..errors import ConfigError
from .hf_conversion import conversions, load_converted


def _stage(dist_model):
    return getattr(dist_model, "stage", dist_model)


def _hf_models(model: nn.Module) -> list:
    """The transformers ``PreTrainedModel`` s in ``model`` (the root first), if any."""
    try:
        from transformers import PreTrainedModel
    except ImportError:   # pragma: no cover - transformers is optional
        return []
    return [m for m in model.modules() if isinstance(m, PreTrainedModel)]


class _OneModuleAtATime:
    """Materialise a module's own meta parameters / buffers on the CPU, then hand the parameters'
    values to the registry and drop them (tied parameters kept until :meth:`close`)."""

    def __init__(self, model: nn.Module, registry):
        self.registry = registry
        # NOTE: under torch.compile the model's own parameters are the registry's (bound in place:
        # galvatron_fx/backend/binding.py), views of buffers with no values yet, not meta tensors
        self.bound = {id(p) for p in registry.params.values()}
        self.names: dict[int, list[str]] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(fqn)
        self.buffer_names: dict[int, str] = {}
        for fqn, b in model.named_buffers(remove_duplicate=False):
            self.buffer_names.setdefault(id(b), fqn)
        self.real: dict[int, torch.Tensor] = {}      # id(meta tensor) -> its CPU tensor, while needed
        self.kept: list[tuple] = []                  # tied parameters' (table, name, meta) until close_all
        self.buffers: dict[str, torch.Tensor] = {}   # buffer fqn -> its value, kept (small)

    def open(self, module: nn.Module) -> list[tuple]:
        opened = []
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in list(table.items()):
                if t is None or (t.device.type != "meta" and id(t) not in self.bound):
                    continue
                real = self.real.get(id(t))
                if real is None:
                    shape = t._gfx.global_shape if id(t) in self.bound else t.shape
                    real = torch.empty(tuple(shape), dtype=t.dtype, device="cpu")
                    if kind == "param":
                        real = nn.Parameter(real, requires_grad=t.requires_grad)
                    self.real[id(t)] = real
                table[name] = real
                opened.append((table, name, t, kind))
        return opened

    def close(self, opened: list[tuple], final: bool = False) -> None:
        for table, name, meta, kind in opened:
            real = table[name]
            if kind == "buffer":
                self.buffers[self.buffer_names.get(id(meta), name)] = real.detach()
                table[name] = meta
                continue
            for fqn in self.names.get(id(meta), []):
                if fqn in self.registry.params:
                    self.registry.load_one(fqn, real.detach())
            if final or len(self.names.get(id(meta), [])) <= 1:
                table[name] = meta              # back to the meta device: the memory is released
                self.real.pop(id(meta), None)
            else:
                self.kept.append((table, name, meta, kind))   # a tied parameter: its other owner reads it

    def close_all(self) -> None:
        kept, self.kept = self.kept, []
        for table, name, meta, _kind in kept:
            table[name] = meta
            self.real.pop(id(meta), None)


@torch.no_grad()
def init_weights(dist_model, model: nn.Module, fn=None, seed: int | None = None) -> None:
    """Initialise this rank's parts of ``model``'s parameters (module docstring); ``model`` is the
    meta-device model the graph was captured from."""
    stage = _stage(dist_model)
    if seed is not None:
        torch.manual_seed(seed)
    work = _OneModuleAtATime(model, stage.params)
    hf = _hf_models(model) if fn is None else []
    if hf:
        patched = []
        for m in hf:
            original = m._init_weights

            def wrapped(module, original=original):
                opened = work.open(module)
                original(module)
                work.close(opened)

            m._init_weights = wrapped      # NOTE: an instance attribute: initialize_weights calls it
            patched.append(m)
        for t in [*model.modules(), *model.parameters()]:   # a fresh traversal, as on a newly built model
            t.__dict__.pop("_is_hf_initialized", None)
        try:
            hf[0].initialize_weights()
        finally:
            for m in patched:
                del m._init_weights
    else:
        for module in model.modules():
            opened = work.open(module)
            init = fn or getattr(module, "reset_parameters", None)
            if opened and callable(init):
                init(module) if fn is not None else init()
            work.close(opened)
    work.close_all()
    _finish(stage, model, work.buffers)


def load_pretrained(dist_model, model: nn.Module, directory: str) -> None:
    """Load this rank's pieces of every parameter from a ``save_pretrained`` directory's safetensors
    (module docstring); a tied parameter missing from the files is read under its other name."""
    from safetensors import safe_open

    stage = _stage(dist_model)
    files = _safetensors_files(directory)
    where: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                where[key] = path
    aliases: dict[str, list[str]] = {}
    seen: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        first = seen.setdefault(id(p), fqn)
        aliases.setdefault(first, []).append(fqn)
    missing = []
    renamed = converted = None

    def read(key):
        with safe_open(where[key], framework="pt", device="cpu") as f:
            return f.get_tensor(key)
    for fqn in stage.params.params:
        names = aliases.get(fqn, [fqn])
        key = next((k for k in names if k in where), None)
        if key is None:   # saved under another name or in pieces (transformers' MoE experts)
            if converted is None:
                renamed, converted = conversions(model, where)
            key = next((renamed[k] for k in names if k in renamed), None)
            entry = next((converted[k] for k in names if k in converted), None)
            if entry is not None:
                stage.params.load_one(fqn, load_converted(entry, read, model))
                continue
        if key is None:
            missing.append(fqn)
            continue
        with safe_open(where[key], framework="pt", device="cpu") as f:
            stage.params.load_one(fqn, f.get_slice(key))
    if missing:
        raise ConfigError(f"{directory}: no tensor for {missing[:5]}{'...' if len(missing) > 5 else ''}; it was "
                          "saved from another model")
    buffers = {}
    if any(b.device.type == "meta" for b in model.buffers()):
        work = _OneModuleAtATime(model, stage.params)
        hf = _hf_models(model)
        for module in model.modules():   # rotary frequencies: the initialiser computes them (no RNG)
            if any(b is not None and b.device.type == "meta" for b in module._buffers.values()) and hf:
                opened = work.open(module)
                hf[0]._init_weights(module)
                work.close(opened, final=True)
        buffers = work.buffers
    _finish(stage, model, buffers)


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, s) for s in shards]
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ConfigError(f"{directory}: no model.safetensors (or model.safetensors.index.json); pass a "
                      "save_pretrained directory")


def _finish(stage, model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Put the materialised buffers into the program, mark the buffers initialised, rebuild the
    working copies (collective for ZeRO-2), and name any buffer still on the meta device."""
    device = next((s.device for s in stage.stores), torch.device("cpu"))
    for layer in stage.children():
        for name, buf in list(layer.named_buffers()):
            if buf.device.type == "meta" and name in buffers:
                owner = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
                owner._buffers[name.rpartition(".")[2]] = buffers[name].to(device)
    for s in stage.stores:
        s.initialized = True
        s.masters_changed()
    stage.sync_params()
    check_materialized(stage)


def check_materialized(stage) -> None:
    """Raise naming the fix when parameters have no values yet or a buffer is on the meta device."""
    if not all(getattr(s, "initialized", True) for s in stage.stores):
        raise ConfigError("the model was captured on the meta device and its parameters have no values yet: call "
                          "dist_model.init_weights(), dist_model.load_pretrained(DIR), load_state_dict(...) or "
                          "gfx.checkpoint.load(...) first (torch.compile: options={'init': 'weights'} or "
                          "{'init': DIR})")
    left = [f"{layer_name}.{name}" for layer_name, layer in stage.named_children()
            for name, buf in layer.named_buffers() if buf.device.type == "meta"]
    if left:
        raise ConfigError(f"buffer(s) {left[:3]} are on the meta device and no initialiser computes them: build the "
                          "model with only its parameters on meta (accelerate.init_empty_weights() or "
                          "torch.nn.utils.skip_init) so that its buffers keep their values")
