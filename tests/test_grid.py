"""support/train/grid.py's process grid: each dimension's groups made in ONE world-wide call.

The worked example: 8 ranks as (pp 2, dp 2, tp 2), rank = ((pp_rank * dp + dp_rank) * cp +
cp_rank) * tp + tp_rank. Rank 5 is (pp 1, dp 0, tp 1): its TP group is {4, 5}, its DP group
{5, 7}, its PP group {1, 5}, and its embedding group (the first and last stage of its
pipeline) {1, 5} too. On NCCL bound to a GPU every new_group splits the world's
communicator, every rank taking part: the old grid made 4 TP + 4 DP + 4 PP + 4 embedding
groups, 16 world-wide splits; one split a dimension makes 4. At 1,024 GPUs (tp 8, pp 8,
dp 16) the old way made 128 + 64 + 128 + 128 = 448, the new 4 (6 with CP and DP x CP).

No GPU here: the bound path runs on gloo with dist.split_group emulated (split_group itself
refuses an unbound world), recording what each rank passed; the unbound path is gloo's own.
"""

import importlib
import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from support import distributed
from support.train import grid as grid_lib
from tests.distributed import GRACE_S, run_ranks

pipe = importlib.import_module("05_pipeline")

# (pp, dp, cp, tp) on 8 ranks: the layout; CP beside DP (its DP x CP group); four
# stages (two middle stages hold no embedding copy).
LAYOUTS = [(2, 2, 1, 2), (1, 2, 2, 2), (4, 1, 1, 2)]
NAMES = ("tp_group", "dp_group", "pp_group", "embed_group", "cp_group", "dp_cp_group")


def expected_groups(rank: int, pp: int, dp: int, cp: int, tp: int) -> dict:
    """Each group's ranks for `rank`, from the formula alone (None: no group)."""
    coords = list(itertools.product(range(pp), range(dp), range(cp), range(tp)))
    p, d, c, t = coords[rank]

    def ranks_where(keep):  # the ranks whose coordinates pass keep(p', d', c', t')
        return [r for r, co in enumerate(coords) if keep(*co)]

    want = {
        "tp_group": ranks_where(lambda p2, d2, c2, t2: (p2, d2, c2) == (p, d, c)),
        "dp_group": ranks_where(lambda p2, d2, c2, t2: (p2, c2, t2) == (p, c, t)),
        "pp_group": ranks_where(lambda p2, d2, c2, t2: (d2, c2, t2) == (d, c, t)),
        "embed_group": None,
        "cp_group": None,
        "dp_cp_group": None,
    }
    if pp > 1 and p in (0, pp - 1):
        want["embed_group"] = [want["pp_group"][0], want["pp_group"][-1]]
    if cp > 1:
        want["cp_group"] = ranks_where(lambda p2, d2, c2, t2: (p2, d2, t2) == (p, d, t))
    # DP x CP: dp_group itself at cp 1, cp_group itself at dp 1.
    want["dp_cp_group"] = ranks_where(lambda p2, d2, c2, t2: (p2, t2) == (p, t))
    return want


def members(group):
    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _build_all(rank, world):
    """Every layout's grid, unbound (gloo's own new_group), then bound (split_group
    emulated). For each: the groups' ranks, and the world-wide calls this rank made: each
    split_group, and each new_group made while bound (a split of the world's communicator
    then, non-members included). The emulation makes its groups with the real new_group,
    uncounted, as every rank entering one call would."""
    real_new_group = dist.new_group
    real_bound = distributed.bound_to_device
    calls = []
    bound = [False]

    def new_group(*args, **kwargs):
        if bound[0]:
            calls.append(("new_group", args[0] if args else kwargs.get("ranks")))
        return real_new_group(*args, **kwargs)

    def split_group(parent_pg=None, split_ranks=None, **kwargs):
        calls.append(("split_group", split_ranks))
        made = [real_new_group(r) for r in split_ranks]
        return next((g for g, r in zip(made, split_ranks) if rank in r), None)

    dist.new_group = new_group
    real_split = dist.split_group
    dist.split_group = split_group
    distributed.bound_to_device = lambda: bound[0]
    out = {}
    try:
        for is_bound in (False, True):
            bound[0] = is_bound
            for pp, dp, cp, tp in LAYOUTS:
                del calls[:]
                args = (pp, dp, tp, rank, world, pipe.embedding_group, cp)
                grid = grid_lib.build_grid(*args)
                groups = {name: members(getattr(grid, name)) for name in NAMES}
                coords = (grid.pp_rank, grid.dp_rank, grid.cp_rank, grid.tp_rank)
                out[is_bound, (pp, dp, cp, tp)] = (groups, coords, list(calls))
    finally:
        dist.new_group = real_new_group
        dist.split_group = real_split
        distributed.bound_to_device = real_bound
    return out


