"""The process grid of train.py: torch.arange(world).view(pp, dp, tp), and its groups.

TP varies fastest, so TP peers share a node and its NVLink; PP varies slowest, so only
pipeline sends cross nodes. rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
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
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_group: object = None
    tp_group: object = None
    pp_group: object = None
    embed_group: object = None  # The {first, last} stage, holding the tied embeddings.


def build_grid(
    pp: int, dp: int, tp: int, rank: int, world: int, embedding_group
) -> Grid:
    """Every rank creates every group, in order (new_group is a collective), and keeps
    the ones it belongs to. `embedding_group(pp_rank_lists)` is 05's: it makes the
    {first, last} stage group of every pipeline and returns this rank's (or None)."""
    grid = Grid(rank=rank, world=world, dp=dp, tp=tp, pp=pp)
    if world == 1:
        return grid
    ranks = torch.arange(world).view(pp, dp, tp)  # ranks[pp_rank, dp_rank, tp_rank]
    where = (ranks == rank).nonzero()[0].tolist()
    grid.pp_rank, grid.dp_rank, grid.tp_rank = where

    def mine(rank_lists):
        groups = [dist.new_group(members) for members in rank_lists]
        return next(g for g, members in zip(groups, rank_lists) if rank in members)

    grid.tp_group = mine(ranks.reshape(-1, tp).tolist())  # ranks[p, d, :] for each p, d
    grid.dp_group = mine(
        ranks.transpose(1, 2).reshape(-1, dp).tolist()
    )  # ranks[p, :, t]
    pp_lists = ranks.permute(1, 2, 0).reshape(-1, pp).tolist()  # ranks[:, d, t]
    grid.pp_group = mine(pp_lists)
    grid.embed_group = embedding_group(pp_lists)  # None at pp = 1: no second copy.
    return grid
