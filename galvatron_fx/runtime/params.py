"""The parameters a user sees: one per original parameter, under its original name.

A distributed model keeps each layer's parameters in flat buffers (:mod:`.data_parallel`: one for
the trainable parameters, one for the frozen ones). The user sees every original parameter as a
:class:`ShardedParameter`: an ``nn.Parameter`` whose data is a *view* of this rank's part of it in
its buffer, with the original ``requires_grad``:

=====================  ===========================================================================
layer's ``sdp``        this rank's part (``p.shape``)
=====================  ===========================================================================
``"none"``             the whole TP-local parameter (TP slice, or the whole parameter at tp = 1)
``"zero2"/"zero3"``    its held dim-0 rows of the TP-local parameter (FSDP2's ``Shard(0)``; may be 0
                       rows; a 0-D or 1-D parameter: its held elements)
=====================  ===========================================================================

After a step's backward, ``p.grad`` is a :class:`ShardedGrad`: the same view of the gradient buffer.
So an optimizer over ``dist_model.parameters()`` (any ``torch.optim`` class: for-loop, foreach or
fused) updates the buffers in place, param groups built from ``named_parameters()`` address single
parameters, frozen ones never get a gradient or an optimizer state, and
``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` return the single-device norm: the
gradients route the norm functions to :mod:`.grad_norm`, which reduces over the ranks holding the
pieces (a parameter's own ``p.norm()`` is its part's; ``p.full_tensor()`` is the whole).
``p.spec`` (:class:`ParamSpec`) says where the part sits; ``p.full_tensor()`` gathers the whole
parameter (collective over its TP and DP groups); ``p.to_local()`` is the part as a plain tensor.
``dist_model.state_dict()`` holds a :class:`ShardedEntry` per parameter (its global shape, this
rank's pieces; DCP's checkpointable hooks), so ``torch.distributed.checkpoint.save`` /
``load`` of it work as for FSDP2's DTensors, across plans.

Under ``torch.compile(backend="galvatron")`` the user's own ``nn.Parameter`` objects become these:
their class changes in place (a Python subclass of ``nn.Parameter``; the optimizer built before
compiling keeps holding the same objects) and ``.data`` is re-pointed at the view.

NOTE: why not DTensor (FSDP2's choice, which this follows wherever it can). (1) Layers have
their own (dp, tp) groups, so their parameters would live on different device meshes, and DTensor
refuses ``torch.stack`` of norms from different meshes, which ``clip_grad_norm_`` does. (2) TP shards
fused q/k/v per block (a rank holds a chunk of each of q, k and v), which no ``Placement``
describes for unequal blocks (GQA). (3) Under torch.compile the user's parameter objects must stay
the same objects, and a plain ``Parameter`` cannot become a DTensor in place. (4) DTensor's
per-op dispatch in the optimizer step. The price: ``p.shape`` is the local part's (as for FSDP1's
``use_orig_params`` views; ``p.spec.global_shape`` is the whole), and reductions other than the
norms are local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .chunked_tensor import ChunkedTensor
from .chunks import Piece, layer_pieces, piece_view
from .grad_norm import HANDLERS, total_norm


@dataclass(eq=False)
class ParamSpec:
    """Where one original parameter sits on this rank.

    ``store`` is the :class:`~.data_parallel.FlatParams` holding it (``index``: its position
    there), ``shard`` its TP ``ShardInfo`` (``None``: TP keeps it whole), ``global_shape`` its
    original shape, ``slot`` its position among the whole model's parameters (every stage's: the
    norm reduction's vector), ``registry`` the :class:`ParamRegistry` it belongs to.
    """

    fqn: str
    store: Any
    index: int
    shard: Any
    global_shape: tuple[int, ...]
    slot: int
    registry: ParamRegistry = field(repr=False)

    def __post_init__(self):
        # NOTE: cached, the gradient views are cut every step
        self.span = self.store.shard_span(self.index)
        self.local_shape = self.store.local_shape(self.index)

    @property
    def trainable(self) -> bool:
        return self.store.trainable

    @property
    def tp_index(self) -> int:
        return self.store.tp_ranks.index(self.registry.rank)

    @property
    def owner(self) -> bool:
        """Whether this rank's part counts in sums over ranks (one replica of every element: the
        first DP rank of an ``sdp="none"`` layer, the first TP rank of a parameter TP keeps whole,
        the first shard group under HSDP)."""
        s = self.store
        return ((s.mode != "none" or s.dp_index == 0) and (self.shard is not None or self.tp_index == 0)
                and s.replica_ranks.index(self.registry.rank) == 0)

    def local(self) -> torch.Tensor:
        """This rank's part of the parameter: a view of its flat buffer."""
        lo, hi = self.span
        return self.store.flat_param.data[lo:hi].view(self.local_shape)

    def grad(self) -> torch.Tensor | None:
        """This rank's part of the gradient (a view of the buffer's), ``None`` when there is none."""
        g = self.store.flat_param.grad
        if g is None:
            return None
        lo, hi = self.span
        return g[lo:hi].view(self.local_shape)

    def pieces(self, owned: bool, max_numel: int | None = None) -> list[Piece]:
        """Boxes of the global parameter this rank's part holds (``owned``: only those it writes in a
        checkpoint, each element by exactly one rank; :mod:`.chunks`), located in the part seen as
        a flat tensor (:meth:`view`)."""
        s, i = self.store, self.index
        w = s.layout.row[i]
        a, b = s.layout.held_rows(i, s.dp_index)
        if owned and s.replica_ranks.index(self.registry.rank) > 0:
            span = (0, 0, 0)                       # HSDP: the first shard group writes the shards
        elif s.mode != "none":
            span = (a * w, b * w, -a * w)          # the part starts at row a of the TP-local slice
        elif owned:
            span = (a * w, b * w, 0)               # DP replicas split the writing by dim-0 rows
        else:
            span = (0, math.prod(s.shapes[i]), 0)
        shards = {self.fqn: self.shard} if self.shard is not None else {}
        replicated = not owned or self.tp_index == 0
        return layer_pieces([self.fqn], [s.shapes[i]], [span], shards, replicated=replicated,
                            max_numel=max_numel)[self.fqn]

    @staticmethod
    def view(part: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The elements of ``piece`` in ``part`` (this rank's part, or an optimizer state shaped alike)."""
        return piece_view(part.reshape(-1), piece)


class _Sharded:
    """What both classes share: the spec, the local part, the whole tensor."""

    _gfx: ParamSpec

    @property
    def spec(self) -> ParamSpec:
        return self._gfx

    def to_local(self) -> torch.Tensor:
        """This rank's part as a plain tensor (a view: writes reach the buffer)."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.detach()

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter (or gradient), gathered over its DP and TP groups (collective: every
        rank of the layer's groups calls it)."""
        return gather_full(self._gfx, self.to_local())


class ShardedParameter(_Sharded, nn.Parameter):
    """An original parameter on this rank (module docstring). Created from its :class:`ParamSpec`.

    NOTE: no ``__torch_function__`` of its own (``nn.Parameter``'s disabled one, which torch skips
    at C speed): the optimizer's per-parameter ops cost what they cost on a plain ``Parameter``
    (a Python ``__torch_function__`` made AdamW's step 1.4x slower on gpt-tiny's 69 tensors). Its
    gradient routes the norms; a parameter's own reductions (``p.norm()``) are its part's: use
    :meth:`full_tensor` for the whole one's."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, spec: ParamSpec):
        t = torch.Tensor._make_subclass(cls, spec.local(), spec.trainable)
        t._gfx = spec
        return t

    def __init__(self, *args, **kwargs):   # nn.Parameter has no __init__ work to do
        pass

    def __repr__(self) -> str:
        s = self._gfx
        return (f"ShardedParameter({s.fqn!r}, global_shape={tuple(s.global_shape)}, local_shape="
                f"{tuple(self.shape)}, sdp={s.store.mode!r}, requires_grad={self.requires_grad})")

    def __deepcopy__(self, memo):
        return nn.Parameter(self.to_local().clone(memory_format=torch.preserve_format), self.requires_grad)


def _swap_contents(param: nn.Parameter, new: torch.Tensor) -> None:
    """Give ``param`` (the user's, same Python object) the contents and class of ``new``:
    :func:`torch.utils.swap_tensors` without its refusal of weak references (dynamo keeps some to
    the parameters it traced; its guards on them are removed, galvatron_fx/backend/binding.py)."""
    for name in ("__class__", "__dict__"):
        old = getattr(param, name)
        setattr(param, name, getattr(new, name))
        setattr(new, name, old)
    torch._C._swap_tensor_impl(param, new)


class ShardedEntry(torch.Tensor):
    """A ``state_dict()`` entry: parameter ``p`` as a tensor of its *global* shape that holds this
    rank's pieces of it (what DTensor is in FSDP2's state dicts). It implements DCP's checkpointable
    hooks, so ``dcp.save(dist_model.state_dict(), ...)`` writes each element once (its owner rank)
    and ``dcp.load`` into it writes this rank's pieces straight into the parameter, from a
    checkpoint of any plan. Any other op raises: use :meth:`to_local`, :meth:`full_tensor` or
    ``dist_model.full_state_dict()``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, param: ShardedParameter):
        t = torch.Tensor._make_wrapper_subclass(cls, param._gfx.global_shape, dtype=param.dtype,
                                                device=param.device, requires_grad=False)
        t._param = param
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]
        raise ConfigError(f"{func}: a sharded state-dict entry holds only this rank's pieces of the parameter; "
                          "use .to_local(), .full_tensor() or dist_model.full_state_dict()")

    def __repr__(self) -> str:
        s = self._param._gfx
        return f"ShardedEntry({s.fqn!r}, global_shape={tuple(s.global_shape)}, local_shape={tuple(self._param.shape)})"

    def to_local(self) -> torch.Tensor:
        return self._param.to_local()

    def full_tensor(self) -> torch.Tensor:
        return self._param.full_tensor()

    # DCP's checkpointable hooks (torch.distributed.checkpoint.planner_helpers / utils)
    def __create_write_items__(self, fqn: str, _obj):
        return _chunked(self._param, owned=True).__create_write_items__(fqn, _obj)

    def __create_chunk_list__(self):
        return _chunked(self._param, owned=False).__create_chunk_list__()

    def __get_tensor_shard__(self, index):
        spec, part = self._param._gfx, self._param.to_local()
        for piece in spec.pieces(owned=False) + spec.pieces(owned=True):
            if tuple(piece.global_offsets) == tuple(index.offset):
                return ParamSpec.view(part, piece)
        raise ValueError(f"{spec.fqn}: no piece at offsets {tuple(index.offset)} on this rank")


