"""The process grid of train.py: torch.arange(world).view(pp, dp, cp, tp), its groups.

TP varies fastest, then CP, so TP and CP peers share a node and its NVLink (as
Megatron-LM orders them); PP varies slowest, so only pipeline sends cross nodes.
rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. CP ranks hold the same
weights and different tokens of the same sequences, so gradients are averaged, and
ZeRO shards, over the DP x CP ranks: dp_cp_group (dp_group itself when cp = 1, and
cp_group itself when dp = 1).

A few world-wide calls: each dimension's groups come from ONE call (new_groups), so
startup makes O(dimensions) world-wide collectives, not O(world). On NCCL bound to a
GPU (init_process_group's device_id, as support/distributed binds it) every new_group
is a world-wide ncclCommSplit, non-members included: one per group made 448 of them at
1,024 GPUs (tp 8, pp 8, dp 16); dist.split_group cuts a whole dimension in one, every
rank calling it in the same order with the same lists (NCCL's rule), as torch's
DeviceMesh does. Unbound (gloo on CPU) split_group refuses, and a new_group is no
collective: a non-member returns at once, members meet through the store alone.
(new_subgroups_by_enumeration is a loop of new_group; use_local_synchronization=True
hangs a bound NCCL, whose members split the world's communicator without the rest.)
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Grid:
    """This rank's place in the grid and its groups (None: a group of one)."""

    rank: int = 0
    world: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    dp_group: object = None
    tp_group: object = None
    pp_group: object = None
    cp_group: object = None  # The ring of 08: the same dp, tp, pp; every cp_rank.
    dp_cp_group: object = None  # Gradients' average and ZeRO's shards (dp x cp ranks).
    embed_group: object = None  # The {first, last} stage, holding the tied embeddings.

    @property
    def world_size(self) -> int:  # The sizes by the names every file uses.
        return self.world

    @property
    def dp_size(self) -> int:
        return self.dp

    @property
    def tp_size(self) -> int:
        return self.tp

    @property
    def pp_size(self) -> int:
        return self.pp

    @property
    def cp_size(self) -> int:
        return self.cp

    @property
    def pp_is_first(self) -> bool:
        """This rank holds the first pipeline stage (the embeddings)."""
        return self.pp_rank == 0

    @property
    def pp_is_last(self) -> bool:
        """This rank holds the last pipeline stage (the head and the loss)."""
        return self.pp_rank == self.pp - 1

    @property
    def dp_cp(self) -> int:
        """The ranks that hold the same weights: the size of dp_cp_group."""
        return self.dp * self.cp

    def all_reduce_sum(self, t: torch.Tensor, dim: str) -> torch.Tensor:
        """t SUMmed in place over this rank's group of `dim` ("pp", "dp_cp", ...): a
        no-op for a group of one. Never AVG: gloo lacks it."""
        if getattr(self, dim) > 1:
            dist.all_reduce(t, group=getattr(self, f"{dim}_group"))
        return t


def build_grid(
    pp: int, dp: int, tp: int, rank: int, world: int, embedding_group, cp: int = 1
) -> Grid:
    """Every rank makes every dimension's groups in the same order (see the top), one
    call a dimension, and keeps its own. `embedding_group(pp_rank_lists)` is 05's: it
    makes the {first, last} stage group of every pipeline and returns this rank's (or
    None)."""
    grid = Grid(rank=rank, world=world, dp=dp, tp=tp, pp=pp, cp=cp)
    if world == 1:
        return grid
    ranks = torch.arange(world).view(pp, dp, cp, tp)  # ranks[pp_r, dp_r, cp_r, tp_r]
    where = (ranks == rank).nonzero()[0].tolist()
    grid.pp_rank, grid.dp_rank, grid.cp_rank, grid.tp_rank = where
    grid.tp_group = new_groups(ranks.reshape(-1, tp).tolist())  # ranks[p, d, c, :]
    dp_lists = ranks.permute(0, 2, 3, 1).reshape(-1, dp).tolist()  # ranks[p, :, c, t]
    grid.dp_group = new_groups(dp_lists)
    pp_lists = ranks.permute(1, 2, 3, 0).reshape(-1, pp).tolist()  # ranks[:, d, c, t]
    grid.pp_group = new_groups(pp_lists)
    grid.embed_group = embedding_group(pp_lists)  # None at pp = 1: no second copy.
    grid.dp_cp_group = grid.dp_group
    if cp > 1:  # Created after the others, so cp = 1 makes the groups it always made.
        cp_lists = ranks.permute(0, 1, 3, 2).reshape(-1, cp).tolist()  # [p, d, :, t]
        grid.cp_group = new_groups(cp_lists)
        grid.dp_cp_group = grid.cp_group  # dp = 1: the same ranks: no second group.
    if cp > 1 and dp > 1:  # dp and cp alike on every rank: every rank makes these.
        dp_cp_lists = ranks.permute(0, 3, 1, 2).reshape(-1, dp * cp).tolist()
        grid.dp_cp_group = new_groups(dp_cp_lists)  # ranks[p, :, :, t]
    return grid


def bound_to_device() -> bool:
    """The world's communicator is bound to a GPU (NCCL's eager init): groups split it."""
    return dist.group.WORLD.bound_device_id is not None


def world_timeout():
    """The timeout init_process_group gave the world (support/distributed passes
    train.py's --timeout-minutes): a group made without one waits torch's default
    instead, 10 minutes on NCCL and 30 on gloo, however short the world's."""
    world = dist.group.WORLD
    return world._get_backend(world._device_types[0]).options._timeout


def new_groups(rank_lists: list):
    """Groups of the ranks in each list (disjoint lists), made in one world-wide call
    when bound (see the top): -> this rank's group, or None if it is in none. Every rank
    passes the same lists."""
    timeout = world_timeout()  # Not torch's default: the world's (--timeout-minutes).
    if bound_to_device():
        return dist.split_group(split_ranks=rank_lists, timeout=timeout)  # one split
    rank = dist.get_rank()
    groups = [dist.new_group(m, timeout=timeout) for m in rank_lists]  # no collective
    return next((g for g, m in zip(groups, rank_lists) if rank in m), None)


class CPChunks:
    """A loader whose batches keep this CP rank's chunks of every sequence: every CP
    rank of a DP rank reads the same batch, a function of (seed, step, dp rank), and
    keeps its own part, `split(t, cp_rank, cp)` (08's zigzag_split): (B, T/cp)."""

    def __init__(self, loader, grid: Grid, split):
        self.loader = loader
        self.grid = grid
        self.split = split

    def get_batch(self, step: int):
        x, y = self.loader.get_batch(step)  # (B, T) each, as on every CP peer
        x = self.split(x, self.grid.cp_rank, self.grid.cp)  # (B, T/cp)
        return x, self.split(y, self.grid.cp_rank, self.grid.cp)

    def position(self, step: int):
        return self.loader.position(step)


def cp_chunks(loader, grid: Grid, split):
    """`loader` itself at cp = 1, else CPChunks of it."""
    return loader if grid.cp == 1 else CPChunks(loader, grid, split)
