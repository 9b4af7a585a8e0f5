"""Per-layer measurement on fake tensors: FLOPs, bytes saved for backward, boundary bytes.

:func:`measure_layer` runs an extracted layer (:mod:`galvatron_fx.cost.extract`) forward and
backward under :class:`~torch._subclasses.fake_tensor.FakeTensorMode` (no real memory) with
:class:`~torch.utils.flop_counter.FlopCounterMode`, at micro-batch sizes ``(1, 2)``, and fits every
figure as ``a * n + c`` in the number of samples ``n`` (exact for transformer layers). When the
graph bakes in the capture batch size (e.g. ``view(8, ...)``) the run happens at the capture batch
only and figures are taken proportional to ``n`` (the failing first try logs nothing:
:func:`quiet_probe`).

Bytes saved for backward are the unique storages packed by
:func:`torch.autograd.graph.saved_tensors_hooks`, identified by the storage's C pointer
(``untyped_storage()._cdata``, stable across views and valid on fake tensors), parameters excluded.
Each saved storage is attributed to the node that produced it (or, for a buffer made inside an op,
such as an attention log-sum-exp or a norm's statistics, to the node running) and classified as
TP-sharded or replicated with :func:`galvatron_fx.cost.extract.roles_from_analysis`. Floating-point bytes are
kept as element counts so the cost model can price them in any dtype.

FLOPs: ``FlopCounterMode`` counts matmuls and convolutions; SDPA calls run as the target device's
kernel (:mod:`.attention_kernels`: ``attention``, e.g. flash attention on an A100), which fixes
both what they save for backward and the FLOPs they execute (``attn_fwd_flops`` /
``attn_bwd_flops``, kept apart: the cost model prices them at the attention kernel's rate).
Elementwise ops and norms count 0 FLOPs.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from ..sharding.state import op_name
from .attention_kernels import run_stand_in
from .backward_peak import BackwardPeak
from .extract import LayerGraph
from .flop_rules import flop_counter
from .op_work import OpWork, by_split, record_op_work
from .selective import SelectiveSaves
from .selective import classify as classify_selective
from .storage_keys import StorageMap

aten = torch.ops.aten
MEASURE_SIZES = (1, 2)


@dataclass
class Point:
    """Raw figures of one layer at one micro-batch size ``n`` (samples); bytes unless noted."""

    n: int
    fwd_flops_sharded: float = 0.0   # FLOPs of ops TP splits (column/row matmuls, attention)
    fwd_flops_rep: float = 0.0       # FLOPs of ops TP replicates
    bwd_flops: float = 0.0
    saved_sharded_elems: float = 0.0  # floating-point elements saved for backward, TP-sharded
    saved_rep_elems: float = 0.0      # floating-point elements saved for backward, replicated
    saved_gathered_elems: float = 0.0  # replicated inputs saved by column-parallel ops (whole under SP)
    saved_other_bytes: float = 0.0    # non-floating saved bytes (indices, masks), replicated
    input_elems: float = 0.0          # floating activation / graph inputs (kept by checkpointing)
    output_elems: float = 0.0         # floating outputs consumed by later layers
    # floating outputs of the ops where a trainable parameter meets the activations: their gradients
    # are what a split (zero-bubble) backward holds from the input- to the weight-gradient pass
    wgrad_sharded_elems: float = 0.0
    wgrad_rep_elems: float = 0.0
    wgrad_whole_elems: float = 0.0    # row-parallel outputs: partial sums, whole even under SP
    wgrad_row_bias_elems: float = 0.0  # row-parallel outputs with a bias (a second node under TP)
    saved_expert_elems: float = 0.0   # floating elements saved inside experts blocks (also counted above)
    fwd_flops_expert: float = 0.0     # forward FLOPs inside experts blocks (also counted above)
    # outputs of the ops selective checkpointing saves (.selective): floating elements TP-sharded,
    # whole (row-parallel partial sums), replicated, inside experts blocks; other bytes
    sac_sharded_elems: float = 0.0
    sac_whole_elems: float = 0.0
    sac_rep_elems: float = 0.0
    sac_expert_elems: float = 0.0
    sac_other_bytes: float = 0.0
    sac_alt_sharded_elems: float = 0.0   # of those, every second linear matmul's ("selective-op" recomputes)
    sac_alt_whole_elems: float = 0.0
    sac_alt_rep_elems: float = 0.0
    attn_fwd_flops: float = 0.0       # SDPA kernels' FLOPs as the target's kernel executes them (sharded)
    attn_bwd_flops: float = 0.0
    kernels: tuple = ()               # the attention kernels of its SDPA calls
    # the ops' work as a device executes it (.op_work): forward matmuls with the dim TP splits
    # ("n" column-, "k" row-parallel, "b" a batch of heads, "" none) and (batch, m, n, k); bytes the
    # other ops move, forward (TP-sharded / replicated) and backward
    fwd_gemms: list = field(default_factory=list)
    fwd_traffic_sharded: float = 0.0
    fwd_traffic_rep: float = 0.0
    bwd_traffic: float = 0.0
    # the same ops' bytes as torch.compile fuses them (.fusion): forward TP-sharded / replicated, backward
    fused_fwd_traffic_sharded: float = 0.0
    fused_fwd_traffic_rep: float = 0.0
    fused_bwd_traffic: float = 0.0
    fwd_allreduce_elems: list[float] = field(default_factory=list)  # per TP collective, forward
    bwd_allreduce_elems: list[float] = field(default_factory=list)  # per TP collective, backward
    bwd_excess_elems: float = 0.0     # the backward's working set beyond the saved tensors (.backward_peak)


@dataclass(frozen=True)
class Affine:
    """``a * n + c``."""

    a: float
    c: float

    def __call__(self, n):
        return self.a * n + self.c

    @staticmethod
    def fit(n1: float, y1: float, n2: float | None = None, y2: float | None = None) -> Affine:
        if n2 is None or n2 == n1:
            return Affine(y1 / n1, 0.0)
        a = (y2 - y1) / (n2 - n1)
        return Affine(a, y1 - a * n1)


@dataclass
class LayerMeasure:
    """Affine fits (in samples ``n``) of every :class:`Point` figure of one layer signature."""

    signature: str
    sizes: tuple[int, ...]
    fits: dict[str, Affine]
    fwd_allreduce: list[Affine]
    bwd_allreduce: list[Affine]
    kernels: tuple[str, ...] = ()   # the attention kernels of its SDPA calls (.attention_kernels)
    fwd_gemms: tuple = ()           # (split dim, (batch, m, n, k) as Affines): Point.fwd_gemms fitted

    def __getattr__(self, name: str) -> Affine:
        fits = self.__dict__.get("fits", {})
        if name in fits:
            return fits[name]
        raise AttributeError(name)

    def to_dict(self) -> dict:
        return {"signature": self.signature, "sizes": list(self.sizes),
                "fits": {k: [v.a, v.c] for k, v in self.fits.items()},
                "fwd_allreduce": [[v.a, v.c] for v in self.fwd_allreduce],
                "bwd_allreduce": [[v.a, v.c] for v in self.bwd_allreduce], "kernels": list(self.kernels)}


_SCALARS = ("fwd_flops_sharded", "fwd_flops_rep", "bwd_flops", "saved_sharded_elems", "saved_rep_elems",
            "saved_gathered_elems",
            "saved_other_bytes", "input_elems", "input_other_bytes", "output_elems", "wgrad_sharded_elems",
            "wgrad_rep_elems", "wgrad_whole_elems", "wgrad_row_bias_elems", "saved_expert_elems",
            "fwd_flops_expert", "attn_fwd_flops", "attn_bwd_flops", "fwd_traffic_sharded", "fwd_traffic_rep",
            "bwd_traffic", "sac_sharded_elems", "sac_whole_elems", "sac_rep_elems", "sac_expert_elems",
            "sac_other_bytes", "sac_alt_sharded_elems", "sac_alt_whole_elems", "sac_alt_rep_elems",
            "bwd_excess_elems", "fused_fwd_traffic_sharded", "fused_fwd_traffic_rep", "fused_bwd_traffic")


def measure_layer(layer: LayerGraph, sizes: tuple[int, ...] = MEASURE_SIZES,
                  compute_dtype: torch.dtype | None = None, attention: str = "cpu") -> LayerMeasure:
    """Fit the layer's figures over ``sizes`` samples (see the module docstring). ``compute_dtype``:
    a mixed-precision run (see :func:`measure_point`); ``attention``: the device family whose SDPA
    kernels are priced (:data:`.attention_kernels.TARGETS`)."""
    try:
        with quiet_probe():
            points = [measure_point(layer, n, compute_dtype, attention) for n in sizes]
    except Exception:  # noqa: BLE001 - a batch size baked into the graph: proportional fallback
        points = [measure_point(layer, layer.batch, compute_dtype, attention)]
    p1, p2 = points[0], points[-1] if len(points) > 1 else None

    def fit(y1, y2):
        return Affine.fit(p1.n, y1, p2.n if p2 else None, y2)

    fits = {k: fit(getattr(p1, k), getattr(p2, k) if p2 else None) for k in _SCALARS}
    fwd = [fit(y, p2.fwd_allreduce_elems[i] if p2 else None) for i, y in enumerate(p1.fwd_allreduce_elems)]
    bwd = [fit(y, p2.bwd_allreduce_elems[i] if p2 else None) for i, y in enumerate(p1.bwd_allreduce_elems)]
    return LayerMeasure(layer.signature, tuple(p.n for p in points), fits, fwd, bwd, points[0].kernels,
                        _fit_gemms(p1, p2))


def _fit_gemms(p1: Point, p2: Point | None) -> tuple:
    """Each forward matmul's dims as ``Affine`` fits in the samples (proportional in ``m``, the
    rows, when only one point was measured or the two runs' matmuls do not pair up)."""
    if p2 is None or [k for k, _ in p1.fwd_gemms] != [k for k, _ in p2.fwd_gemms]:
        return tuple((k, (Affine(0, d[0]), Affine(d[1] / p1.n, 0), Affine(0, d[2]), Affine(0, d[3])))
                     for k, d in p1.fwd_gemms)
    return tuple((k, tuple(Affine.fit(p1.n, a, p2.n, b) for a, b in zip(d1, d2)))
                 for (k, d1), (_, d2) in zip(p1.fwd_gemms, p2.fwd_gemms))


