"""The process grid of train.py: torch.arange(world).view(pp, dp, cp, tp), its groups.

TP varies fastest, then CP, so TP and CP peers share a node and its NVLink (as
Megatron-LM orders them); PP varies slowest, so only pipeline sends cross nodes.
rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. CP ranks hold the same
weights and different tokens of the same sequences, so gradients are averaged, and
ZeRO shards, over the DP x CP ranks: dp_cp_group (dp_group itself when cp = 1, and
cp_group itself when dp = 1).

Its groups come from support/distributed.new_groups, one world-wide call a dimension.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from support.distributed import new_groups


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
