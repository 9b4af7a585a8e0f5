"""Capture front ends: a model becomes one normalised, annotated torch.fx.GraphModule.

Three doors lead in (``method``):

* ``"fx"``: :func:`torch.fx.symbolic_trace` semantics with no leaf modules, so every parameter is a
  ``get_attr`` node and every op a ``call_function``;
* ``"dynamo"``: the graph ``torch.compile`` hands a backend (parameters and buffers arrive as
  placeholders; modules are inlined; ``nn_module_stack`` in ``node.meta``);
* ``"export"``: :func:`torch.export.export` (non-strict), unlifted so parameters are ``get_attr``.

Whatever the door, the result is the same shape (see :mod:`galvatron_fx.ir`): parameters and
buffers are ``get_attr`` nodes whose targets are their fully qualified names in the original model
and which hold the *original* parameter objects; the graph's placeholders are the tensor leaves of
``(args, kwargs)`` in order (non-tensor arguments are baked in as constants); the output is the
flattened tensor leaves of the model output (a single tensor is returned bare); every node carries
``node.meta["val"]`` (a fake tensor) and ``node.meta["galvatron"]``; ``gm.meta["galvatron"]`` holds
the layer list.
"""

from __future__ import annotations

import inspect
import logging
import traceback
import warnings
import weakref

import torch
import torch.fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .batch_symbol import batch_positions
from .errors import CaptureError, ConfigError
from .hf_capture import hf_capture
from .ir import META_KEY, GraphInfo

METHODS = ("dynamo", "export", "fx")
SYMBOLIC_METHODS = ("dynamo", "export")
"""Front ends that capture the batch as a symbol (:mod:`galvatron_fx.batch_symbol`); fx graphs
read sizes at run time anyway."""
WRAPPED = "inner"  # attribute under which the flattening wrapper holds the user's model


class _FlatInputs(nn.Module):
    """Calls ``inner(*args, **kwargs)`` from the tensor leaves of ``(args, kwargs)``.

    Every front end sees the same signature (one named tensor argument per leaf) and the same
    flattened output, so the graphs they produce can be normalised alike.
    """

    def __init__(self, inner: nn.Module, leaves: list, spec: pytree.TreeSpec, tensor_pos: list[int]):
        super().__init__()
        self.inner = inner
        self._leaves = leaves
        self._spec = spec
        self._tensor_pos = tensor_pos

    def _call(self, *tensors):
        leaves = list(self._leaves)
        for pos, t in zip(self._tensor_pos, tensors):
            leaves[pos] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out = self.inner(*args, **kwargs)
        flat = [x for x in pytree.tree_leaves(out) if isinstance(x, (torch.Tensor, torch.fx.Proxy))]
        return flat[0] if len(flat) == 1 else tuple(flat)


def input_names(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec, list[int], list[str]]:
    """Flatten ``(args, kwargs)``; name each tensor leaf after the forward() argument it came from."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    try:
        sig = inspect.signature(model.forward)
        sig.bind(*args, **kwargs)
        positional = [p for p in sig.parameters.values()
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        star = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_POSITIONAL), "args")
        k = min(len(args), len(positional))
        extra = [(star, tuple(args[k:]))] if len(args) > k else []   # *args: one group, as bound
        arg_names = [p.name for p in positional[:k]] + [n for n, _ in extra] + list(kwargs)
        bound_values = list(args[:k]) + [v for _, v in extra] + list(kwargs.values())
    except (TypeError, ValueError):
        arg_names, bound_values = [], []
    names: list[str] = []
    # NOTE: leaves named in the order pytree flattens ``(args, kwargs)``: positional arguments, then
    # the keywords *as the caller ordered them* (not the signature's order: labels=..., then
    # attention_mask=... would otherwise swap the two inputs' names)
    per_arg = [(n, pytree.tree_leaves(v)) for n, v in zip(arg_names, bound_values)]
    flat_names = []
    for n, lv in per_arg:
        flat_names += [n if len(lv) == 1 else f"{n}_{i}" for i in range(len(lv))]
    if len(flat_names) != len(leaves):
        flat_names = [f"input_{i}" for i in range(len(leaves))]
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    names = [_identifier(flat_names[i]) for i in tensor_pos]
    return leaves, spec, tensor_pos, names


def baked_inputs(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The non-tensor leaves of ``(args, kwargs)`` by forward-argument name (``return_loss=True``):
    the graph bakes them in, so a later call may repeat them but not change them."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {}
    flat = {}
    for name, value in bound.items():
        if isinstance(value, dict) and name not in kwargs:   # **kwargs
            flat.update(value)
        else:
            flat[name] = value
    return {k: v for k, v in flat.items() if isinstance(v, (bool, int, float, str, type(None)))}


def _identifier(name: str) -> str:
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return name if name and not name[0].isdigit() else f"in_{name}"


def _make_wrapper(model: nn.Module, args: tuple, kwargs: dict) -> tuple[_FlatInputs, list[torch.Tensor], list[str]]:
    leaves, spec, tensor_pos, names = input_names(model, args, kwargs)
    # A fresh subclass per capture with a generated forward(self, <name>, ...) so that fx sees
    # named placeholders and dynamo compiles a new code object (no stale cache entries).
    params = ", ".join(names)
    namespace: dict = {}
    exec(f"def forward(self, {params}):\n    return self._call({params}{',' if len(names) == 1 else ''})\n",
         namespace)
    cls = type("FlatInputs", (_FlatInputs,), {"forward": namespace["forward"]})
    wrapper = cls(model, leaves, spec, tensor_pos)
    return wrapper, _dense([leaves[i] for i in tensor_pos]), names


class _NoLeafTracer(torch.fx.Tracer):
    """Traces through every module so parameters become get_attr nodes (no call_module)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return False