PROBE_LOGGERS = ("torch._subclasses.fake_tensor",)
"""Loggers :func:`quiet_probe` silences: FakeTensorMode logs every failing meta kernel with its
traceback before raising, which for a probe that is expected to fail reads as a crash."""


def _drop(_record: logging.LogRecord) -> bool:
    return False


@contextlib.contextmanager
def quiet_probe():
    """Silence :data:`PROBE_LOGGERS` while a run that may fail, and whose failure is handled, runs
    (e.g. a layer at a batch size other than one baked into its graph)."""
    loggers = [logging.getLogger(name) for name in PROBE_LOGGERS]
    for lg in loggers:
        lg.addFilter(_drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_drop)


def saved_bytes(fn, exclude=()) -> int:
    """Bytes of the unique storages autograd saves for backward while ``fn()`` runs (real tensors),
    leaving out the storages of the tensors in ``exclude`` (parameters). Used to check the model."""
    excluded = {t.untyped_storage()._cdata for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in excluded:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _numel(t) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


class _Recorder(torch.fx.Interpreter):
    """Runs the layer node by node, noting which node produced each storage and each node's FLOPs.
    SDPA calls run as the ``attention`` target's kernel would (:mod:`.attention_kernels`): their
    kernels and FLOPs are noted in ``attention`` (node -> ``(kernel, forward, backward)``)."""

    def __init__(self, gm, counter: FlopCounterMode, attention: str = "cpu"):
        super().__init__(gm)
        self.counter = counter
        self.target = attention
        self.producer = StorageMap()   # storage key -> the node that made it (forgotten when freed)
        self.current: str | None = None
        self.node_flops: dict[str, int] = {}
        self.values: dict[str, object] = {}
        self.attention: dict[str, tuple[str, float, float]] = {}
        self.work = None   # an OpWork mode to tell which node runs
        self.saves = None  # a SelectiveSaves mode, likewise

    def call_function(self, target, args, kwargs):
        node = self.current_node
        if op_name(node) == "sdpa":
            out, kernel, (fwd, bwd), outputs = run_stand_in(self.target, args, kwargs)
            self.attention[node.name] = (kernel, fwd, bwd)
            if self.work is not None:
                self.work.kernel(pytree.tree_leaves((args, kwargs)), [out])
            if self.saves is not None:
                self.saves.note(outputs)
            return out
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        self.current, self.current_node = n.name, n
        for mode in (self.work, self.saves):
            if mode is not None:
                mode.node = n.name
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        self.node_flops[n.name] = self.counter.get_total_flops() - before
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.producer.setdefault(self.producer.key(t), n.name)
        self.values[n.name] = out
        return out


def make_inputs(layer: LayerGraph, n: int, *, device=None, dtype=None, real: bool = False,
                shard: dict[str, tuple[int, int]] | None = None) -> list[torch.Tensor]:
    """Tensors for the layer's placeholders with batched dims set to ``n`` samples.

    Call under a FakeTensorMode for fake tensors, or with ``real=True`` for real random values
    (floats ~ N(0, 0.02), integers 0), all on ``device`` (default: :attr:`LayerGraph.device`, the
    CPU for a meta-device model). ``dtype`` replaces floating dtypes; ``shard`` maps a placeholder to
    ``(dim, tp)`` to divide that dim (tensor-parallel shards).
    """
    out = []
    dev = torch.device(device) if device is not None else layer.device
    for spec in layer.inputs:
        shape = list(spec.shape)
        if spec.batched:
            shape[0] = n
        if shard and spec.name in shard:
            dim, tp = shard[spec.name]
            shape[dim] //= tp
        dt = dtype if (dtype is not None and spec.dtype.is_floating_point) else spec.dtype
        if dt.is_floating_point:
            t = torch.randn(shape, dtype=dt, device=dev) * 0.02 if real else torch.empty(shape, dtype=dt, device=dev)
        else:
            t = torch.zeros(shape, dtype=dt, device=dev)
        out.append(t.requires_grad_(spec.requires_grad and dt.is_floating_point))
    return out


def measure_point(layer: LayerGraph, n: int, compute_dtype: torch.dtype | None = None,
                  attention: str = "cpu") -> Point:
    """Run the layer on fake CPU tensors with ``n`` samples; see the module docstring.

    ``compute_dtype`` (mixed precision): the layer runs as the runtime runs it
    (:mod:`galvatron_fx.runtime.precision`): floating inputs and parameters in that dtype, under
    ``torch.autocast``; saved floating tensors are then counted in units of the compute dtype's
    itemsize (an fp32 tensor autocast keeps, e.g. a loss's log-softmax, counts twice its elements),
    so ``elements * itemsize`` is their exact bytes. NOTE: the autocast op policy is the CPU's (the
    fake tensors live there); CUDA's keeps a few more ops (norms, softmax) in fp32.
    """
    # NOTE: one function (88 lines): one fake-tensor run of the layer recording FLOPs, saved bytes and op work together
    p = Point(n)
    # NOTE: fake tensors live on the CPU (also for meta-device models); the device constants the
    # graph baked in are retargeted there (LayerGraph.on_device). SDPA calls do not dispatch on
    # them: they run as the target device's kernel would (attention_kernels.StandIn), which saves
    # what that kernel saves (flash: q, k, v, out, log-sum-exp) and never a score matrix it does
    # not store.
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = make_inputs(layer, n, dtype=compute_dtype)
        param_storages = {a.untyped_storage()._cdata for a, s in zip(args, layer.inputs)
                          if s.kind in ("param", "buffer")}
        saved: dict[int, tuple] = {}
        counter = flop_counter()
        rec = _Recorder(layer.on_device(), counter, attention)

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in param_storages and key not in saved:
                saved[key] = (rec.producer.get(key), rec.current, t)
            return t

        autocast = torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype is not None)
        work = rec.work = OpWork(fused_dropout=attention != "cpu")
        saves = rec.saves = SelectiveSaves()
        with counter, autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), work, saves:
            outs = rec.run(*args)
        work.node = None
        work.work.fusion.next_pass()
        rec.saves = None
        classify_selective(layer, saves, compute_dtype, p)
        outs = [o for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor)]
        p.kernels = tuple(dict.fromkeys(k for k, _, _ in rec.attention.values()))
        p.attn_fwd_flops = sum(f for _, f, _ in rec.attention.values())
        p.attn_bwd_flops = sum(b for _, _, b in rec.attention.values())
        record_op_work(layer, work.work, p)
        for name, v in rec.node_flops.items():
            if name in layer.expert_nodes:
                p.fwd_flops_expert += v
            if layer.roles.get(name) in ("column", "row") or layer.in_sharded.get(name, False):
                p.fwd_flops_sharded += v
            else:
                p.fwd_flops_rep += v
        for _key, (producer, running, t) in saved.items():
            nbytes = t.untyped_storage().nbytes()
            if not t.dtype.is_floating_point:
                p.saved_other_bytes += nbytes
                continue
            elems = nbytes / (compute_dtype or t.dtype).itemsize
            if (producer or running) in layer.expert_nodes:
                p.saved_expert_elems += elems
            if producer is not None:
                sharded = layer.out_sharded.get(producer, False)
            else:
                sharded = layer.in_sharded.get(running, False)
            if running in layer.gathered:
                # NOTE: the rewrite hands this op its input gathered whole (the logits before the
                # loss), so what it saves is whole, under SP too
                p.saved_gathered_elems += elems
            elif sharded:
                p.saved_sharded_elems += elems
            elif layer.roles.get(running) == "column":
                # NOTE: under SP the runtime all-gathers the sequence before a column-parallel op,
                # which saves that gathered (whole-sequence) tensor for its backward
                p.saved_gathered_elems += elems
            else:
                p.saved_rep_elems += elems
        p.input_elems = sum(_numel(a) for a, s in zip(args, layer.inputs)
                            if s.kind in ("activation", "graph_input") and s.dtype.is_floating_point)
        p.input_other_bytes = sum(a.untyped_storage().nbytes() for a, s in zip(args, layer.inputs)
                                  if s.kind in ("activation", "graph_input") and not s.dtype.is_floating_point)
        p.output_elems = sum(_numel(o) for o in outs if o.dtype.is_floating_point)
        _weight_gradient_inputs(layer, rec.values, p)
        _tp_collectives(layer, rec.values, p)
        grads = [o for o in outs if o.requires_grad]
        if grads:
            seeds = [torch.ones_like(o) for o in grads]
            peak = BackwardPeak((compute_dtype or next((a.dtype for a in args if a.is_floating_point()),
                                                       torch.float32)).itemsize)
            # NOTE: only autograd holds the saved tensors now (each freed as its node has run)
            peak.watch_saved(t.untyped_storage() for _, _, t in saved.values())
            saved, saves.saved, rec.values, t = {}, {}, {}, None
            with counter, work, peak:
                before = counter.get_total_flops()
                torch.autograd.backward(grads, seeds)
                p.bwd_flops = counter.get_total_flops() - before
            p.bwd_traffic = work.work.traffic.get(None, 0.0)
            p.bwd_excess_elems = peak.excess(a.grad for a, s in zip(args, layer.inputs) if s.kind == "param")
        fused = work.work.fusion.traffic()   # after the backward: it reads what the forward saved
        p.fused_fwd_traffic_sharded, p.fused_fwd_traffic_rep = by_split(layer, fused)
        p.fused_bwd_traffic = fused.get(None, 0.0)
    return p


