"""Run a function on N gloo ranks on CPU, the way torchrun would, and return what each rank returned.

    results = run_ranks(fn, world_size=2, *args)   # [fn(0, 2, *args), fn(1, 2, *args)]

`fn(rank, world_size, *args, **kwargs)` must be a function of an importable module, not of
a script's __main__ (it is pickled by name into freshly forked processes: see the zygote
below). Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT on a free port) and, unless `init=False`, an initialised gloo default process
group that is destroyed in `finally`.

Failure handling, because a distributed test that hangs is worse than one that fails:
- an exception on any rank fails the call with that rank's full traceback;
- when one rank fails, the others are given a few seconds and then killed (they are usually
  blocked in a collective waiting for the dead rank);
- a rank that has not finished after `timeout` seconds is killed and reported by number;
- a rank that exits with a non-zero code fails the call even after it wrote its result (an abort
  at the interpreter's exit, SIGABRT: -6, fails a torchrun job too).

Results travel back through `torch.save` files rather than a multiprocessing queue: a tensor in a
queue is shared memory owned by the child, which dies before the parent reads it.

Ranks are forked from zygotes: helper interpreters (`python -m tests.distributed`), one per rank
index, started once per test session with their own PYTHONHASHSEED (string hashes, and so set
orders, differ across ranks as under torchrun), that import torch once and fork ranks. A spawned rank spent
3-6 s of CPU importing torch (and torch._dynamo, which torch.optim's first use imports); at 2 to
8 ranks a world on 2 cores that was most of a small world's time. A forked rank runs the same
_worker, then leaves with sys.exit, unwinding to the zygote's top level, so it exits through the
interpreter's normal finalisation as a torchrun rank does (multiprocessing's forkserver would end
it with os._exit, hiding an abort at exit). The zygote reaps its children and writes their exit
codes (negative: the signal) next to the results.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import random
import select
import signal
import socket
import subprocess
import sys
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
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` forked processes.

    Returns the list of per-rank return values, in rank order. Raises `RankError` with every
    failing rank's traceback, or naming the ranks still running after `timeout` seconds.
    """
    assert world_size >= 1, f"world_size must be >= 1, got {world_size}"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir:
        # subtle: the process group's own timeout must be shorter than ours, so a collective
        # waiting on a dead peer raises inside the rank instead of only being killed from outside.
        pg_timeout_s = max(5.0, timeout - GRACE_S)
        job = (fn, world_size, port, args, kwargs, out_dir, init, pg_timeout_s)
        where = (dict(os.environ), list(sys.path), os.getcwd())  # what spawn would pass on
        with open(Path(out_dir) / "job.pkl", "wb") as f:
            pickle.dump(where, f)  # read first: the job's functions may need the path
            pickle.dump(job, f)
        procs = _Zygote.fork(out_dir, world_size)
        try:
            timed_out = _wait(procs, out_dir, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        return _collect(procs, out_dir, timed_out, timeout)


class _Rank:
    """The parent's view of a rank the zygote forked: its pid, and its exit code once reaped."""

    def __init__(self, out_dir: str, rank: int, pid: int):
        self.exit_file = Path(out_dir) / f"rank{rank}.exit"
        self.pid = pid

    @property
    def exitcode(self):
        return int(self.exit_file.read_text()) if self.exit_file.exists() else None

    def is_alive(self) -> bool:
        return not self.exit_file.exists()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)


class _Zygote:
    """The helper interpreters that fork ranks, one per rank index, each started once with its
    own PYTHONHASHSEED: ranks hash strings differently, as torchrun's fresh interpreters do,
    so a collective issued in a set's iteration order still disagrees across ranks here.
    Each is fed one line (a job folder) per world on its stdin; it writes rank{r}.pid for its
    fork, then rank{r}.exit once reaped."""

    procs = {}  # rank index -> its zygote's Popen

    @classmethod
    def fork(cls, out_dir: str, world_size: int) -> list:
        for rank in range(world_size):
            proc = cls.procs.get(rank)
            if proc is None or proc.poll() is not None:
                root = Path(__file__).resolve().parents[1]
                argv = [sys.executable, "-m", "tests.distributed"]
                env = dict(os.environ, PYTHONHASHSEED=str(random.randrange(1, 2**32)))
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, cwd=root, env=env)
                cls.procs[rank] = proc
            proc.stdin.write(f"{rank} {out_dir}\n".encode())
            proc.stdin.flush()
        pids = [Path(out_dir) / f"rank{r}.pid" for r in range(world_size)]
        deadline = time.monotonic() + 120  # the zygotes' first imports, on a loaded machine
        while not all(p.exists() for p in pids):
            dead = [r for r in range(world_size) if cls.procs[r].poll() is not None]
            if time.monotonic() > deadline or dead:
                raise RankError(f"the zygotes of ranks {dead or 'all'} forked no rank")
            time.sleep(0.02)
        return [_Rank(out_dir, r, int(p.read_text())) for r, p in enumerate(pids)]


def _write(path: Path, text: str) -> None:
    """Whole or not at all (the parent polls for it); a folder already gone is ignored."""
    with contextlib.suppress(OSError):
        path.with_suffix(".tmp").write_text(text)
        path.with_suffix(".tmp").rename(path)


def _serve() -> None:
    """The zygote's loop: fork the rank of each job named on stdin, reap the ones that exit.
    A forked rank returns from here only by raising SystemExit (see _rank)."""
    children = {}
    lines = b""
    while True:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0.02)
        if readable:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:  # the test session is over
                return
            lines += chunk
        while b"\n" in lines:
            line, lines = lines.split(b"\n", 1)
            rank, out_dir = line.decode().split(" ", 1)
            rank = int(rank)
            pid = os.fork()
            if pid == 0:
                _rank(out_dir, rank)
            children[pid] = Path(out_dir) / f"rank{rank}.exit"
            _write(Path(out_dir) / f"rank{rank}.pid", str(pid))
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _write(children.pop(pid), str(os.waitstatus_to_exitcode(status)))


def _rank(out_dir: str, rank: int) -> None:
    """A forked rank: the parent's environment, path and folder, then _worker, then a normal
    exit (SystemExit unwinds to the zygote's top level and the interpreter finalises)."""
    try:
        os.close(sys.stdin.fileno())  # the zygote's job queue is not this rank's
        with open(Path(out_dir) / "job.pkl", "rb") as f:
            env, path, cwd = pickle.load(f)
            os.environ.clear()
            os.environ.update(env)
            sys.path[:] = path
            os.chdir(cwd)
            job = pickle.load(f)
        fn, world_size, port, args, kwargs, out_dir, init, pg_timeout_s = job
    except BaseException:  # noqa: BLE001 - an unpicklable job is reported as the rank's error
        torch.save({"error": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
        sys.exit(1)
    _worker(fn, rank, world_size, port, args, kwargs, out_dir, init, pg_timeout_s)
    sys.exit(0)


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


if __name__ == "__main__":
    # The zygote: import what every rank needs once, then fork ranks on demand.
    import numpy  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.nn.functional  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # imports torch._dynamo, once
    gc.collect()
    gc.freeze()  # the ranks' collections skip (and so do not copy) the zygote's objects
    _serve()