def _trace_fx(wrapper: nn.Module, inputs: list[torch.Tensor], batched: list[int]):
    graph = _NoLeafTracer().trace(wrapper)
    return torch.fx.GraphModule(wrapper, graph), {}


class _Captured(Exception):
    """Raised by the capturing backend so dynamo does not run the graph it just handed us."""


def _trace_dynamo(wrapper: nn.Module, inputs: list[torch.Tensor], batched: list[int]):
    box: dict = {}
    for i in batched:   # NOTE: on aliases made by capture(): the user's tensors stay unmarked
        torch._dynamo.mark_dynamic(inputs[i], 0)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        box["gm"], box["inputs"] = gm, list(example_inputs)

        def stop(*_args):
            raise _Captured

        return stop

    compiled = torch.compile(wrapper, backend=backend, fullgraph=True, dynamic=None if batched else False)
    # NOTE: logging calls inside a model (e.g. transformers' warning_once) would otherwise break
    # the graph under fullgraph=True; during capture they are dropped, as torch.export does.
    quiet = set(torch._dynamo.config.ignore_logging_functions) | _logger_methods()
    try:
        # NOTE: only the marked batch dims are symbolic: module attributes (eps, head counts) stay
        # constants, and no dim turns dynamic because an earlier capture saw another size
        with torch._dynamo.config.patch(ignore_logging_functions=quiet, specialize_float=True, specialize_int=True,
                                        automatic_dynamic_shapes=False):
            compiled(*inputs)
    except _Captured:
        pass
    if "gm" not in box:
        raise CaptureError("dynamo produced no graph (was the model already compiled?)")
    gm = box["gm"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = {n.name: t for n, t in zip(placeholders, box["inputs"]) if isinstance(t, torch.Tensor)}
    return gm, sources


def _logger_methods() -> set:
    return {v for k, v in vars(logging.Logger).items() if callable(v) and not k.startswith("_")}


def _trace_export(wrapper: nn.Module, inputs: list[torch.Tensor], batched: list[int]):
    # NOTE: AUTO: a model that specialises its batch exports static (capture notes it) instead of failing
    shapes = tuple({0: torch.export.Dim.AUTO} if i in batched else None for i in range(len(inputs))) if batched else None
    ep = torch.export.export(wrapper, tuple(inputs), dynamic_shapes=shapes, strict=False)
    return ep.module(), {}


_FRONTENDS = {"fx": _trace_fx, "dynamo": _trace_dynamo, "export": _trace_export}


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch / galvatron_fx, as 'file:line in func'."""
    # dynamo records the user's stack on the exception; other tracers fail in the user's frame.
    frames = list(getattr(exc, "real_stack", None) or []) or traceback.extract_tb(exc.__traceback__)
    for f in reversed(frames):
        path = f.filename.replace("\\", "/")
        if "/torch/" not in path and "/galvatron_fx/" not in path and "<" not in path:
            return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"
    return ""


def _static_note(method: str, reason: str) -> str:
    """Warn (one line) that the batch stays baked in, and why; returns the reason."""
    warnings.warn(f"capture(method={method!r}): the batch stays baked in ({reason}); plans that split the batch "
                  "rescale its shape constants (passes/local_batch.py) and every call takes the captured batch; "
                  "another capture method may keep it symbolic", stacklevel=3)
    return reason


def _first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return next((line.strip() for line in msg if line.strip()), type(exc).__name__)


def _capture_error(method: str, exc: BaseException) -> CaptureError:
    others = [m for m in METHODS if m != method]
    first = _first_line(exc)
    where = _user_frame(exc)
    return CaptureError(
        f"capture(method={method!r}) failed: {type(exc).__name__}: {first}"
        + (f"\n  at {where}" if where else "")
        + f"\n  fix: make that code traceable, or try method={others[0]!r} or {others[1]!r}"
    )


def normalise(raw_gm: torch.fx.GraphModule, model: nn.Module, inputs: list[torch.Tensor], names: list[str],
              sources: dict[str, torch.Tensor] | None, *, method: str, prefix: str = "",
              group_layers: bool = True) -> torch.fx.GraphModule:
    """A front end's raw graph in the normalised form of the module docstring.

    Runs :class:`~galvatron_fx.passes.normalize.NormalizePass` (``model`` holds the parameters and
    buffers under their FQNs, ``prefix`` is the wrapper attribute stripped from module paths,
    ``inputs``/``names`` are the tensor inputs and their placeholder names, ``sources`` maps dynamo
    placeholder names to the tensors bound to them), then, if ``group_layers``,
    :class:`~galvatron_fx.passes.layer_grouping.LayerGroupingPass`. Shared by :func:`capture` and
    the ``"galvatron"`` torch.compile backend, so both give plans the same graph.
    """
    from .passes.layer_grouping import LayerGroupingPass
    from .passes.normalize import NormalizePass

    gm = NormalizePass(model, inputs, names, sources, method=method, prefix=prefix)(raw_gm).graph_module
    if group_layers:
        gm = LayerGroupingPass()(gm).graph_module
    return gm


def capture(model: nn.Module, example_args=(), kwargs: dict | None = None, method: str = "dynamo",
            *, group_layers: bool = True, symbolic_batch: bool = True) -> torch.fx.GraphModule:
    """Capture ``model`` called on ``example_args``/``kwargs`` as an annotated GraphModule.

    Works on real, fake-free CPU/GPU models and on models built on the meta device (nothing is
    allocated: shapes come from fake tensors). See the module docstring for the normalised form.
    Raises :class:`CaptureError` naming the method, the failing line and an alternative method.
    ``symbolic_batch`` (dynamo, export): keep dim 0 of the batched inputs a symbol
    (:mod:`galvatron_fx.batch_symbol`; ``False``: bake the example's batch in, as before).
    """
    if method not in METHODS:
        raise ConfigError(f"unknown capture method {method!r}; choose one of {', '.join(METHODS)}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"capture() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(example_args, (tuple, list)):
        example_args = (example_args,)
    args, kwargs = tuple(example_args), dict(kwargs or {})
    wrapper, inputs, names = _make_wrapper(model, args, kwargs)
    batched = batch_positions(inputs) if method in SYMBOLIC_METHODS and symbolic_batch else []
    reason = ""
    if batched:
        # NOTE: fresh tensor objects (views) carry the dynamic marks, not the user's tensors
        inputs = [t.view_as(t) if i in batched else t for i, t in enumerate(inputs)]
        try:
            with hf_capture(kwargs):
                raw, sources = _FRONTENDS[method](wrapper, inputs, batched)
        except CaptureError:   # the model refuses this capture (its own reason), batch or not
            raise
        except Exception as exc:  # noqa: BLE001 - the model specialises on its batch: capture it static
            reason = _static_note(method, _first_line(exc))
            wrapper, inputs, names = _make_wrapper(model, args, kwargs)
    if not batched or reason:
        try:
            with hf_capture(kwargs):
                raw, sources = _FRONTENDS[method](wrapper, inputs, [])
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - every tracer failure becomes one clear error
            raise _capture_error(method, exc) from exc
    gm = normalise(raw, model, inputs, names, sources, method=method, prefix=WRAPPED, group_layers=group_layers)
    if batched and not reason and not gm.meta[META_KEY].symbolic_batch:
        reason = _static_note(method, f"the model's code makes the batch a constant ({int(inputs[batched[0]].shape[0])})")
    gm.meta[META_KEY].static_batch_reason = reason
    gm.meta[META_KEY].baked_inputs = baked_inputs(model, tuple(example_args), dict(kwargs or {}))
    gm.meta[META_KEY].model_ref = weakref.ref(model)
    return gm


def _dense(inputs: list) -> list:
    """Non-contiguous input tensors (a strided slice of a batch, ``batch[i::2]``) as contiguous
    copies, a tensor passed twice copied once: dynamo makes such a stride a size input of the graph,
    which no input's shape gives; the captured program takes any layout of the same values."""
    seen: dict[int, torch.Tensor] = {}
    return [seen.setdefault(id(t), t.contiguous()) if isinstance(t, torch.Tensor) and not t.is_contiguous() else t
            for t in inputs]


def layers(gm: torch.fx.GraphModule):
    """The ordered :class:`~galvatron_fx.ir.LayerRecord` list of a captured graph.

    Runs the layer grouping pass first if ``gm`` has not been grouped yet.
    """
    from .passes.layer_grouping import LayerGroupingPass

    info = gm.meta.get(META_KEY)
    if not isinstance(info, GraphInfo) or not info.layers:
        gm = LayerGroupingPass()(gm).graph_module
        info = gm.meta[META_KEY]
    return info.layers
