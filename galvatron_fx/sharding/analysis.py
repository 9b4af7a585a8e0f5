"""The tensor-parallel analysis driver: :class:`LayerAnalyzer` propagates sharding states through
one layer in graph order, dispatching every op to its rule (:mod:`.registry`); :func:`analyze` runs
it over the tp layers until no column linear needs demoting. See :mod:`galvatron_fx.sharding`."""

from __future__ import annotations

import torch
import torch.fx

from ..errors import ConfigError
from ..ir import META_KEY, graph_info

# the rule modules register their rules on import
from . import attention, linear, losses, pointwise, reductions, selections, views  # noqa: F401
from .operands import embedding_operands, linear_operands, weight_consumers
from .registry import lookup
from .state import (
    SEQ,
    TP,
    Demote,
    Duplicated,
    LayerTP,
    Reblock,
    Sharded,
    Unsupported,
    is_param,
    is_sharded,
    op_name,
    tensor_inputs,
    tensor_val,
    tp_origins,
)

LOSSES = {"cross_entropy", "cross_entropy_loss", "nll_loss", "log_softmax", "binary_cross_entropy_with_logits", "mse_loss"}


class LayerAnalyzer:
    """Propagate sharding states through one layer; see the module docstring."""

    def __init__(self, gm: torch.fx.GraphModule, layer: int, tp: int, sp: bool, demoted: dict[str, str],
                 input_layout, blocks: dict | None = None, notes: dict | None = None):
        self.gm, self.layer, self.tp, self.sp = gm, layer, tp, sp
        self.demoted = demoted   # column linear -> why it must run replicated
        self.blocks = {} if blocks is None else blocks   # column linear -> its output's (size, mode) blocks
        info = graph_info(gm)
        self.record = info.layers[layer]
        self.kind = self.record.kind
        self.input_layout = input_layout   # (node, layer) -> Sharded | None for boundary inputs
        self.res = LayerTP(layer, self.record.name, tp, sp)
        if notes is not None:
            self.res.notes = notes     # kept over the re-analyses, which no longer meet the demoting op
        self.state: dict[torch.fx.Node, object] = {}

    # --- helpers
    def in_layer(self, n: torch.fx.Node) -> bool:
        return n.meta[META_KEY].layer == self.layer and n.op not in ("placeholder", "get_attr")

    def st(self, n):
        if not isinstance(n, torch.fx.Node):
            return None
        if n in self.state:
            return self.state[n]
        if n.op in ("placeholder", "get_attr") or not self.in_layer(n):
            return self.input_layout(n, self.layer)
        return None

    def conv(self, node, inp, op):
        key = (node.name, inp.name)
        if isinstance(inp, torch.fx.Node) and key not in self.res.conversions:
            self.res.conversions[key] = op

    def fail(self, node, states):
        """``node`` cannot run on these shards: gather sequence shards, demote tp origins."""
        origins = tp_origins(states)
        if origins:
            why = self.res.notes.setdefault(node.name, f"{op_name(node)} cannot run on tensor-parallel shards")
            raise Demote(origins, f"its output reaches {node.name}: {why}")
        raise Unsupported

    def replicated(self, node, why: str) -> None:
        """``node`` (a linear or embedding) runs on its whole weight; ``why`` goes to the report."""
        self.res.replicated_linears.append(node.name)
        self.res.why_replicated.setdefault(node.name, self.demoted.get(node.name, why))

    def node(self, name: str) -> torch.fx.Node:
        if not hasattr(self, "_by_name"):
            self._by_name = {n.name: n for n in self.gm.graph.nodes}
        return self._by_name[name]

    def run(self) -> LayerTP:
        order = [n for n in self.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")
                 and n.meta[META_KEY].layer == self.layer]
        for node in order:
            self.visit(node)
        # what leaves the layer must be replicated or sequence-sharded along dim 1
        for node in order:
            external = [u for u in node.users if u.op == "output" or u.meta[META_KEY].layer != self.layer]
            if not external:
                continue
            s = self.state.get(node)
            if is_sharded(s) and not isinstance(s, Sharded):   # a tuple (split) or duplicated value leaving
                origins = tp_origins([s])
                if origins:
                    raise Demote(origins, f"its output leaves the layer at {node.name} as split pieces")
                s = None
            if isinstance(s, Sharded) and s.kind == TP:
                if not (self.vocab_sharded_output(s, external) or self.extra_output(s, external)):
                    raise Demote(s.origins, f"its output leaves the layer sharded at {node.name}")
                self.res.sharded_outputs.append(node.name)
            self.res.outputs[node.name] = s   # replicated or sequence-sharded; the pass converts
        self.res.states = {n.name: s for n, s in self.state.items()}
        return self.res

    def extra_output(self, s: Sharded, external) -> bool:
        """A value read only by the graph output of the whole model (not a pipeline stage's sends):
        an output beside the loss, such as the KV cache transformers returns under torch.compile,
        which training never materialises; it leaves as this rank's slice, marked, and
        ``eval_step(return_outputs=True)`` assembles it. NOTE: without this, a cache output made
        every attention projection run replicated."""
        stage = getattr(graph_info(self.gm), "stage", None)
        return (getattr(s, "plain", True) and (stage is None or stage.is_last)
                and all(u.op == "output" for u in external))

    def vocab_sharded_output(self, s: Sharded, external) -> bool:
        """Logits beside a vocabulary-parallel loss of this layer may leave as a graph output still
        sharded (HF LMs return them with the loss): only to the graph output, and only the logits
        of those losses' column linears. The pass marks them (or gathers them for a ``loss_fn``)."""
        heads = frozenset().union(*(v.origins for v in self.res.vocab_losses.values()))
        return (bool(heads) and s.origins <= heads and getattr(s, "plain", True)
                and all(u.op == "output" for u in external))

    def visit(self, node):
        ins = tensor_inputs(node)
        states = [self.st(i) for i in ins]
        if node in self.state:
            return
        sources = linear_operands(node) is not None or embedding_operands(node) is not None
        if not any(is_sharded(s) for s in states) and not sources:
            self.state[node] = None
            return
        self.current = node
        try:
            if any(isinstance(s, Duplicated) for s in states) and not lookup(op_name(node)).duplicated:
                self.state[node] = self.duplicated(node, ins, states)
            else:
                self.state[node] = self.rule(node, ins, states)
        except Unsupported:
            for key in [k for k in self.res.conversions if k[0] == node.name]:
                del self.res.conversions[key]
            self.res.const_args.pop(node.name, None)
            if tp_origins(states):
                if op_name(node) in LOSSES and all(s is None or isinstance(s, Sharded) and s.plain for s in states):
                    for i, s in zip(ins, states):    # a loss without a shard rule (.losses): gather
                        if isinstance(s, Sharded):
                            self.conv(node, i, ("gather", s.dim))
                    self.state[node] = None
                    return
                self.fail(node, states)
            for i, s in zip(ins, states):   # sequence shards: gather them, run replicated
                if isinstance(s, Sharded):
                    self.conv(node, i, ("gather", s.dim))
            self.state[node] = None
            if sources:
                self.replicated(node, "its input is sharded in a way it cannot consume")

    def duplicated(self, node, ins, states):
        """Any op on duplicated and replicated values gives a duplicated value (every rank computes
        the same, the gradients stay partial sums); the replicated inputs are copied (f), so their
        gradients are summed over the group, sequence chunks all-gathered (their adjoint sums too)."""
        if any(isinstance(s, Sharded) and s.kind == TP for s in states):
            raise Unsupported
        origins = frozenset(tp_origins(states))
        for i, s in zip(ins, states):
            v = tensor_val(i)
            if isinstance(s, Sharded):       # sequence chunks: gathered whole (backward reduce-scatter)
                self.conv(node, i, ("all_gather_seq", s.dim))
            elif s is None and v is not None and v.is_floating_point():
                self.conv(node, i, ("copy",))
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            return tuple(Duplicated(origins) if isinstance(v, torch.Tensor) else None for v in val)
        return Duplicated(origins) if isinstance(val, torch.Tensor) else None

    def rule(self, node, ins, states):
        """The state of ``node`` from its registered rule (raises Unsupported where it has none)."""
        rule = lookup(op_name(node))
        if rule.tensor_output and tensor_val(node) is None:
            raise Unsupported
        return rule.fn(self, node, ins, states)


