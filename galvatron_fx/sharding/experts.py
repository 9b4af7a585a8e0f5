"""Mixture-of-experts blocks of a captured graph: the routed experts, their inputs and their output.

An *experts block* is the code of one module holding grouped expert weights (3-D parameters
``[E, ...]`` read by ``grouped_mm``: transformers 5.x ``MixtralExperts``, ``Qwen2MoeExperts``,
``DeepseekV2Experts``...). The block is every node whose module path is that module (or inside it:
``act_fn``); its external tensor inputs are exactly three:

* ``x``: the tokens ``[T, H]`` (floating point, two dims),
* ``index``: the router's top-k expert ids ``[T, k]`` (integer),
* ``weights``: the router's top-k weights ``[T, k]`` (floating point, the shape of ``index``),

plus sizes computed outside (the batch symbol), and its output is one tensor ``[T, H]``: for
every token, the sum over its ``k`` experts of weight x expert(token). The router (the gate linear,
softmax / sigmoid, top-k) and shared experts (Qwen2-MoE, DeepSeek) lie outside the block: they are
dense layers. Expert parallelism (:mod:`galvatron_fx.runtime.experts`) runs the block on other
ranks' tokens with this rank's experts only; the cost model reads ``params`` (the expert weights)
and ``top_k``.

A *loop-form* block (``kind="loop"``: transformers 4.x Mixtral, most research code) iterates over
an ``nn.ModuleList`` of ``E`` expert modules: ``mask = one_hot(index, E).permute(2, 1, 0)``, then
for ``e in range(E)``: ``rows = torch.where(mask[e])``, expert ``e`` on ``x[rows]`` times the rows'
weights, accumulated with ``out.index_add_(0, rows, y)`` into ``out = zeros_like(x)``. Capture
unrolls the loop; the normalise pass (:mod:`galvatron_fx.passes.normalize`) gives every front end
the same graph (the row lookup :func:`~galvatron_fx.runtime.experts.routed_rows`, a functional
accumulation). The block is the one-hot mask, the ``E`` iterations (each reading only its expert's
parameters, ``<list>.<e>.*``) and the accumulation; inputs and output as above. Expert parallelism
runs only this rank's iterations and holds only their experts' parameters. A loop that skips
experts (``for e in expert_hit``, data-dependent control flow) does not capture as one graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..ir import META_KEY
from .operands import GROUPED_MM, weight_param
from .state import is_param, op_name, tensor_val


@dataclass
class MoEBlock:
    """One experts block (see the module docstring). Node lists are in graph order."""

    path: str                        # module path of the experts module (loop: the expert list)
    nodes: list[torch.fx.Node]       # the block's nodes, parameters excluded
    params: list[torch.fx.Node]      # the expert weights' get_attr nodes ([E, ...]; loop: every expert's)
    grouped: list[torch.fx.Node]     # its grouped matmuls (loop: the experts' linears)
    x: torch.fx.Node
    index: torch.fx.Node
    weights: torch.fx.Node
    sizes: list[torch.fx.Node]       # other external inputs (sizes derived from the batch)
    output: torch.fx.Node
    num_experts: int
    top_k: int
    kind: str = "grouped"            # "grouped" | "loop"
    loop: LoopExperts | None = None  # kind "loop": the iterations

    def routers(self, depth: int = 8) -> list[torch.fx.Node]:
        """The linears computing the router's logits (within ``depth`` ops of the top-k outputs)."""
        out, frontier, seen = [], [self.index, self.weights], set()
        for _ in range(depth):
            nxt = []
            for n in frontier:
                if n in seen or not isinstance(n, torch.fx.Node):
                    continue
                seen.add(n)
                if op_name(n) in ("linear", "matmul", "mm", "addmm"):
                    out.append(n)
                else:
                    nxt.extend(n.all_input_nodes)
            frontier = nxt
        return out

    @property
    def inputs(self) -> list[torch.fx.Node]:
        """The block's inputs in the order :mod:`galvatron_fx.runtime.experts` passes them."""
        return [self.x, self.index, self.weights, *self.params, *self.sizes]

    def compactable(self) -> bool:
        """Whether the block's token count enters only through its ``sizes`` inputs, each a multiple
        of it (a symbolic batch): it may then run on any number of tokens."""
        def info(n):
            return n.meta.get(META_KEY)

        kx = dict(getattr(info(self.x), "batch_dims", ()) or ()).get(0)
        return kx is not None and all(
            (f := getattr(info(s), "batch_factor", None)) is not None and f % kx == 0 for s in self.sizes)


