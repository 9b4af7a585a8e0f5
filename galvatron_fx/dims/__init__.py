"""The per-layer parallel dimensions, one module each, read through one registry.

A layer's strategy (:class:`galvatron_fx.solver.strategy.Strategy`) is a value of each registered
dimension's fields: tensor parallelism with SP (:mod:`.tensor`), the data-parallel degree and kind
(:mod:`.data`), activation checkpointing (:mod:`.checkpointing`), experts (:mod:`.experts`),
context parallelism (:mod:`.context`), hybrid sharding (:mod:`.hsdp`), CPU offload (:mod:`.offload`) and activation offload (:mod:`.activation_offload`). Each module builds one :class:`Dimension`:

* ``fields``: its :class:`Field` records (name, type, default, position in the strategy and the
  decision tree, the values the tree enumerates, its validation);
* ``rules``: its pruning rules of the strategy space (:class:`Rule`);
* ``admission(cost_model, constraints)``: whether a layer admits a strategy (the cost model's
  analysis of the layer: heads a TP degree splits, experts an EP degree divides, attention a CP
  kind runs), and which admitted strategies it prefers;
* ``label``: the pieces of the strategy's label it writes;
* ``explain``: its lines in ``Plan.explain()``;
* ``passes`` / ``runtime``: the rewrite passes and runtime modules that implement it;
* ``properties`` / ``checks``: what it adds to the strategy (a derived property, a check across
  fields);
* ``compute_terms`` / ``cost_terms``: what it adds to a layer's price: device seconds of forward
  and backward, then (``cost_terms(cost_model, index, n, strategy, work)``, ``work`` a
  :class:`~.base.LayerWork`) a :class:`~.base.CostTerms` of communication, overheads and memory;
* ``states``: where it moves a layer's model states (``states(strategy, sizes)``, ``sizes`` a
  :class:`~.base.StateSizes`: ``(params, grads, optimizer, masters, host)`` bytes per device, or
  ``None`` to leave them as data parallelism lays them out);
* ``plan_checks``: what it refuses in a plan's layer (``check(where, layer, micro_batch)``: the
  message naming the fix, or ``None``);
* ``constraints`` / ``space_options``: the search constraints it adds (beyond the planner's own)
  and the options they give its fields' values (``SpaceOptions.more``).

The solver's strategy space is the product of the registered fields (:func:`enumerate_strategies`),
the engine asks one admissibility callable (:func:`admission`), the plan JSON's per-layer keys and
``explain()`` lines come from here. :data:`DIMENSIONS` lists the modules in order; adding a
dimension is adding its module and its line there (``docs/architecture.md``, "Adding a dimension").

Imports: this package sits below the solver, the cost model and the plan (it imports none of
them); admission reads the cost model it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import ConfigError
from . import activation_offload, checkpointing, context, data, experts, hsdp, offload, tensor
from .base import (
    Admission,
    CostTerms,
    Dimension,
    Field,
    LayerWork,
    PassSpec,
    Rule,
    SpaceOptions,
    StateSizes,
    as_list,
    is_pow2,
)

__all__ = ["DIMENSIONS", "Admission", "CostTerms", "LayerWork", "StateSizes", "PassSpec", "plan_problems", "rewrite_order", "Dimension", "Field", "Rule", "SpaceOptions", "admission", "as_list",
           "enumerate_strategies", "explain_lines", "fields", "is_pow2", "json_fields", "label", "rules",
           "strategy_namespace", "validate", "constraint_keys", "space_options", "extra_fields"]

DIMENSIONS: tuple[Dimension, ...] = (tensor.DIMENSION, data.DIMENSION, checkpointing.DIMENSION, experts.DIMENSION,
                                     context.DIMENSION, hsdp.DIMENSION, offload.DIMENSION, activation_offload.DIMENSION)
"""Every registered dimension, in order (their fields' positions interleave: see :func:`fields`)."""


_FIELDS: dict[int, tuple[tuple, tuple[Field, ...]]] = {}


def fields() -> tuple[Field, ...]:
    """Every dimension's fields, by position: the strategy's fields in order (computed once per
    registry)."""
    hit = _FIELDS.get(id(DIMENSIONS))
    if hit is not None and hit[0] is DIMENSIONS:
        return hit[1]
    out = tuple(sorted((f for d in DIMENSIONS for f in d.fields), key=lambda f: f.position))
    names = [f.name for f in out]
    if len(names) != len(set(names)) or len({f.position for f in out}) != len(out):
        raise RuntimeError(f"dimension fields clash in name or position: {names}")   # pragma: no cover
    _FIELDS[id(DIMENSIONS)] = (DIMENSIONS, out)
    return out


def rules() -> tuple[Rule, ...]:
    """Every dimension's pruning rules, in registry order."""
    return tuple(r for d in DIMENSIONS for r in d.rules)


def validate(strategy: Any) -> None:
    """Raise :class:`ConfigError` naming the first field value a dimension refuses."""
    for f in fields():
        if f.check is not None:
            why = f.check(getattr(strategy, f.name))
            if why:
                raise ConfigError(f"Strategy.{f.name} {why}")
    for d in DIMENSIONS:
        for check in d.checks:
            why = check(strategy)
            if why:
                raise ConfigError(why)


def enumerate_strategies(make: Callable[..., Any], options: SpaceOptions) -> Iterator[Any]:
    """The decision tree: every combination of the fields' values, in position order (each field's
    values in their listed order), as ``make(**fields)``; the caller applies the rules."""
    fs = fields()
    n = options.devices_per_stage

    def walk(k: int, chosen: dict):
        if k == len(fs):
            yield make(**chosen)
            return
        f = fs[k]
        if f.values is not None:
            options_k = f.values(options, n, chosen)
        elif f.derive is not None:
            options_k = (f.derive(n, chosen),)
        else:
            options_k = (f.default,)
        for v in options_k:
            chosen[f.name] = v
            yield from walk(k + 1, chosen)
        chosen.pop(f.name, None)

    yield from walk(0, {})


def label(strategy: Any) -> str:
    """``"tp2·dp4·ep4·cp4u·zero3·sp·ckpt"``: each dimension's pieces, by position."""
    parts = [p for d in DIMENSIONS if d.label for p in d.label(strategy)]
    return "·".join(text for _, text in sorted(parts, key=lambda p: p[0]))


def admission(cost_model: Any, constraints: Mapping | None = None) -> tuple[Callable[[int, Any], bool],
                                                                            Callable[[int, Any], bool]]:
    """``(admits, prefers)`` over every dimension for the layers of ``cost_model``'s model: a layer
    admits a strategy when every dimension admits it, and prefers it when every dimension does."""
    answers = [d.admission(cost_model, constraints or {}) for d in DIMENSIONS if d.admission]
    admits = [a.admits for a in answers if a.admits]
    prefers = [a.prefers for a in answers if a.prefers]

    # NOTE: the search asks the same (layer, strategy) once per pipeline configuration: answers
    # are remembered (a strategy that is not hashable, such as a namespace, is asked afresh)
    def remembered(fns: list) -> Callable[[int, Any], bool]:
        seen: dict[tuple[int, Any], bool] = {}

        def answer(layer: int, s: Any) -> bool:
            try:
                got = seen.get((layer, s))
            except TypeError:
                return all(fn(layer, s) for fn in fns)
            if got is None:
                got = seen[(layer, s)] = all(fn(layer, s) for fn in fns)
            return got
        return answer

    all_admit, all_prefer = remembered(admits), remembered(prefers)
    return all_admit, all_prefer


def explain_lines(layers: list) -> list[str]:
    """Every dimension's ``explain()`` lines for a plan's layers, in registry order."""
    return [line for d in DIMENSIONS if d.explain for line in d.explain(layers)]


def json_fields() -> tuple[Field, ...]:
    """The fields a plan's per-layer JSON carries (absent keys read as the default)."""
    return tuple(f for f in fields() if f.in_json)


def strategy_namespace() -> dict[str, Any]:
    """The properties dimensions add to the strategy (e.g. ``shards_experts``)."""
    return {k: v for d in DIMENSIONS for k, v in d.properties.items()}


def constraint_keys() -> tuple[str, ...]:
    """The search constraints the dimensions add (``gfx.search(constraints=...)`` accepts them)."""
    return tuple(k for d in DIMENSIONS for k in d.constraints)


def space_options(constraints: Mapping | None) -> dict:
    """``SpaceOptions.more``: each dimension's options from the search constraints."""
    out: dict = {}
    for d in DIMENSIONS:
        if d.space_options:
            out.update(d.space_options(constraints or {}))
    return out


def extra_fields(strategy: Any, attributes: frozenset) -> dict:
    """The plan-JSON fields of ``strategy`` a ``LayerPlan`` holds in ``extra`` (those that are not
    its ``attributes``), for dimensions registered after the attributes; a field at its default
    is left out (a plan without the dimension reads the same)."""
    return {f.name: v for f in json_fields()
            if f.name not in attributes and (v := getattr(strategy, f.name, f.default)) is not None
            and v != f.default}


def rewrite_order(skeleton: tuple[str, ...]) -> tuple[str, ...]:
    """The rewrite passes in order: ``skeleton`` (the passes every plan's program needs, whatever
    its dimensions) with each dimension's :class:`PassSpec` after its ``after`` pass (several after
    one pass: in registry order)."""
    order = list(skeleton)
    followers: dict[str, list[str]] = {}
    pending = [spec for d in DIMENSIONS for spec in d.passes]
    while pending:
        placed = [spec for spec in pending if spec.after in order]
        if not placed:
            raise RuntimeError(f"passes {[p.name for p in pending]} name no placed pass to follow")   # pragma: no cover
        for spec in placed:
            before = followers.setdefault(spec.after, [])
            at = order.index(before[-1] if before else spec.after) + 1
            order.insert(at, spec.name)
            before.append(spec.name)
        pending = [spec for spec in pending if spec not in placed]
    return tuple(order)


def pass_specs() -> dict:
    """Every dimension's :class:`PassSpec`, by pass name."""
    return {spec.name: spec for d in DIMENSIONS for spec in d.passes}


def plan_problems(where: str, layer: Any, micro_batch: int) -> list[str]:
    """What the dimensions refuse in one plan layer, in registry order (the first is raised)."""
    return [why for d in DIMENSIONS for check in d.plan_checks if (why := check(where, layer, micro_batch))]