def boundary_layout(gm, node: torch.fx.Node, layer: int | None, layer_tp) -> Sharded | None:
    """Layout in which ``layer`` receives ``node``, a value made outside it: sequence-sharded along
    dim 1 when the layer has sp and the value is a 3-D floating tensor ([batch, seq, hidden]), else
    replicated. Parameters and constants are always replicated."""
    if node.op == "get_attr" or layer is None:
        return None
    tp, sp = layer_tp.get(layer, (1, False))
    v = tensor_val(node)
    # NOTE: a dim 1 of size 1 is no sequence (Bloom's ALiBi is [batch x heads, 1, seq])
    # NOTE: a sequence length not divisible by tp (ViT's 17 or 197 tokens) splits into uneven
    # chunks (runtime/tp_ops.chunk_bounds)
    if sp and int(tp) > 1 and v is not None and v.dim() == 3 and v.is_floating_point() and v.shape[1] > 1:
        return Sharded(1, SEQ)
    return None


def analyze(gm: torch.fx.GraphModule, layer_tp: dict[int, tuple[int, bool]],
            keep_whole: dict[str, str] | None = None) -> dict[int, LayerTP]:
    """Analyse every layer of ``layer_tp`` (layer index -> (tp, sp)); see the module docstring.
    ``keep_whole``: linear node name -> why it runs replicated (expert-parallel experts).

    Raises ConfigError when a block's heads / key-value heads / ffn width do not divide by its tp."""
    info = graph_info(gm)
    if info is None or not info.layers:
        raise ConfigError("apply_tensor_parallel needs a captured, layer-grouped GraphModule (gfx.capture)")
    for idx, (tp, _sp) in layer_tp.items():
        if not 0 <= idx < len(info.layers):
            raise ConfigError(f"layer index {idx} out of range (the graph has {len(info.layers)} layers)")
        if int(tp) < 1:
            raise ConfigError(f"layer {info.layers[idx].name}: tp must be >= 1, got {tp}")

    def expected_layout(node, layer):
        return boundary_layout(gm, node, layer, layer_tp)

    demoted: dict[str, str] = dict(keep_whole or {})   # column linear -> why it runs replicated
    blocks: dict[str, tuple] = {}
    notes: dict[int, dict[str, str]] = {}
    for _ in range(len(gm.graph.nodes) + 1):
        try:
            out = {}
            for idx in sorted(layer_tp):
                tp, sp = int(layer_tp[idx][0]), bool(layer_tp[idx][1])
                if tp > 1:
                    out[idx] = _analyze_layer(gm, idx, tp, sp, demoted, expected_layout, blocks,
                                              notes.setdefault(idx, {}))
            _check_param_consistency(gm, out)
            break
        except Demote as d:
            if d.origins <= demoted.keys():
                raise RuntimeError(f"internal: tensor-parallel analysis did not converge at {sorted(d.origins)}") from None
            for origin in d.origins:
                demoted.setdefault(origin, d.why)
    for res in out.values():
        _summarise(gm, res)
    return out


