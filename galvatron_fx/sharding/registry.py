"""The sharding rule registry: op name -> the rule that propagates a sharding state through it.

A rule is ``rule(analyzer, node, ins, states) -> state``: ``analyzer`` is the
:class:`~galvatron_fx.sharding.analysis.LayerAnalyzer` of the layer (its ``tp``, ``sp``, result
``res``, ``st(node)`` and ``conv(...)``), ``ins`` the node's tensor inputs and ``states`` their
sharding states (at least one is sharded, or the node is a source: a linear or embedding with a
parameter weight). It returns the node's state (``None``, a :class:`~.state.Sharded` or a tuple of
them for multi-output ops) and may record conversions, shape arguments, parameter shards in
``analyzer.res``; it raises :class:`~.state.Unsupported` when the op cannot run on these shards (the
analyzer then gathers sequence shards or demotes the tp shards' column linears) and may raise
:class:`~.state.Demote` or :class:`~galvatron_fx.errors.ConfigError` itself.

Adding an op is adding one rule::

    @register_rule("my_op", "my_op_alias")
    def my_op(an, node, ins, states):
        ...

Names are those of :func:`~.state.op_name` (aten overload packets, torch functions and tensor
methods alike, in-place variants folded). An op without a rule cannot run on shards
(:func:`default_rule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .state import Unsupported

RuleFn = Callable[..., object]


@dataclass(frozen=True)
class Rule:
    fn: RuleFn
    # False: the rule also sees ops whose value is not a single tensor (tuples of a split, sizes);
    # True: such an op is Unsupported before the rule runs
    tensor_output: bool = True
    # True: the rule also handles Duplicated inputs; False: an op with one is duplicated as a whole
    # when its other inputs are replicated (LayerAnalyzer.duplicated), else Unsupported
    duplicated: bool = False


_RULES: dict[str, Rule] = {}


def register_rule(*op_names: str, tensor_output: bool = True, duplicated: bool = False) -> Callable[[RuleFn], RuleFn]:
    """Decorator: ``fn`` is the rule of every op in ``op_names`` (an op has at most one rule)."""
    if not op_names:
        raise ValueError("register_rule needs at least one op name")

    def deco(fn: RuleFn) -> RuleFn:
        for name in op_names:
            if name in _RULES:
                raise ValueError(f"sharding rule for {name!r} registered twice "
                                 f"({_RULES[name].fn.__qualname__} and {fn.__qualname__})")
            _RULES[name] = Rule(fn, tensor_output, duplicated)
        return fn

    return deco


def default_rule(an, node, ins, states):
    """An op without a rule cannot run on shards."""
    raise Unsupported


_DEFAULT = Rule(default_rule, tensor_output=False)


def lookup(name: str) -> Rule:
    """The rule registered for op ``name``, else the default rule."""
    return _RULES.get(name, _DEFAULT)


def registered_ops() -> dict[str, RuleFn]:
    """Op name -> rule function of every registered rule (a copy)."""
    return {name: rule.fn for name, rule in _RULES.items()}
