"""The per-layer tensor-parallel report: what TP at a degree shards in a layer, what stays whole and why.

Built from the analysis the TP pass applies (:func:`.analysis.analyze`), so it says what a plan will
do, not what a name suggests. It is shown by ``galvatron-fx layers MODEL --tp N``, kept in a searched
plan (``plan.explain()``) and behind the warning of a plan that pins ``tp > 1`` on a layer where TP
shards nothing (such a layer only repeats its whole computation on every rank of the TP group; the
search never offers it that degree, the tensor dimension's preference, :mod:`galvatron_fx.dims.tensor`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.fx

from ..errors import ConfigError
from ..ir import META_KEY, graph_info
from .analysis import analyze_layer
from .operands import embedding_operands, linear_operands, weight_consumers
from .state import LayerTP, is_param, op_name


@dataclass
class LayerTPReport:
    """TP of degree ``tp`` on one layer. ``sharded``: parameter fqn -> how (role and dim);
    ``replicated``: fqn -> why it stays whole; ``error``: why the layer cannot take this degree at
    all (then nothing else is filled in). Element counts are of the layer's parameters."""

    layer: int
    name: str
    tp: int
    sharded: dict[str, str] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    sharded_elements: int = 0
    total_elements: int = 0
    error: str | None = None

    @property
    def shards_nothing(self) -> bool:
        """TP at this degree shards no parameter of the layer (it accepts the degree, but every
        rank of the TP group would repeat the whole layer)."""
        return self.error is None and not self.sharded

    @property
    def sharded_fraction(self) -> float:
        """Sharded parameter elements / all of the layer's parameter elements (0 without params)."""
        return self.sharded_elements / self.total_elements if self.total_elements else 0.0

    def summary(self) -> str:
        """One line: ``"rejected: ..."``, ``"shards nothing: ..."`` or ``"62% of params sharded"``."""
        if self.error:
            return f"rejected: {self.error}"
        if self.shards_nothing:
            n = len(self.replicated)
            return f"shards nothing ({n} parameter(s) stay whole)" if n else "shards nothing (no parameters)"
        return f"{100 * self.sharded_fraction:.0f}% of params sharded"

    def notable_whole(self) -> dict[str, str]:
        """The parameters that stay whole for a reason worth reading: all of them when the layer
        shards nothing, else those read by a linear / embedding that runs replicated (norms and
        row-parallel biases are whole by design)."""
        if self.shards_nothing:
            return dict(self.replicated)
        return {fqn: why for fqn, why in self.replicated.items() if "runs replicated" in why}

    def lines(self) -> list[str]:
        """Human-readable detail: one line per parameter."""
        out = [f"layer {self.layer} {self.name} at tp={self.tp}: {self.summary()}"]
        out += [f"    sharded     {fqn}: {how}" for fqn, how in self.sharded.items()]
        out += [f"    replicated  {fqn}: {why}" for fqn, why in self.replicated.items()]
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "shards_nothing": self.shards_nothing,
                "sharded_fraction": round(self.sharded_fraction, 6)}


def layer_report(gm: torch.fx.GraphModule, res: LayerTP | Exception, layer: int, tp: int) -> LayerTPReport:
    """The report of ``layer`` from its analysis ``res`` at degree ``tp`` (or the ConfigError it raised)."""
    record = graph_info(gm).layers[layer]
    rep = LayerTPReport(layer, record.name, tp)
    if isinstance(res, Exception):
        rep.error = str(res)
        return rep
    params = _layer_params(gm, layer)
    rep.total_elements = sum(_numel(p) for p in params.values())
    roles = {**{n: "column-parallel" for n in res.column}, **{n: "row-parallel" for n in res.row},
             **{n: "vocabulary-parallel" for n in res.vocab_embeddings}}
    shards = {s.fqn: s for s in res.param_shards.values()}
    for fqn, node in params.items():
        if fqn in shards:
            s = shards[fqn]
            users = [roles[u.name] for u in weight_consumers(node) if u.name in roles]
            rep.sharded[fqn] = f"{users[0] if users else 'sharded'}, dim {s.dim}"
            rep.sharded_elements += _numel(node)
        else:
            rep.replicated[fqn] = _why_whole(node, layer, res)
    return rep


def tp_report(gm: torch.fx.GraphModule, tp: int, sp: bool = False) -> list[LayerTPReport]:
    """Every layer of ``gm`` at degree ``tp`` (each analysed with the layers sharing its weights, as
    a uniform plan would run it); a layer that cannot take ``tp`` carries the reason in ``error``."""
    info = graph_info(gm)
    if info is None or not info.layers:
        raise ConfigError("tp_report needs a captured, layer-grouped GraphModule (gfx.capture)")
    if int(tp) < 2:
        raise ConfigError(f"a tensor-parallel report needs tp >= 2, got {tp}")
    return [layer_report(gm, analyze_layer(gm, rec.index, tp, sp), rec.index, tp) for rec in info.layers]


def _numel(param: torch.fx.Node) -> int:
    return torch.Size(param.meta[META_KEY].param.shape).numel()


def _layer_params(gm, layer: int) -> dict[str, torch.fx.Node]:
    """fqn -> get_attr node of every parameter the layer's ops read."""
    out = {}
    for n in gm.graph.nodes:
        if is_param(n) and any(u.op != "output" and u.meta[META_KEY].layer == layer for u in weight_consumers(n)):
            out.setdefault(n.meta[META_KEY].param.fqn, n)
    return out


def _why_whole(param: torch.fx.Node, layer: int, res: LayerTP) -> str:
    """Why a parameter of ``layer`` stays whole under TP."""
    users = [u for u in weight_consumers(param) if u.op != "output" and u.meta[META_KEY].layer == layer]
    for u in users:
        if u.name in res.why_replicated:
            return f"{u.name} runs replicated: {res.why_replicated[u.name]}"
    for u in users:
        lin = linear_operands(u)
        if lin is not None and lin.bias is param and u.name in res.row:
            return f"bias of row-parallel {u.name} (added once, after the sum)"
        if lin is not None or embedding_operands(u) is not None:
            return f"read by {u.name}, which runs replicated"
    ops = sorted({op_name(u) for u in users})
    return f"not a linear or embedding weight (read by {', '.join(ops) or 'nothing'})"