def analyze_layer(gm: torch.fx.GraphModule, index: int, tp: int, sp: bool = False, ep: int = 1,
                  expert_tp: bool = False):
    """Layer ``index`` alone at degree ``tp`` (``sp``: sequence parallel; ``ep > 1``: its experts
    split by expert, so left whole, unless ``expert_tp``: sharded over TP as well, only the routers
    whole), analysed together with the layers sharing a weight with it (a
    tied weight is sharded only if every layer reading it is: what a uniform plan does): its
    :class:`LayerTP`, or the :class:`ConfigError` it raises."""
    from .experts import keep_whole, split_blocks

    layers = graph_info(gm).layers
    mine = set(layers[index].params)
    partners = [r.index for r in layers if mine & set(r.params)] or [index]
    try:
        keep = keep_whole(split_blocks(gm, {index: ep}), {index: ep}, {index} if expert_tp else set())
        return analyze(gm, {j: (tp, bool(sp)) for j in partners}, keep).get(index)
    except ConfigError as exc:
        return exc


def _analyze_layer(gm, idx, tp, sp, demoted, expected_layout, blocks, notes) -> LayerTP:
    """One layer, again each time a fused projection's output turns out to be taken apart
    (:class:`Reblock`: the blocks are then known from the start)."""
    for _ in range(len(gm.graph.nodes) + 1):
        try:
            return LayerAnalyzer(gm, idx, tp, sp, demoted, expected_layout, blocks, notes).run()
        except Reblock as r:
            if blocks.get(r.origin) == r.blocks:
                raise RuntimeError(f"internal: tensor-parallel blocks of {r.origin} did not converge") from None
            blocks[r.origin] = r.blocks
    raise RuntimeError("internal: tensor-parallel blocks did not converge")


def _check_param_consistency(gm, results: dict[int, LayerTP]) -> None:
    """A parameter used in several places (tied weights) is sharded only if every use agrees."""
    wants: dict[str, set] = {}
    users_of: dict[str, set] = {}
    for res in results.values():
        for name, shard in res.param_shards.items():
            wants.setdefault(name, set()).add((shard.dim, shard.tp, shard.blocks))
    for node in gm.graph.nodes:
        if not is_param(node) or node.name not in wants:
            continue
        consumers = weight_consumers(node)
        for u in consumers:
            users_of.setdefault(node.name, set()).add(u.name)
        for u in consumers:
            if u.op == "output":
                wants[node.name].add(None)
                continue
            res = results.get(u.meta[META_KEY].layer)
            shard_users = set(res.column + res.row + res.vocab_embeddings) if res else set()
            if u.name not in shard_users:
                wants[node.name].add(None)
    for name, specs in wants.items():
        if len(specs) > 1:
            raise Demote(users_of[name], f"its weight {name} is tied to a use that cannot take the same shards")


def _summarise(gm, res: LayerTP) -> None:
    record = graph_info(gm).layers[res.layer]
    sharded = {s.fqn for s in res.param_shards.values()}
    res.sharded_params = sorted(sharded)
    names = set(record.params)
    for n in gm.graph.nodes:
        if is_param(n) and any(u.meta[META_KEY].layer == res.layer for u in n.users):
            names.add(n.meta[META_KEY].param.fqn)
    res.replicated_params = sorted(names - sharded)
    res.replicated_linears = list(dict.fromkeys(res.replicated_linears))