def _weight_gradient_inputs(layer: LayerGraph, values: dict, p: Point) -> None:
    """Elements of the outputs of the nodes where a trainable parameter (or a value computed from
    parameters only) meets an activation: torch's split backward keeps the gradients of these
    outputs from ``I`` to ``W`` (its parameter groups' intermediates). TP-sharded as the node's
    output is."""
    trainable = {i.name for i in layer.inputs if i.kind == "param" and i.requires_grad}
    other = {i.name for i in layer.inputs if i.kind in ("param", "buffer") and i.name not in trainable}
    weight_only: set[str] = set()   # values computed from trainable parameters (and constants) only
    for n in layer.gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        reads = {a.name for a in n.all_input_nodes}
        if not reads or not (reads & (trainable | weight_only)):
            continue
        if reads <= trainable | weight_only | other:
            weight_only.add(n.name)
            continue
        elems = sum(_numel(t) for t in pytree.tree_leaves(values.get(n.name))
                    if isinstance(t, torch.Tensor) and t.dtype.is_floating_point)
        if layer.roles.get(n.name) == "row":
            p.wgrad_whole_elems += elems   # before its all-reduce / reduce-scatter: whole
            if len(reads & trainable) > 1:   # its bias: under TP added after the reduction
                p.wgrad_row_bias_elems += elems
        elif layer.out_sharded.get(n.name, False):
            p.wgrad_sharded_elems += elems
        else:
            p.wgrad_rep_elems += elems