class ShardedGrad(_Sharded, torch.Tensor):
    """This rank's part of a parameter's gradient (module docstring): the norm functions
    (:data:`~.grad_norm.HANDLERS`) give the whole gradient's norm, every other op runs on the part."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @staticmethod
    def wrap(t: torch.Tensor, spec: ParamSpec) -> ShardedGrad:
        g = torch.Tensor._make_subclass(ShardedGrad, t)
        g._gfx = spec
        return g


def _chunked(p: ShardedParameter, owned: bool) -> ChunkedTensor:
    spec = p._gfx
    return chunked(spec.global_shape, p.to_local(), spec.pieces(owned))


def chunked(global_shape, part: torch.Tensor, pieces, copy: bool = False) -> ChunkedTensor:
    """The :class:`ChunkedTensor` of ``pieces`` (:meth:`ParamSpec.pieces`) of ``part``, a
    parameter's local part or an optimizer state shaped alike: views of it, or with ``copy`` host
    copies (an asynchronous save's staging)."""
    views = []
    for pc in pieces:
        v = ParamSpec.view(part, pc)
        views.append((pc.global_offsets, v.to("cpu", copy=True) if copy else v))
    return ChunkedTensor(global_shape, part.dtype, views)


def _register_foreach() -> None:
    """Let torch's optimizers and ``clip_grad_norm_`` take their foreach paths on these classes
    (as DTensor registers itself)."""
    from torch.optim import optimizer as optim_mod
    from torch.utils import _foreach_utils

    for types in (optim_mod._foreach_supported_types, _foreach_utils._foreach_supported_types):
        for cls in (ShardedParameter, ShardedGrad):
            if cls not in types:
                types.append(cls)


_register_foreach()


def gather_full(spec: ParamSpec, part: torch.Tensor) -> torch.Tensor:
    """The whole parameter from every rank's ``part`` (collective over the store's DP group, then
    the TP group when TP shards it)."""
    from ..sharding import unshard
    from .groups import all_gather_single, group

    s, i = spec.store, spec.index
    shape = tuple(s.shapes[i])
    part = part.detach().to(s.device)   # an offloaded part lives in host memory: collectives run on the device
    if s.mode != "none" and s.dp > 1:
        rows, per = s.layout.rows[i], s.layout.per_rank[i]
        row_shape = tuple(shape[1:]) if len(shape) > 1 else ()
        padded = part.new_zeros((per, *row_shape))
        padded[:part.shape[0]].copy_(part)
        flat = part.new_empty(s.dp * padded.numel())
        all_gather_single(flat, padded.reshape(-1), group=group(s.dp_ranks))
        part = flat.view(s.dp * per, *row_shape)[:rows]
    tp_local = part.reshape(shape)
    if spec.shard is None or len(s.tp_ranks) == 1:
        return tp_local.clone()
    flat = tp_local.new_empty(len(s.tp_ranks) * tp_local.numel())
    all_gather_single(flat, tp_local.contiguous().reshape(-1), group=group(s.tp_ranks))
    return unshard([c.view(shape) for c in flat.chunk(len(s.tp_ranks))], spec.shard)


class ParamRegistry:
    """This rank's user-facing parameters of one distributed model, in the model's order.

    ``params``: fqn -> :class:`ShardedParameter` (new objects, or the user's own under
    torch.compile); ``slots``: the number of parameters of the whole model (every stage's) and
    ``pipelined``: whether other ranks hold parameters this one does not (other stages', other EP
    ranks' experts of a loop; see :mod:`.grad_norm`).
    """

    def __init__(self, rank: int, slots: int, pipelined: bool, device: torch.device,
                 stage_ranks: tuple[int, ...] = ()):
        self.rank, self.slots, self.pipelined, self.device = rank, slots, pipelined, device
        self.stage_ranks = tuple(stage_ranks)
        self.params: dict[str, ShardedParameter] = {}
        self.elsewhere: set[str] = set()   # parameters other ranks of this stage hold (a loop's other experts)
        self._trainable: list | None = None   # attach_grads' per-parameter spans, built on first use
        self._trainable_stores: list = []      # and the buffers holding them

    def stage_group(self) -> tuple[bool, Any]:
        """``(whether this rank's pipeline stage has other ranks, its process group)`` (``None``:
        the world, when there is one stage)."""
        from .groups import group

        if not self.pipelined:
            return True, None
        return len(self.stage_ranks) > 1, group(self.stage_ranks)

    def add(self, spec: ParamSpec, param: nn.Parameter | None = None) -> ShardedParameter:
        """Expose ``spec``: a new :class:`ShardedParameter`, or ``param`` (the user's) turned into one."""
        if param is None:
            param = ShardedParameter(spec)
        elif param.device != spec.local().device:   # a meta-device model: ``.data`` cannot change device
            _swap_contents(param, ShardedParameter(spec))
        else:
            with torch.no_grad():
                param.data = spec.local()
            param.__class__ = ShardedParameter   # NOTE: same object: the user's optimizer holds it
            param._gfx = spec
        self.params[spec.fqn] = param
        return param

    def named(self):
        return iter(self.params.items())

    def check_requires_grad(self) -> None:
        """Raise when a parameter's ``requires_grad`` no longer matches the buffers built for it."""
        for fqn, p in self.params.items():
            if p.requires_grad != p._gfx.trainable:
                was = "trainable" if p._gfx.trainable else "frozen"
                raise ConfigError(
                    f"parameter {fqn!r} was {was} when the model was transformed and its requires_grad is now "
                    f"{p.requires_grad}; set requires_grad before gfx.capture / torch.compile (the plan and "
                    "the buffers depend on it) and transform again")

    def attach_grads(self, scale: torch.Tensor | None = None) -> None:
        """Give each trainable parameter its gradient view (``None`` when its buffer has none: a
        skipped fp16 step). ``scale``: multiply the gradients in place first and *add* to a
        gradient the parameter holds already (a ``loss.backward(g)`` under torch.compile)."""
        if self._trainable is None:
            self._trainable = [(p, p._gfx, p._gfx.store, p._gfx.span[0], p._gfx.local_shape,
                                torch.empty(p._gfx.local_shape, device="meta").stride())
                               for p in self.params.values() if p._gfx.trainable]
            self._trainable_stores = list({id(s): s for _p, _s, s, *_ in self._trainable}.values())
        wrap = ShardedGrad.wrap
        if scale is not None:   # NOTE: one op per buffer, not one per parameter (~50 ops on gpt-tiny)
            for store in self._trainable_stores:
                if store.flat_param.grad is not None:
                    store.flat_param.grad.mul_(scale)
        for p, spec, store, lo, shape, stride in self._trainable:
            flat = store.flat_param.grad
            if flat is None:
                p.grad = None
                continue
            g = flat.as_strided(shape, stride, flat.storage_offset() + lo)   # NOTE: cheaper than flat[lo:hi].view
            if scale is not None:
                if p.grad is not None and p.grad.shape == g.shape:
                    p.grad.add_(g)
                    continue
            p.grad = wrap(g, spec)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip every trainable parameter's gradient by the total norm over the whole model (all
        stages); returns that norm (collective over the world)."""
        params = [p for p in self.params.values() if p.grad is not None]
        total = total_norm(self, [p.grad for p in params], norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot "
                               "be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(params[0].device), foreach=foreach)
        return total

    # ---------------------------------------------------------------- state dicts
    def load_whole(self, state: dict[str, torch.Tensor], strict: bool = True):
        """Copy this rank's part of each whole tensor of ``state`` (original names and shapes: a
        ``full_state_dict()``, a consolidated checkpoint, a pretrained model's ``state_dict()``)
        into its parameter. Returns ``(missing, unexpected)`` fqns; raises on a shape mismatch."""
        missing = [f for f in self.params if f not in state]
        unexpected = [k for k in state if k not in self.params and k not in self.elsewhere]
        if strict and (missing or unexpected):
            raise ConfigError(f"load_state_dict: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                              f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        for fqn, p in self.params.items():
            value = state.get(fqn)
            if value is None or value is p or getattr(value, "_param", None) is p:
                continue   # absent, or loaded in place (dcp.load into the state_dict() entries)
            if isinstance(value, (_Sharded, ShardedEntry)):
                value = value.full_tensor()
            self.load_one(fqn, value)
        return missing, unexpected

    @torch.no_grad()
    def load_one(self, fqn: str, value) -> None:
        """Copy this rank's part of parameter ``fqn`` from ``value``: its whole tensor, or anything
        indexable by a tuple of slices into it (a safetensors slice reads only those bytes)."""
        p = self.params[fqn]
        spec = p._gfx
        shape = tuple(value.shape) if hasattr(value, "shape") else tuple(value.get_shape())
        if shape != tuple(spec.global_shape):
            raise ConfigError(f"load_state_dict: {fqn!r} has shape {shape}, the model's is {tuple(spec.global_shape)}")
        part = p.to_local()
        for pc in spec.pieces(owned=False):
            box = tuple(slice(o, o + n) for o, n in zip(pc.global_offsets, pc.sizes))
            src = value[box] if box else value[...]
            ParamSpec.view(part, pc).copy_(torch.as_tensor(src).to(part.dtype))

