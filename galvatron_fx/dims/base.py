"""The dimension protocol (:class:`Dimension`, :class:`Field`, :class:`Rule`, :class:`Admission`),
the space options the rules read, and the small checks the dimensions share."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class SpaceOptions:
    """The knobs of the strategy space (``strategy_space``'s keywords), as one value the rules and
    the fields' ``values`` read. ``more``: options of dimensions added after these, by name."""

    devices_per_stage: int
    heads: int | None = None
    hidden: int | None = None
    devices_per_node: int = 8
    allow_cross_node_tp: bool = False
    power_of_two: bool = True
    ckpt: bool | tuple = True   # False, True (every mode) or a tuple of ckpt modes
    sp: bool = True
    zero2: bool = True
    zero3: bool = True
    max_tp: int | None = None
    ep: tuple[int, ...] = (1,)
    cp: tuple[int, ...] = (1,)
    cp_kinds: tuple[str, ...] = ("ring", "ulysses")
    more: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Rule:
    """A named pruning rule: ``allows(strategy, options)`` is False when the strategy is pruned."""

    name: str
    allows: Callable[[Any, SpaceOptions], bool]
    doc: str


def rule(fn: Callable[[Any, SpaceOptions], bool]) -> Rule:
    """A :class:`Rule` named after ``fn`` (leading underscores dropped), its docstring the doc."""
    return Rule(fn.__name__.lstrip("_"), fn, (fn.__doc__ or "").strip())


@dataclass(frozen=True)
class Field:
    """One field of a strategy. ``position`` orders the fields in the strategy (its positional
    arguments and sort order), in the decision tree and in the plan JSON. ``values(options, n,
    chosen)`` lists the values the tree tries given the fields chosen so far (``n``: devices per
    stage); ``derive(n, chosen)`` computes a field the tree does not enumerate; neither: the default
    only. ``complete(strategy)``: the value of a strategy built without one (``None``), from its
    other fields (HSDP's ``shard``: ``dp``). ``check(value)`` returns what is wrong with a value, or
    ``None``. ``in_json``: written in the plan's per-layer JSON (``omit_default``: only where it
    differs from the default, so that the plans of a dimension most of them never use read as they
    did before it); ``json_required``: a plan layer without it is refused (the fields every plan had
    from the start; a later dimension's key reads as its default when absent, so
    plans written before it load unchanged)."""

    name: str
    type: type
    default: Any
    position: int
    values: Callable[[SpaceOptions, int, dict], Iterable] | None = None
    derive: Callable[[int, dict], Any] | None = None
    check: Callable[[Any], str | None] | None = None
    in_json: bool = True
    json_required: bool = False
    complete: Callable[[Any], Any] | None = None
    omit_default: bool = False


@dataclass(frozen=True)
class Admission:
    """A dimension's answer for the layers of one model: ``admits(layer, strategy)``: whether the
    layer may run the strategy; ``prefers(layer, strategy)``: among the admitted ones, whether it is
    worth offering (a TP degree that shards nothing is offered only where nothing else is)."""

    admits: Callable[[int, Any], bool] | None = None
    prefers: Callable[[int, Any], bool] | None = None


@dataclass(frozen=True)
class PassSpec:
    """A rewrite pass a dimension needs: the module ``galvatron_fx.passes.<name>`` and its class
    (``make``; default the module name in CamelCase + ``Pass``, built as ``cls(ctx)``), placed right
    after the pass ``after`` in the rewrite order; ``when(ctx)``: whether the plan needs it
    (``None``: every plan)."""

    name: str
    after: str
    when: Callable[[Any], bool] | None = None
    make: str = ""

    @property
    def class_name(self) -> str:
        return self.make or "".join(w.title() for w in self.name.split("_")) + "Pass"


@dataclass(frozen=True)
class CostTerms:
    """What a dimension adds to a layer's base cost (:meth:`galvatron_fx.cost.CostModel.layer_cost`),
    per device; added field by field. Seconds per micro-batch (``tp_comm_s``, ``gather_s``,
    ``reduce_scatter_s``, ``overhead_s``, ``split_extra_s``) or per step (``sync_s``, ``exposed_s``,
    ``regather_s``, ``optimizer_s``); bytes resident (``transient_bytes``, ``held_bytes``); bytes per
    micro-batch in flight: ``activation_bytes`` (added to what the layer keeps on the device for its
    backward; negative where a dimension moves them away) and ``host_activation_bytes`` (what it keeps
    in host memory instead, counted against the host budget per micro-batch in flight). The
    names are those of :class:`galvatron_fx.cost.records.LayerCost` (``sync_s``: ``grad_sync_s``,
    ``gather_s``: ``zero3_gather_s``, ``exposed_s``: ``exposed_sync_s``, ``held_bytes``:
    ``split_held_bytes``)."""

    tp_comm_s: float = 0.0
    sync_s: float = 0.0
    gather_s: float = 0.0
    transient_bytes: float = 0.0
    overhead_s: float = 0.0
    optimizer_s: float = 0.0
    exposed_s: float = 0.0
    regather_s: float = 0.0
    reduce_scatter_s: float = 0.0
    split_extra_s: float = 0.0
    held_bytes: float = 0.0
    activation_bytes: float = 0.0
    host_activation_bytes: float = 0.0

    def __add__(self, other: CostTerms) -> CostTerms:
        # NOTE: field by field through one attrgetter (dataclasses.astuple deep-copies: it was
        # most of layer_cost's time)
        return CostTerms(*map(operator.add, _TERMS(self), _TERMS(other)))


_TERMS = operator.attrgetter(*(f.name for f in fields(CostTerms)))


@dataclass(frozen=True)
class LayerWork:
    """What a layer's passes do on one device per micro-batch, as its cost terms read it: ``fwd`` /
    ``bwd`` device seconds (every dimension's compute terms added; ``bwd`` with its recomputation),
    ``recompute`` the seconds of ``bwd`` that recompute the forward (checkpointing), ``saved_bytes``
    the bytes its forward saves without checkpointing (what a checkpointed layer recomputes),
    ``kept_bytes`` the bytes it keeps on the device for its backward under the strategy (its
    activations, checkpointing applied)."""

    fwd: float
    bwd: float
    recompute: float = 0.0
    saved_bytes: float = 0.0
    kept_bytes: float = 0.0

    @property
    def plain_bwd(self) -> float:
        """The backward without its recomputation."""
        return self.bwd - self.recompute


@dataclass(frozen=True)
class StateSizes:
    """A layer's flat buffers on one device, as a dimension's ``states`` hook reads them
    (:func:`galvatron_fx.cost.memory.states_bytes`): ``padded`` / ``shard`` elements of the
    trainable buffer whole and of one rank's ZeRO shard, ``held`` the optimizer's elements of that
    shard (unpadded), ``k`` optimizer states per parameter, ``itemsize`` the compute dtype's bytes,
    ``frozen_bytes`` the frozen buffer's device bytes (working copy and masters)."""

    padded: int
    shard: int
    held: int
    k: int
    itemsize: int
    frozen_bytes: int


@dataclass(frozen=True)
class Dimension:
    """One per-layer parallel dimension (module docstring)."""

    name: str
    fields: tuple[Field, ...]
    rules: tuple[Rule, ...] = ()
    admission: Callable[[Any, Mapping], Admission] | None = None
    label: Callable[[Any], list[tuple[int, str]]] | None = None
    explain: Callable[[list], list[str]] | None = None
    passes: tuple[PassSpec, ...] = ()
    runtime: tuple[str, ...] = ()
    properties: Mapping[str, property] = field(default_factory=dict)
    checks: tuple[Callable[[Any], str | None], ...] = ()
    compute_terms: Callable[[Any, int, float, Any], tuple[float, float]] | None = None
    cost_terms: Callable[[Any, int, float, Any, LayerWork], CostTerms] | None = None
    states: Callable[[Any, StateSizes], tuple[int, int, int, int, int] | None] | None = None
    plan_checks: tuple[Callable[[str, Any, int], str | None], ...] = ()
    constraints: tuple[str, ...] = ()
    space_options: Callable[[Mapping], Mapping] | None = None


def as_list(value: Any, what: str, cast: Callable = int) -> list | None:
    """A constraint given as one value or a list, as a list (None when not given)."""
    if value is None:
        return None
    items = [value] if isinstance(value, (int, str)) and not isinstance(value, bool) else value
    try:
        out = [cast(v) for v in items]
    except (TypeError, ValueError):
        raise ConfigError(f"constraint {what} must be one value or a list of them, got {value!r}") from None
    if not out:
        raise ConfigError(f"constraint {what} must not be empty")
    return out


def positive_int(value: Any) -> str | None:
    """A field check: an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be an int >= 1, got {value!r}"
    return None


def a_bool(value: Any) -> str | None:
    """A field check: a bool."""
    return None if isinstance(value, bool) else f"must be a bool, got {value!r}"


def one_of(choices: tuple) -> Callable[[Any], str | None]:
    """A field check: one of ``choices``."""
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {choices}, got {value!r}"
    return check


def layer_elems(cm: Any, index: int, s: Any) -> tuple[int, int]:
    """``(every, trainable)`` parameter elements of layer ``index``'s flat buffer on one device under
    strategy ``s`` (its TP shard, its experts' EP share; ``cm``: the cost model), before any ZeRO
    sharding: ZeRO-3 gathers every one, gradients and optimizer updates are the trainable ones'."""
    ep = cm.ep_of(index, s)
    p, t = cm.layer_params(index, s.tp, ep=ep), cm.layer_params(index, s.tp, trainable_only=True, ep=ep)
    return math.ceil(p.sharded / s.tp) + p.replicated, math.ceil(t.sharded / s.tp) + t.replicated


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def plan_int(where: str, value: Any) -> str | None:
    """A plan check: an integer >= 1 (the plan's own message)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"plan {where} must be an integer >= 1, got {value!r}; fix the value in the plan"
    return None


def plan_bool(where: str, value: Any) -> str | None:
    """A plan check: true or false."""
    return None if isinstance(value, bool) else f"plan {where} must be true or false, got {value!r}"
