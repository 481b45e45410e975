"""The multi-rank helper every distributed test relies on must itself be trustworthy:
results come back per rank, a failing rank fails the test with its traceback, and a hung
rank times out instead of hanging the suite; a rank that aborts at exit fails it too."""

import atexit
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankError, run_ranks


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # 0 + 1 + ... + (N-1) = N(N-1)/2 on every rank
    return rank, world_size, scale * t.item(), hash("the same string")


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def _rank1_hangs(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return "rank 0 finished"


def _rank1_aborts_at_exit(rank, world_size):
    if rank == 1:
        atexit.register(os.abort)  # SIGABRT while the interpreter exits, after the result
    return rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_returns_each_ranks_result(world_size):
    expected_sum = world_size * (world_size - 1) / 2
    results = run_ranks(_sum_of_ranks, world_size, 10.0)
    got = [result[:3] for result in results]
    assert got == [(r, world_size, 10.0 * expected_sum) for r in range(world_size)]
    # Each rank hashes strings its own way, as torchrun's interpreters do (their own
    # random hash seeds), so a set iterated in a collective's order differs across ranks
    # here too; forked from one interpreter, they would all agree.
    hashes = [result[3] for result in results]
    assert len(set(hashes)) == world_size, f"ranks share a string hash: {hashes}"


def test_a_failing_rank_fails_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(_rank1_raises, 2, timeout=60)
    msg = str(err.value)
    assert "rank 1 raised" in msg and "ValueError: boom on rank one" in msg
    # the healthy rank blocked in barrier() is killed after the grace period, not after 60 s
    assert time.monotonic() - start < 30


def test_a_hung_rank_times_out_and_is_named():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 was still running after 8s"):
        run_ranks(_rank1_hangs, 2, timeout=8, init=False)
    assert time.monotonic() - start < 25


def test_a_rank_that_aborts_after_its_result_fails():
    """The abort this guards against (issue 30): a rank returns, its result is written, and the
    process dies at exit with SIGABRT (exit code -6). run_ranks used to return the results."""
    with pytest.raises(RankError, match="rank 1 returned its result, then exited with -6"):
        run_ranks(_rank1_aborts_at_exit, 2, init=False)
