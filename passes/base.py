"""The pass contract and the pass manager (torch.fx.passes.infra conventions).

A pass has one job: ``requires(gm)`` checks its preconditions, ``call(gm)`` does the work and
returns ``PassResult(graph_module, modified)``, ``ensures(gm)`` checks the postconditions. Unlike
torch's ``PassBase.__call__``, :class:`GraphPass` runs ``ensures`` on the graph the pass *returns*,
since several of our passes build a new GraphModule rather than editing their input in place.
A contract that does not hold raises :class:`ContractError` (``check(cond, msg)``).

:class:`PassManager` runs an ordered list of passes, lints the graph after each one and records
their names in :attr:`PassManager.ran`. When a pass fails it raises :class:`PassError` naming the
pass and the passes that ran before it; an error meant for the user (a :class:`GalvatronError`
such as ``ConfigError``) keeps its type and gains that context as a note.

The IR moves through these states; each pass names the state it takes and leaves::

    CAPTURED --layer_grouping--> GROUPED --stage_split--> STAGE (pp > 1 only)
    GROUPED|STAGE --tensor_parallel--> TP_SHARDED --split_layers--> SPLIT
    SPLIT --the rewrite passes after split_layers (passes.REWRITE_ORDER), up to codegen--> SPLIT
    SPLIT --codegen--> DistributedModel --bind_parameters--> DistributedModel
"""

from __future__ import annotations

import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..errors import GalvatronError


class ContractError(GalvatronError):
    """A pass's precondition (``requires``) or postcondition (``ensures``) does not hold."""


class PassError(GalvatronError):
    """A pass failed inside a :class:`PassManager`; the message names it and the passes before it."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`ContractError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ContractError(message)


class GraphPass(PassBase):
    """A pass with a checked contract (see the module docstring). ``name`` is its short name."""

    name = ""

    def __call__(self, graph_module: torch.fx.GraphModule) -> PassResult:
        self.requires(graph_module)
        result = self.call(graph_module)
        self.ensures(result.graph_module)
        return result

    @classmethod
    def pass_name(cls) -> str:
        return cls.name or cls.__name__


def check_order(names: list[str], order: tuple[str, ...]) -> None:
    """Raise :class:`ContractError` unless the passes ``names`` that ``order`` lists appear in its
    relative order (each pair a ``this_before_that`` constraint, as torch.fx's
    ``this_before_that_pass_constraint``); passes ``order`` does not list are unconstrained."""
    rank = {n: i for i, n in enumerate(order)}
    listed = [n for n in names if n in rank]
    for a, b in zip(listed, listed[1:]):
        if rank[a] >= rank[b]:
            raise ContractError(f"pass {b!r} must run before {a!r} (the declared order: {' -> '.join(order)})")


class PassManager:
    """Run ``passes`` in order on a GraphModule (see the module docstring); ``order``: the declared
    pass order they must follow (:func:`check_order`, checked on construction).

    ``ran`` lists the names of the passes that completed, in order, after :meth:`__call__`.
    """

    def __init__(self, passes: list[GraphPass], *, lint: bool = True, order: tuple[str, ...] = ()):
        self.passes = list(passes)
        self.lint = lint
        self.ran: list[str] = []
        check_order(self.names, order)

    @property
    def names(self) -> list[str]:
        return [p.pass_name() for p in self.passes]

    def __call__(self, graph_module: torch.fx.GraphModule) -> PassResult:
        self.ran = []
        gm, modified = graph_module, False
        for p in self.passes:
            name = p.pass_name()
            where = f"in pass {name!r} (after {self.ran or 'no pass'})"
            try:
                result = p(gm)
                if self.lint:
                    result.graph_module.graph.lint()
            except ContractError as exc:
                raise PassError(f"{where}: contract broken: {exc}") from exc
            except GalvatronError as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(where)
                raise
            except Exception as exc:  # noqa: BLE001 - name the pass that broke, keep the cause
                raise PassError(f"{where}: {type(exc).__name__}: {exc}") from exc
            gm, modified = result.graph_module, modified or result.modified
            self.ran.append(name)
        return PassResult(gm, modified)