def test_every_dimension_is_one_world_wide_split_and_the_groups_are_the_old_ones():
    """On each of 8 ranks, bound and unbound: every group holds the ranks the formula gives
    (the old layout's: DP x CP is dp_group at cp 1, a group of its own at dp 2, cp 2). Bound:
    one split_group per dimension and no new_group, with the same lists on every rank in the
    same order (NCCL's rule), each list a partition of the world into disjoint groups (the
    embedding pairs: the first and last stages only). The old grid made 16 world-wide calls at
    (pp 2, dp 2, tp 2); this test then counts 16 and fails."""
    results = run_ranks(_build_all, 8, timeout=240)
    for (pp, dp, cp, tp), is_bound in itertools.product(LAYOUTS, (False, True)):
        layout = f"pp {pp}, dp {dp}, cp {cp}, tp {tp}, bound {is_bound}"
        per_rank = [res[is_bound, (pp, dp, cp, tp)] for res in results]
        for rank, (groups, coords, _) in enumerate(per_rank):
            want = expected_groups(rank, pp, dp, cp, tp)
            assert groups == want, f"{layout}, rank {rank}"
            p, d, c, t = coords
            assert rank == ((p * dp + d) * cp + c) * tp + t, f"{layout}: {coords}"
        calls = [c for _, _, c in per_rank]
        if not is_bound:  # gloo: no collective to count (a new_group is none there)
            continue
        assert all(c == calls[0] for c in calls), f"{layout}: ranks split differently"
        assert {op for op, _ in calls[0]} == {"split_group"}, calls[0]
        # tp, dp and pp; the embedding pairs; cp; dp x cp.
        dims = 3 + (pp > 1) + (cp > 1) + (cp > 1 and dp > 1)
        assert len(calls[0]) == dims, f"{layout}: {len(calls[0])} world-wide calls"
        for i, (_, lists) in enumerate(calls[0]):
            flat = sorted(r for ranks in lists for r in ranks)
            if (
                i != 3 or pp == 1
            ):  # a dimension's groups cut the world into disjoint sets
                assert flat == list(range(8)), f"{layout}: not a partition: {lists}"
        embed_lists = calls[0][3][1] if pp > 1 else None
        if pp == 2:
            assert embed_lists == calls[0][2][1], "pp 2: the pairs are the PP groups"
        if pp == 4:
            assert embed_lists == [[0, 6], [1, 7]], embed_lists


def _build_on_the_world(rank, world):
    """A (pp 2) grid on 2 ranks, unbound, then with the world's own bound_device_id set (the
    check bound_to_device reads; the helper itself not replaced), dist.split_group faked as
    in _build_all. For each: the groups' ranks and the timeout every new_group and
    split_group was given."""
    real_new_group, real_split = dist.new_group, dist.split_group
    world_pg = dist.group.WORLD
    calls = []

    def unbound_new_group(ranks):  # Bound, new_group would split the world: gloo cannot.
        device, world_pg.bound_device_id = world_pg.bound_device_id, None
        try:
            return real_new_group(ranks)
        finally:
            world_pg.bound_device_id = device

    def new_group(ranks, timeout=None, **kwargs):
        calls.append(("new_group", timeout))
        return unbound_new_group(ranks)

    def split_group(parent_pg=None, split_ranks=None, timeout=None, **kwargs):
        calls.append(("split_group", timeout))
        made = [unbound_new_group(r) for r in split_ranks]
        return next((g for g, r in zip(made, split_ranks) if rank in r), None)

    dist.new_group, dist.split_group = new_group, split_group
    out = {}
    try:
        for bound in (False, True):
            # Any GPU index: a gloo world only holds it (split_group is faked).
            world_pg.bound_device_id = torch.device("cuda:0") if bound else None
            del calls[:]
            grid = grid_lib.build_grid(2, 1, 1, rank, world, pipe.embedding_group)
            out[bound] = ({name: members(getattr(grid, name)) for name in NAMES}, list(calls))
    finally:
        world_pg.bound_device_id = None
        dist.new_group, dist.split_group = real_new_group, real_split
    return out


def test_a_bound_world_splits_and_every_group_waits_the_worlds_timeout():
    """The world's own bound_device_id (not the helper bound_to_device) picks the path: set,
    each dimension is one split_group (tp, dp, pp and the embedding pairs: 4) and no
    new_group; unset, new_group only. Either way every call carries the world's timeout
    (run_ranks's, 55 s here), not torch's default (10 minutes on NCCL, 30 on gloo), so a
    hung DP, PP or TP collective fails as soon as a world-wide one would. The groups are the
    formula's on both paths."""
    timeout = 60.0
    results = run_ranks(_build_on_the_world, 2, timeout=timeout)
    world_timeout = timedelta(seconds=max(5.0, timeout - GRACE_S))  # run_ranks's own rule
    for rank, res in enumerate(results):
        for bound, op in ((False, "new_group"), (True, "split_group")):
            groups, calls = res[bound]
            assert groups == expected_groups(rank, 2, 1, 1, 1), f"bound {bound}"
            assert {o for o, _ in calls} == {op}, f"bound {bound}: {calls}"
            assert all(t == world_timeout for _, t in calls), f"bound {bound}: {calls}"
        assert len(res[True][1]) == 4, res[True][1]