@dataclass
class LoopExperts:
    """The unrolled iterations of a loop-form block, in expert order (``e = 0 .. E-1``)."""

    one_hot: torch.fx.Node                 # one_hot(index, E): the expert mask
    selectors: list[torch.fx.Node]         # mask[e] (a getitem / select of constant index e)
    iterations: list[list[torch.fx.Node]]  # each expert's nodes (parameters and its accumulation excluded)
    params: list[list[torch.fx.Node]]      # each expert's parameters
    accumulate: list[torch.fx.Node]        # each expert's accumulation (index_add into the running sum)


class NotAnExpertsBlock(Exception):
    """Why a module with grouped expert weights cannot run expert-parallel."""


def _path(node: torch.fx.Node) -> str:
    """The module a node belongs to (a parameter: its owner, which export does not record)."""
    info = node.meta.get(META_KEY)
    if is_param(node):
        return info.param.fqn.rpartition(".")[0]
    return getattr(info, "module_path", "") or ""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def expert_modules(nodes) -> dict[str, int]:
    """Module path -> number of experts, for every module whose 3-D parameter a grouped matmul reads."""
    out: dict[str, int] = {}
    for n in nodes:
        if n.op != "call_function" or op_name(n) not in GROUPED_MM or len(n.args) < 2:
            continue
        found = weight_param(n.args[1])
        if found is not None and tensor_val(found[0]).dim() == 3:
            out.setdefault(_path(found[0]), int(tensor_val(found[0]).shape[0]))
    return out


def moe_blocks(graph: torch.fx.Graph, nodes=None) -> list[MoEBlock | NotAnExpertsBlock]:
    """The experts blocks among ``nodes`` (default: the whole graph), in graph order; a module with
    grouped expert weights (or a loop over experts) whose code does not have the expected shape
    gives a :class:`NotAnExpertsBlock` saying why instead."""
    nodes = list(graph.nodes) if nodes is None else list(nodes)
    found = [_block(nodes, path, e) for path, e in expert_modules(nodes).items()]
    return found + [_loop_block(nodes, oh, rows) for oh, rows in _expert_loops(nodes).items()]


def _block(nodes, path: str, num_experts: int) -> MoEBlock | NotAnExpertsBlock:
    mine = [n for n in nodes if n.op != "placeholder" and _inside(_path(n), path)]
    params = [n for n in mine if is_param(n)]
    body = [n for n in mine if not is_param(n)]
    inside = set(params)
    for n in body:   # sizes computed from outside values only (``x.size(0) * 16``) stay outside
        if tensor_val(n) is not None or any(a in inside for a in n.all_input_nodes) \
                or not any(isinstance(a, torch.fx.Node) for a in n.all_input_nodes):
            inside.add(n)
    body = [n for n in body if n in inside]
    external: list[torch.fx.Node] = []
    for n in body:
        for a in n.all_input_nodes:
            if a not in inside and a not in external:
                external.append(a)
    leaving = [n for n in body if any(u not in inside for u in n.users)]
    if len(leaving) != 1:
        return NotAnExpertsBlock(f"{path}: {len(leaving)} values leave the experts module, expected one "
                                 f"(the combined tokens)")
    tensors = [a for a in external if tensor_val(a) is not None]
    sizes = [a for a in external if tensor_val(a) is None]
    ints = [a for a in tensors if not tensor_val(a).is_floating_point()]
    floats = [a for a in tensors if tensor_val(a).is_floating_point()]
    if len(ints) != 1 or len(floats) != 2:
        return NotAnExpertsBlock(f"{path}: its inputs are {[a.name for a in tensors]}, expected tokens, "
                                 f"top-k expert ids and top-k weights")
    index = ints[0]
    k_shape = tuple(tensor_val(index).shape)
    weights = [a for a in floats if tuple(tensor_val(a).shape) == k_shape]
    xs = [a for a in floats if a not in weights]
    if len(weights) != 1 or len(xs) != 1 or tensor_val(xs[0]).dim() != 2 or len(k_shape) != 2:
        return NotAnExpertsBlock(f"{path}: cannot tell the tokens [T, H] from the top-k ids and weights "
                                 f"[T, k] among {[a.name for a in tensors]}")
    out = leaving[0]
    if tuple(tensor_val(out).shape) != tuple(tensor_val(xs[0]).shape):
        return NotAnExpertsBlock(f"{path}: its output {tuple(tensor_val(out).shape)} is not shaped like its "
                                 f"tokens {tuple(tensor_val(xs[0]).shape)}")
    grouped = [n for n in body if n.op == "call_function" and op_name(n) in GROUPED_MM]
    for p in params:
        if tensor_val(p).dim() == 0 or int(tensor_val(p).shape[0]) != num_experts:
            return NotAnExpertsBlock(f"{path}: parameter {p.target} is not indexed by expert on dim 0")
    return MoEBlock(path, body, params, grouped, xs[0], index, weights[0], sizes, out, num_experts,
                    int(k_shape[1]))


