"""Rank layout of a layer: which ranks form its TP, DP, EP and CP groups, which batch slice a rank holds.

Rank layout (fixed: the cost model and the runtime read it from here):

* pipeline stages are outermost: stage ``s`` of ``pp`` owns the consecutive global ranks
  ``[s * N, (s + 1) * N)`` with ``N = world_size / pp`` (``pp = 1`` here: one stage, all ranks);
* inside a stage, a layer with strategy ``(tp, dp)`` puts its TP groups on *consecutive* ranks:
  the TP group of local rank ``r`` is ``[r // tp * tp, r // tp * tp + tp)``;
* its DP group is the strided set ``{r % tp + k * tp  for k in range(dp)}``;
* the batch slice a rank holds is number ``r // tp`` of ``dp`` equal slices along dim 0 (all ranks
  of one TP group hold the same samples); with sequence parallelism (``sp``) a rank of a TP group
  also holds only slice ``r % tp`` of ``tp`` along the sequence dim 1;
* with context parallelism (``cp``, dividing ``dp``) the DP ranks ``k`` of a TP position form CP
  groups of ``cp`` consecutive members: ``k // cp`` picks the batch slice (``dp / cp`` of them),
  ``k % cp`` the sequence shard (:func:`galvatron_fx.runtime.context_parallel.seq_positions`);
  :meth:`Layout.batch_slices` is where the batch slices live (``tp * cp`` ranks share one).

NOTE: TP innermost (consecutive ranks) is the Megatron / Galvatron convention: TP talks every
layer, twice per pass, so it gets the closest devices (same node, NVLink); DP talks once per step.

Pure (integers and tuples): the cost model prices these groups and the runtime
(:mod:`galvatron_fx.runtime.groups`) creates their process groups, from this one module.
"""

from __future__ import annotations