def _tp_collectives(layer: LayerGraph, values: dict, p: Point) -> None:
    """Megatron's TP collectives: an all-reduce of each row-parallel / vocab-parallel output in
    forward, and of each replicated input of column-parallel ops (once per tensor) in backward.
    A vocabulary-parallel cross entropy all-reduces, in forward, the max of every token and then
    its stacked sums (of exps, the target logit and, with label smoothing, the logits): ``tokens``
    and ``2 x tokens`` (``3 x``) elements (:mod:`galvatron_fx.runtime.vocab_parallel`); its
    backward is local."""
    names = {i.name for i in layer.inputs}
    col_inputs: list[str] = []
    for node in layer.gm.graph.nodes:
        role = layer.roles.get(node.name)
        if role in ("row", "vocab"):
            p.fwd_allreduce_elems.append(_numel(values[node.name]))
        elif role == "vocab_loss":
            from ..sharding.losses import bind_cross_entropy

            ce = bind_cross_entropy(node)
            tokens = _numel(values.get(ce.target.name)) if isinstance(ce.target, torch.fx.Node) else 1
            p.fwd_allreduce_elems += [tokens, (3 if ce.label_smoothing else 2) * tokens]
        elif role == "column":
            src = node.args[0]
            if isinstance(src, torch.fx.Node) and src.name not in col_inputs:
                col_inputs.append(src.name)
    for name in col_inputs:
        val = values.get(name)
        if val is None and name in names:
            continue  # a graph input (data): no gradient to reduce
        if isinstance(val, torch.Tensor) and val.requires_grad:
            p.bwd_allreduce_elems.append(_numel(val))