# ------------------------------------------------------------------------------ loop form
_ACCUMULATE = ("index_add",)
_FRESH = ("zeros_like", "zeros", "new_zeros")


def is_routed_rows(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls :func:`galvatron_fx.runtime.experts.routed_rows` (known by name: the
    sharding layer sits below the runtime)."""
    t = node.target
    return node.op == "call_function" and getattr(t, "__name__", "") == "routed_rows" \
        and getattr(t, "__module__", "") == "galvatron_fx.runtime.experts"


def _stack(node: torch.fx.Node) -> list[str]:
    return list(node.meta.get("nn_module_stack") or {})


def expert_lists(graph: torch.fx.Graph) -> set[str]:
    """Paths of the module lists whose elements run on the rows ``routed_rows`` picks: a
    loop's experts (the layer grouping takes them for no repeated blocks)."""
    out: set[str] = set()
    for r in graph.nodes:
        if not is_routed_rows(r):
            continue
        own, frontier = set(_stack(r)), [r]
        for _ in range(3):   # rows -> x[rows] -> the expert's first op
            frontier = [u for n in frontier for u in n.users]
            for u in frontier:
                out.update(p.rpartition(".")[0] for p in _stack(u)
                           if p not in own and p.rpartition(".")[2].isdigit())
    return out


def find_one_hot(node, depth: int = 6) -> torch.fx.Node | None:
    """The ``F.one_hot(ids, E)`` node that ``node`` is, or is a view / selection of (following first
    arguments up to ``depth`` nodes back), else None."""
    for _ in range(depth):
        if not isinstance(node, torch.fx.Node):
            return None
        if op_name(node) == "one_hot":
            return node
        node = node.args[0] if node.args else None
    return None


def one_hot_classes(one_hot: torch.fx.Node) -> int | None:
    """``E`` of a ``F.one_hot(ids, E)`` node (None unless a literal positive int)."""
    e = one_hot.args[1] if len(one_hot.args) > 1 else one_hot.kwargs.get("num_classes", -1)
    return e if isinstance(e, int) and e > 0 else None


def _one_hot_of(node, depth: int = 6):
    """``(one_hot node, e)`` when ``node`` is ``mask[e]`` of a view of ``one_hot(index, E)``."""
    if op_name(node) == "getitem" and isinstance(node.args[1], int):
        e = node.args[1]
    elif op_name(node) == "select" and len(node.args) == 3 and node.args[1] == 0 and isinstance(node.args[2], int):
        e = node.args[2]
    else:
        return None, None
    oh = find_one_hot(node.args[0], depth)
    return (oh, e) if oh is not None else (None, None)


def _expert_loops(nodes) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """one_hot node -> the ``routed_rows`` calls reading it (one per iteration), in graph order."""
    out: dict = {}
    for n in nodes:
        if is_routed_rows(n):
            oh, _e = _one_hot_of(n.args[0])
            out.setdefault(oh, []).append(n)
    return out


def _descendants(start: torch.fx.Node, within: set) -> set:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in within and u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _element(fqn: str) -> str | None:
    """The innermost list element holding parameter ``fqn`` (``"layers.0.moe.experts.3"``)."""
    parts = fqn.split(".")
    last = max((i for i, p in enumerate(parts[:-1]) if p.isdigit()), default=None)
    return None if last is None else ".".join(parts[:last + 1])


def _ancestors(start: torch.fx.Node, within: set) -> set:
    seen, todo = set(), [start]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in within and a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _loop_block(nodes, oh, rows) -> MoEBlock | NotAnExpertsBlock:
    # NOTE: one function (101 lines): one walk over an experts loop, proving each step of the pattern against the last
    where = getattr(oh, "name", "a loop over experts")
    if oh is None:
        return NotAnExpertsBlock(f"{rows[0].name}: rows looked up in something else than a one-hot expert mask "
                                 "mask[e] (mask = F.one_hot(top-k ids, E)...)")
    num_experts = int(rows[0].args[1])
    sel = [r.args[0] for r in rows]
    order = {n: i for i, n in enumerate(nodes)}
    es = [_one_hot_of(s)[1] for s in sel]
    if sorted(es) != list(range(num_experts)):
        return NotAnExpertsBlock(f"{where}: the loop visits experts {sorted(es)}, expected each of 0..{num_experts - 1} "
                                 "once (for e in range(E))")
    sel = [sel[es.index(e)] for e in range(num_experts)]
    within = set(nodes)
    down = [_descendants(s, within) | {s} for s in sel]
    # the accumulation: from a fresh buffer, one index_add per expert, each adding that expert's rows
    seeds = [n for n in nodes if op_name(n) in _FRESH and any(op_name(u) in _ACCUMULATE for u in n.users)]
    chain, owner = [], {}
    cur = next((z for z in seeds if any(u.args[0] is z and any(u in d for d in down) for u in z.users)), None)
    while cur is not None:
        nxt = [u for u in cur.users if op_name(u) in _ACCUMULATE and u.args[0] is cur]
        if len(nxt) != 1:
            break
        u = nxt[0]
        hit = [e for e, d in enumerate(down) if all(a in d for a in u.all_input_nodes if a is not cur)]
        if len(hit) != 1 or hit[0] in owner.values():
            return NotAnExpertsBlock(f"{where}: {u.name} does not add the rows of exactly one expert")
        owner[u] = hit[0]
        chain.append(u)
        cur = u
    if sorted(owner.values()) != list(range(num_experts)):
        return NotAnExpertsBlock(f"{where}: the experts' outputs must be accumulated into one fresh tensor, "
                                 "out = torch.zeros_like(x); out.index_add_(0, rows, y) per expert")
    output, seed = chain[-1], chain[0].args[0]
    acc = {e: u for u, e in owner.items()}
    # each iteration: its expert's nodes, plus what only they read (its parameters, export's
    # per-iteration views of the shared inputs: w[rows, idx, None] -> unsqueeze(w) ...)
    hits: dict = {}
    for d in down:
        for n in d:
            hits[n] = hits.get(n, 0) + 1
    iterations = [[n for n in nodes if n in d and hits[n] == 1 and n not in owner] for d in down]
    params: list[list[torch.fx.Node]] = []
    for it in iterations:
        mine, todo = set(it), list(it)
        while todo:
            for a in todo.pop().all_input_nodes:
                if a not in mine and a in within and a.op != "placeholder" and all(u in mine for u in a.users):
                    mine.add(a)
                    todo.append(a)
        params.append([n for n in nodes if n in mine and is_param(n)])
        it[:] = [n for n in nodes if n in mine and not is_param(n)]
    elements = [{_element(p.meta[META_KEY].param.fqn) for p in ps} for ps in params]
    if any(len(el) != 1 or None in el for el in elements) or len(set().union(*elements)) != num_experts \
            or len({next(iter(el)).rpartition(".")[0] for el in elements}) != 1:
        return NotAnExpertsBlock(f"{where}: each iteration must read the parameters of its own element of one "
                                 "module list of experts (experts[e]) and no other parameter")
    shapes = [[(p.meta[META_KEY].param.fqn.removeprefix(next(iter(el))), tuple(tensor_val(p).shape)) for p in ps]
              for el, ps in zip(elements, params)]
    if any(sorted(sh) != sorted(shapes[0]) for sh in shapes):
        return NotAnExpertsBlock(f"{where}: the experts differ in their parameters; expert parallelism splits "
                                 "experts of one shape")
    above = set().union(*(_ancestors(s, within) for s in sel))
    body = set().union(*iterations) | set(chain) | set(sel) | {seed, oh} | (_descendants(oh, within) & above)
    flat = [p for ps in params for p in ps]
    external: list[torch.fx.Node] = []
    grew = True
    while grew:   # what the block reads from outside; metadata of an input (x.dtype) comes inside
        grew, external = False, []
        for n in sorted(body, key=order.__getitem__):
            for a in n.all_input_nodes:
                if a in body or a in flat or a in external:
                    continue
                if a.op == "call_function" and op_name(a) == "getattr" and not isinstance(a.meta.get("val"), int):
                    body.add(a)
                    grew = True
                else:
                    external.append(a)
    leaving = [n for n in body if any(u not in body for u in n.users)]
    if leaving != [output]:
        return NotAnExpertsBlock(f"{where}: {sorted(n.name for n in leaving)} leave the loop over experts, expected "
                                 "only the accumulated tokens")
    tensors = [a for a in external if tensor_val(a) is not None]
    ints = [a for a in tensors if not tensor_val(a).is_floating_point()]
    floats = [a for a in tensors if tensor_val(a).is_floating_point()]
    index = oh.args[0]
    k_shape = tuple(tensor_val(index).shape) if tensor_val(index) is not None else ()
    weights = [a for a in floats if tuple(tensor_val(a).shape) == k_shape]
    xs = [a for a in floats if a not in weights]
    if ints != [index] or len(k_shape) != 2 or len(weights) != 1 or len(xs) != 1 or tensor_val(xs[0]).dim() != 2:
        return NotAnExpertsBlock(f"{where}: its inputs are {[a.name for a in tensors]}, expected tokens [T, H], "
                                 "top-k expert ids and top-k weights [T, k]")
    if tuple(tensor_val(output).shape) != tuple(tensor_val(xs[0]).shape):
        return NotAnExpertsBlock(f"{where}: its output {tuple(tensor_val(output).shape)} is not shaped like its "
                                 f"tokens {tuple(tensor_val(xs[0]).shape)}")
    loop = LoopExperts(oh, sel, iterations, params, [acc[e] for e in range(num_experts)])
    linears = [n for it in iterations for n in it if op_name(n) in ("linear", "matmul", "mm", "addmm")]
    path = next(iter(elements[0])).rpartition(".")[0]
    return MoEBlock(path, sorted(body, key=order.__getitem__), flat, linears, xs[0], index, weights[0],
                    [a for a in external if tensor_val(a) is None], output, num_experts, int(k_shape[1]),
                    kind="loop", loop=loop)


def layer_blocks(gm: torch.fx.GraphModule) -> dict[int, list[MoEBlock | NotAnExpertsBlock]]:
    """Layer index -> its experts blocks, for the layers of a captured graph that have any."""
    by_layer: dict[int, list] = {}
    for n in gm.graph.nodes:
        layer = getattr(n.meta.get(META_KEY), "layer", None)
        if layer is not None:
            by_layer.setdefault(layer, []).append(n)
    return {i: found for i, nodes in sorted(by_layer.items()) if (found := moe_blocks(gm.graph, nodes))}


def expert_layers(gm: torch.fx.GraphModule) -> set[str]:
    """Names of the layers of a captured graph with an experts block (where ``ep`` applies)."""
    from ..ir import graph_info

    layers = graph_info(gm).layers
    return {layers[i].name for i in layer_blocks(gm)}


def split_blocks(gm: torch.fx.GraphModule, layer_ep: dict[int, int]) -> dict[int, list[MoEBlock]]:
    """Layer index -> the experts blocks expert parallelism splits (layers with ``ep > 1``)."""
    if not any(ep > 1 for ep in layer_ep.values()):
        return {}
    return {idx: [b for b in blocks if isinstance(b, MoEBlock)] for idx, blocks in layer_blocks(gm).items()
            if layer_ep.get(idx, 1) > 1}


def keep_whole(blocks: dict[int, list[MoEBlock]], layer_ep: dict[int, int],
               expert_tp: frozenset[int] | set[int] = frozenset()) -> dict[str, str]:
    """Linear node name -> why tensor parallelism leaves it whole: the grouped matmuls and routers
    of ``blocks`` (:func:`split_blocks`: expert parallelism splits them by expert). In the layers
    of ``expert_tp`` (expert tensor parallelism) only the routers: every TP rank routes the same
    tokens, and TP shards the grouped expert weights along their width as at ``ep = 1``."""
    keep: dict[str, str] = {}
    for idx, found in blocks.items():
        ep = layer_ep[idx]
        for b in found:
            if idx not in expert_tp or b.kind != "grouped":
                keep.update({g.name: f"experts split over ep={ep} ranks by expert" for g in b.grouped})
            keep.update({r.name: f"router of experts split over ep={ep} ranks" for r in b.routers()})
    return keep


def describe(blocks: list) -> str:
    """One line for a layer's experts blocks: ``"8 experts top-2 (2 weights)"``, or why ep cannot split them."""
    parts = [f"{b.num_experts} experts top-{b.top_k} ({len(b.params)} weights)" if isinstance(b, MoEBlock)
             else f"experts ep cannot split: {b}" for b in blocks]
    return "; ".join(parts) or "-"
