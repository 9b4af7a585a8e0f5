"""The process-group cache: one ``torch.distributed`` group per rank set of a layer's layout
(:mod:`galvatron_fx.layout`, re-exported here).

:class:`ProcessGroups` creates one ``torch.distributed`` group per distinct rank set and hands the
same group back afterwards. ``dist.new_group`` is collective over the *whole* world, so every rank
must create the same sets in the same order: :meth:`ProcessGroups.ensure` sorts them first.
"""

from __future__ import annotations

import torch.distributed as dist

from ..distributed import all_gather_single, group_timeout, reduce_scatter_single  # noqa: F401 - the one collective shim
from ..errors import ConfigError
from ..layout import Layout, Ranks, batch_layout, input_layout  # noqa: F401 - re-exported


class ProcessGroups:
    """One process group per distinct rank set, created collectively and cached.

    ``get(ranks)`` returns the group for a set created earlier (``None`` for a single rank: no
    communication is needed). The world group is used for the full set of ranks.
    """

    def __init__(self) -> None:
        self._groups: dict[Ranks, object] = {}
        self._world = None

    def _check_world(self) -> None:
        # NOTE: groups die with the default group; a re-initialised world starts a fresh cache.
        if self._world is not dist.group.WORLD:
            self._groups.clear()
            self._world = dist.group.WORLD

    def ensure(self, rank_sets, *, local: bool = False) -> None:
        """Create every set not yet cached, in sorted order, on every rank (collective over the
        world). ``local=True``: only the members of each set take part (torch's
        ``use_local_synchronization``), for groups made inside a subgroup (cluster profiling)."""
        self._check_world()
        world = dist.get_world_size()
        wanted = sorted({tuple(sorted(s)) for s in rank_sets if len(s) > 1})
        for ranks in wanted:
            if ranks in self._groups:
                continue
            if ranks == tuple(range(world)):
                self._groups[ranks] = dist.group.WORLD
            else:
                self._groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=local,
                                                     timeout=group_timeout())

    def release(self) -> None:
        """Destroy every cached group but the world's: the process then starts over as a fresh one
        (the test pool does so between tests, so that a group one test made cannot hide another's
        missing one; every rank must be done with the groups). A rank outside a group holds no
        group for it (``None`` from a group made with local synchronization, or torch's non-member
        marker): destroying ``None`` would destroy the world. Groups of a world since torn down are
        gone with it."""
        if self._world is dist.group.WORLD:
            for g in self._groups.values():
                if g is not None and g is not dist.group.WORLD and g != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)
        self._groups.clear()

    def get(self, ranks: Ranks):
        ranks = tuple(sorted(ranks))
        if len(ranks) <= 1:
            return None
        self._check_world()
        try:
            return self._groups[ranks]
        except KeyError:
            raise ConfigError(f"internal: no process group for ranks {ranks}; ProcessGroups.ensure() "
                              "must create every group before use") from None


#: the process-wide cache (groups outlive one transform and are reused by the next)
GROUPS = ProcessGroups()


def group(ranks: Ranks):
    """The cached process group of ``ranks`` (``None`` for one rank)."""
    return GROUPS.get(ranks)