from dataclasses import dataclass

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Where a layer's data lives: ``tp`` x ``dp`` ranks of one stage, ``sp`` on/off.

    ``base`` is the stage's first global rank (0 for ``pp = 1``). ``etp``: expert tensor
    parallelism (:attr:`galvatron_fx.plan.LayerPlan.expert_tp`): each expert weight is sharded over
    the TP group as well as split by expert over the EP group.
    """

    tp: int
    dp: int
    sp: bool = False
    base: int = 0
    ep: int = 1
    cp: int = 1
    etp: bool = False
    shard: int = 0   # HSDP: ZeRO over shard consecutive DP ranks (0: the whole DP group)

    @property
    def size(self) -> int:
        return self.tp * self.dp

    def local(self, rank: int) -> int:
        return rank - self.base

    def tp_ranks(self, rank: int) -> Ranks:
        """Global ranks of ``rank``'s TP group (consecutive)."""
        start = self.base + self.local(rank) // self.tp * self.tp
        return tuple(range(start, start + self.tp))

    def dp_ranks(self, rank: int) -> Ranks:
        """Global ranks of ``rank``'s DP group (stride ``tp``)."""
        first = self.base + self.local(rank) % self.tp
        return tuple(range(first, first + self.tp * self.dp, self.tp))

    def zero_ranks(self, rank: int) -> Ranks:
        """Global ranks sharing ``rank``'s ZeRO shards: its DP group, or under HSDP (``shard``) the
        ``shard`` consecutive members of it that ``rank`` is among (the DP ranks of one node)."""
        dp = self.dp_ranks(rank)
        if not self.shard or self.shard == self.dp:
            return dp
        start = self.batch_index(rank) // self.shard * self.shard
        return dp[start:start + self.shard]

    def replica_ranks(self, rank: int) -> Ranks:
        """Global ranks holding the same ZeRO shard as ``rank`` under HSDP (one per shard group:
        every ``shard``-th DP rank); ``(rank,)`` without HSDP."""
        if not self.shard or self.shard == self.dp:
            return (rank,)
        return self.dp_ranks(rank)[self.batch_index(rank) % self.shard::self.shard]

    def ep_ranks(self, rank: int) -> Ranks:
        """Global ranks of ``rank``'s EP group: ``ep`` consecutive members of its DP group."""
        dp = self.dp_ranks(rank)
        start = self.batch_index(rank) // self.ep * self.ep
        return dp[start:start + self.ep]

    def expert_dp_ranks(self, rank: int) -> Ranks:
        """Global ranks holding the same expert weights as ``rank`` (every ``ep``-th DP rank; every
        TP rank, or with ``etp`` the same TP position): an expert weight's gradient is summed over them."""
        e = self.batch_index(rank) % self.ep
        tps = (self.tp_index(rank),) if self.etp else range(self.tp)
        return tuple(self.base + t + b * self.tp for b in range(e, self.dp, self.ep) for t in tps)

    def expert_ranks(self, rank: int) -> Ranks:
        """Global ranks holding the pieces of ``rank``'s expert weights: its EP group, and with
        ``etp`` each member's TP group (``ep * tp`` consecutive ranks, EP-major)."""
        if not self.etp:
            return self.ep_ranks(rank)
        return tuple(t for r in self.ep_ranks(rank) for t in self.tp_ranks(r))

    def cp_ranks(self, rank: int) -> Ranks:
        """Global ranks of ``rank``'s CP group: ``cp`` consecutive members of its DP group (the same
        samples, one sequence shard each, in shard order)."""
        dp = self.dp_ranks(rank)
        start = self.batch_index(rank) // self.cp * self.cp
        return dp[start:start + self.cp]

    def cp_index(self, rank: int) -> int:
        """Which sequence shard ``rank`` holds (0 without context parallelism)."""
        return self.batch_index(rank) % self.cp

    def batch_slices(self) -> Layout:
        """Where the batch slices live: ``tp * cp`` consecutive ranks hold one of ``dp / cp``."""
        return self if self.cp == 1 else Layout(self.tp * self.cp, self.dp // self.cp, self.sp, self.base)

    def batch_index(self, rank: int) -> int:
        """``rank``'s position in its DP group: which of the ``dp`` batch slices it holds (without
        context parallelism; :meth:`batch_slices` otherwise)."""
        return self.local(rank) // self.tp

    def tp_index(self, rank: int) -> int:
        """Position of ``rank`` in its TP group (its sequence slice under ``sp``)."""
        return self.local(rank) % self.tp


def batch_layout(tp: int, dp: int, sp: bool = False, base: int = 0, *, whole_batch: bool = False,
                 cp: int = 1) -> Layout:
    """Where a layer's batched values live: ``Layout(tp, dp, sp, base)``, or for a layer that mixes
    the samples of a batch (``whole_batch``: :func:`galvatron_fx.batch_symbol.coupling`) every
    sample on every rank of its ``tp * dp`` (``Layout(tp * dp, 1)``): it computes on the gathered
    batch, replicated over its DP group, its parameters still sharded and reduced over that group
    (each rank's gradient is the whole batch's: the store divides it by ``dp``)."""
    return Layout(tp * dp, 1, sp, base) if whole_batch and dp > 1 else Layout(tp, dp, sp, base, cp=cp)


def input_layout(stage_size: int, micro_batch: int, base: int = 0) -> Layout:
    """Where graph inputs (and values crossing a pipeline-stage boundary) arrive: each of the
    stage's ranks holds one slice of a micro-batch (``Layout(1, N)``, ``DistributedSampler``'s
    split), or, when the micro-batch has fewer samples than the stage has ranks (context
    parallelism: a rank may hold a fraction of a sample), groups of ``k`` consecutive ranks share
    one slice (``Layout(k, N / k)``, the smallest ``k`` that divides the micro-batch)."""
    k = next((k for k in range(1, stage_size + 1) if stage_size % k == 0 and micro_batch % (stage_size // k) == 0),
             stage_size)
    return Layout(k, stage_size // k, False, base)
