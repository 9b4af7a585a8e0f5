"""What selective checkpointing keeps of a layer: the outputs of the ops its policy saves.

A layer under ``ckpt: "selective"`` (:func:`galvatron_fx.runtime.checkpointing.selective_checkpoint_layer`)
keeps its inputs, as full checkpointing does, and the outputs of the ops in
:data:`~galvatron_fx.runtime.checkpointing.SAVED_OPS` (matmuls, fused attention kernels); backward
recomputes every other op. :class:`SelectiveSaves` records those outputs while the measurement
(:mod:`.measure`) runs the layer on fake tensors: each ATen op in the set, its output storages and
the fx node running it, and which are the outputs of every second linear matmul (what
``"selective-op"``, torchtitan's op policy, recomputes instead: ``sac_alt_*``). SDPA calls run as the target's kernel (:mod:`.attention_kernels`), so their
outputs are noted from the kernel: a fused kernel's output and log-sum-exp; the math path's two
batched matmuls (the ``[.., s_q, s_kv]`` scores and the output).

:func:`classify` sorts the bytes as the saved-for-backward bytes are: TP-sharded (a column-parallel
or head-split op's output), whole (a row-parallel matmul's partial sums, before their reduction:
whole under SP too) or replicated (split over the sequence under SP). The recompute time is the
forward's minus the saved ops' (:meth:`galvatron_fx.cost.model.CostModel.recompute_time`).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.checkpointing import SAVED_OPS, SecondMatmuls


class SelectiveSaves(TorchDispatchMode):
    """Records the output storages of the ops selective checkpointing saves, by fx node
    (``node``: set by the measurement before each node runs). ``saved``: storage key ->
    ``(node, tensor)``, the first producer of each storage."""

    def __init__(self):
        super().__init__()
        self.node: str | None = None
        self.saved: dict[int, tuple[str | None, torch.Tensor]] = {}
        self.alternate: set[int] = set()   # storages of every second linear matmul's output
        self._second = SecondMatmuls()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            self.note(out, self._second(func))
        return out

    def note(self, out, alternate: bool = False) -> None:
        """Count ``out``'s tensors as saved by the running node (``alternate``: the output of a
        second linear matmul, which ``"selective-op"`` recomputes)."""
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in self.saved:
                    self.saved[key] = (self.node, t)
                    if alternate:
                        self.alternate.add(key)


def classify(layer, saves: SelectiveSaves, itemsize_dtype: torch.dtype | None, p) -> None:
    """Add the recorded outputs to ``p`` (a :class:`~.measure.Point`): ``sac_sharded_elems``,
    ``sac_whole_elems``, ``sac_rep_elems`` (floating elements, in ``itemsize_dtype`` units when
    given), ``sac_other_bytes`` and ``sac_expert_elems`` (those inside experts blocks); the same
    classes of the every-second linear matmuls' outputs again as ``sac_alt_*``."""
    for key, (node, t) in saves.saved.items():
        nbytes = t.untyped_storage().nbytes()
        if not t.dtype.is_floating_point:
            p.sac_other_bytes += nbytes
            continue
        elems = nbytes / (itemsize_dtype or t.dtype).itemsize
        if node in layer.expert_nodes:
            p.sac_expert_elems += elems
        if layer.roles.get(node) == "row":
            kind = "whole"
        elif layer.out_sharded.get(node, False) or layer.in_sharded.get(node, False):
            kind = "sharded"
        else:
            kind = "rep"
        setattr(p, f"sac_{kind}_elems", getattr(p, f"sac_{kind}_elems") + elems)
        if key in saves.alternate:
            setattr(p, f"sac_alt_{kind}_elems", getattr(p, f"sac_alt_{kind}_elems") + elems)


def selective_bytes(m, n: float, s, itemsize: float) -> float:
    """Bytes a selective layer keeps beyond its inputs per device for ``n`` samples under strategy
    ``s`` (``m``: its :class:`~.measure.LayerMeasure`): the sharded outputs over ``tp``, the
    replicated ones over ``tp`` under SP, the whole ones whole; under ``"selective-op"`` without
    the every-second linear matmuls' outputs."""
    rep_div = s.tp if s.sp else 1
    kept = m.sac_sharded_elems(n) / s.tp + m.sac_rep_elems(n) / rep_div + m.sac_whole_elems(n)
    if s.ckpt == "selective-op":
        kept -= m.sac_alt_sharded_elems(n) / s.tp + m.sac_alt_rep_elems(n) / rep_div + m.sac_alt_whole_elems(n)
    return kept * itemsize + m.sac_other_bytes(n)
