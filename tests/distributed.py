"""Run a function on N gloo ranks on CPU, the way torchrun would, and return what each rank returned.

    results = run_ranks(fn, world_size=2, *args)   # [fn(0, 2, *args), fn(1, 2, *args)]

`fn(rank, world_size, *args, **kwargs)` must be a module-level function (it is pickled into
freshly spawned processes). Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT on a free port) and, unless `init=False`, an initialised gloo default
process group that is destroyed in `finally`.

Failure handling, because a distributed test that hangs is worse than one that fails:
- an exception on any rank fails the call with that rank's full traceback;
- when one rank fails, the others are given a few seconds and then killed (they are usually
  blocked in a collective waiting for the dead rank);
- a rank that has not finished after `timeout` seconds is killed and reported by number;
- a rank that exits with a non-zero code fails the call even after it wrote its result (an abort
  at the interpreter's exit, SIGABRT: -6, fails a torchrun job too).

Results travel back through `torch.save` files rather than a multiprocessing queue: a tensor in a
queue is shared memory owned by the child, which dies before the parent reads it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

GRACE_S = 5.0  # how long healthy ranks may take to notice a dead peer before we kill them


class RankError(RuntimeError):
    """One or more ranks raised, or timed out."""


ACK_TAG = 7177  # the emulation's acknowledgements travel apart from the data (tag 0)


class _GroupWork:
    """NCCL hands back ONE work for a whole batch_isend_irecv group: wait() waits for all of it."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


@contextlib.contextmanager
def nccl_p2p_rules():
    """Make gloo's batch_isend_irecv block the way NCCL's does, inside a rank.

    NCCL has no send buffer: a send completes only once the receiver has launched the group that
    holds the matching receive, and the group completes as a whole. Gloo buffers sends, so a
    schedule that deadlocks on GPUs passes on CPUs. Here every operation of a group also
    exchanges a small acknowledgement with its peer (a send waits for the receiver's ack, which
    the receiver posts when it launches its group), and the group comes back as one work."""
    real = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        acks = []
        for op in p2p_op_list:
            flag = torch.zeros(1)
            ack = dist.irecv if op.op is dist.isend else dist.isend  # the opposite direction
            acks.append(dist.P2POp(ack, flag, op.peer, op.group, tag=ACK_TAG))
        return [_GroupWork(real(list(p2p_op_list) + acks))]

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield
    finally:
        dist.batch_isend_irecv = real


def free_port() -> int:
    """A TCP port nobody is listening on right now (rank 0 binds it for the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, kwargs, out_dir, init, pg_timeout_s):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # N ranks share 2 cores: oversubscription makes everything slower
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        if init:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
            )
        result = fn(rank, world_size, *args, **kwargs)
        torch.save({"ok": result}, out)
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt/SystemExit
        torch.save({"error": traceback.format_exc()}, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, init: bool = True, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` spawned processes.

    Returns the list of per-rank return values, in rank order. Raises `RankError` with every
    failing rank's traceback, or naming the ranks still running after `timeout` seconds.
    """
    assert world_size >= 1, f"world_size must be >= 1, got {world_size}"
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir:
        # subtle: the process group's own timeout must be shorter than ours, so a collective
        # waiting on a dead peer raises inside the rank instead of only being killed from outside.
        pg_timeout_s = max(5.0, timeout - GRACE_S)
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, port, args, kwargs, out_dir, init, pg_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            timed_out = _wait(procs, out_dir, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        return _collect(procs, out_dir, timed_out, timeout)


def _failed(out_dir: str) -> bool:
    for f in Path(out_dir).glob("rank*.pt"):
        try:
            if "error" in torch.load(f, weights_only=False):
                return True
        except Exception:  # noqa: BLE001 - file still being written
            pass
    return False


def _wait(procs, out_dir: str, timeout: float) -> list[int]:
    """Wait until every rank exits, one fails (plus a grace period), or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(p.is_alive() for p in procs):
            return []
        if _failed(out_dir):
            deadline = min(deadline, time.monotonic() + GRACE_S)
        time.sleep(0.05)
    return [r for r, p in enumerate(procs) if p.is_alive()]


def _collect(procs, out_dir: str, timed_out: list[int], timeout: float):
    results, errors = [], []
    for r, p in enumerate(procs):
        f = Path(out_dir) / f"rank{r}.pt"
        payload = torch.load(f, weights_only=False) if f.exists() else {}
        results.append(payload.get("ok"))
        if "error" in payload:
            errors.append(f"--- rank {r} raised ---\n{payload['error']}")
        elif r in timed_out:  # with or without a result: a rank that hangs at exit fails too
            errors.append(f"--- rank {r} was still running after {timeout:.0f}s and was killed ---")
        elif not payload:
            errors.append(f"--- rank {r} died without a result (exit code {p.exitcode}) ---")
        elif p.exitcode != 0:
            # subtle: the result was written, then the rank died on its way out (SIGABRT at the
            # interpreter's exit is -6): a real script's job would fail, so the test does too.
            errors.append(f"--- rank {r} returned its result, then exited with {p.exitcode} ---")
    if errors:
        raise RankError(f"{len(errors)} of {len(procs)} ranks failed:\n" + "\n".join(errors))
    return results


def run_cases(rank: int, world_size: int, cases: dict) -> dict:
    """Every case(rank, world_size) of one spawned world: run_ranks(run_cases, N, CASES). A case
    that raises records its traceback instead, so the others still run (case_results reports it)."""
    results = {}
    for name, case in cases.items():
        try:
            results[name] = case(rank, world_size)
        except Exception:  # noqa: BLE001 - reported by the test that reads this case
            results[name] = {"error": traceback.format_exc()}
    return results


def case_results(per_rank: list, case: str) -> list:
    """Each rank's result for one case of run_cases; a case that raised on any rank fails."""
    results = [r[case] for r in per_rank]
    for r, res in enumerate(results):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"case {case!r} raised on rank {r}:\n{res['error']}")
    return results
