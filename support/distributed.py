"""Joining a torchrun job, printing from rank 0, self-launching ranks, collectives' old names,
and process groups made a dimension at a time.

A few world-wide calls: each dimension's groups come from ONE call (new_groups), so
startup makes O(dimensions) world-wide collectives, not O(world). On NCCL bound to a
GPU (init_process_group's device_id, as init_distributed binds it) every new_group
is a world-wide ncclCommSplit, non-members included: one per group made 448 of them at
1,024 GPUs (tp 8, pp 8, dp 16); dist.split_group cuts a whole dimension in one, every
rank calling it in the same order with the same lists (NCCL's rule), as torch's
DeviceMesh does. Unbound (gloo on CPU) split_group refuses, and a new_group is no
collective: a non-member returns at once, members meet through the store alone.
(new_subgroups_by_enumeration is a loop of new_group; use_local_synchronization=True
hangs a bound NCCL, whose members split the world's communicator without the rest.)
"""

import argparse
import importlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 300.0) -> tuple[int, int, int, torch.device]:
    """Join the torchrun job: (rank, local_rank, world_size, device).

    nccl on CUDA, else gloo. The timeout turns a hang (a rank skipped a collective) into
    an error. A process group already initialised is reused; without torchrun the world
    is one process.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        # Before init: NCCL binds each rank to its own GPU.
        torch.cuda.set_device(device)
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        # device_id (NCCL) binds the communicators to this GPU now, so no subgroup guesses.
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if cuda else None,
        )
    if dist.is_initialized():
        return dist.get_rank(), local_rank, dist.get_world_size(), device
    return 0, 0, 1, device


def print0(*args, **kwargs) -> None:
    """print, on global rank 0 only (or without a process group), flushed."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def relaunch_with_torchrun(ranks: int, argv, script: str) -> None:
    """Run `python script ARGS` as `torchrun --standalone --nproc_per_node=ranks script ARGS`."""
    args = ["--standalone", f"--nproc_per_node={ranks}", script, *argv]
    print(f"not started by torchrun, so running: torchrun {' '.join(args)}", flush=True)
    # One thread per rank: torchrun's own default when it starts several.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    importlib.import_module("torch.distributed.run").main(args)  # torchrun's own main


def run_on_ranks(demo, argv, script, doc, add_arguments=None, check=None):
    """A lesson's main: parse --ranks, then run demo(args, rank, world_size, device).

    --help describes the lesson by the first line of `doc`, its docstring.
    add_arguments(parser) adds the lesson's own flags (parser.set_defaults(ranks=4)
    changes --ranks' default). check(args, world_size) may raise ValueError or
    AssertionError, which become a usage error before any rank starts.
    Without torchrun (no WORLD_SIZE) `script` relaunches itself under torchrun with
    --ranks ranks; under torchrun each rank joins the job, runs the demo, and destroys
    the process group even when the demo fails.
    """
    argv = sys.argv[1:] if argv is None else argv
    formatter = argparse.ArgumentDefaultsHelpFormatter
    description = doc.split("\n")[0]
    parser = argparse.ArgumentParser(description=description, formatter_class=formatter)
    # subtle: --ranks, not --nproc, which torchrun would take for its --nproc-per-node.
    parser.add_argument("--ranks", type=int, default=2, help="ranks, without torchrun")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error("--ranks must be >= 1")
    world_size = int(os.environ.get("WORLD_SIZE", args.ranks))
    try:
        if check is not None:
            check(args, world_size)
    except (ValueError, AssertionError) as e:
        parser.error(str(e))
    if "WORLD_SIZE" not in os.environ:
        return relaunch_with_torchrun(args.ranks, argv, script)
    rank, _, world_size, device = init_distributed()
    try:
        demo(args, rank, world_size, device)
        dist.barrier()  # subtle: no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()


# torch 2.13 renamed the single-tensor collectives; torch 2.11 (the GPU machines) has only
# the old names. The lessons call these two functions, so the collective stays in sight.
def reduce_scatter_tensor(
    output, input, op=dist.ReduceOp.SUM, group=None, async_op=False
):
    """Sum every rank's `input`; rank r keeps slice r in `output` (reduce-scatter)."""
    kwargs = dict(op=op, group=group, async_op=async_op)
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(output, input, **kwargs)
    return dist.reduce_scatter_tensor(output, input, **kwargs)


def all_gather_tensor(output, input, group=None, async_op=False):
    """Every rank's `input`, concatenated in rank order into `output` (all-gather)."""
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def bound_to_device() -> bool:
    """The world's communicator is bound to a GPU (NCCL's eager init): groups split it."""
    return dist.group.WORLD.bound_device_id is not None


def world_timeout():
    """The timeout init_process_group gave the world (init_distributed passes
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
