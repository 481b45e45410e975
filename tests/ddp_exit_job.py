"""Many short 2-rank jobs of 03_ddp.py's DataParallel, each rank ending the way a torchrun script
does: destroy the process group, then let the interpreter exit. Used by tests/test_ddp.py.

    python tests/ddp_exit_job.py JOBS      -> exit 0 if every rank of every job exited with 0

What it catches: a collective launched inside backward whose last reference a gloo worker thread
drops while Python is finalising. That thread must take the GIL to free the Python object the
collective copied from backward's thread-local state; a finalising interpreter ends the thread
instead, in the middle of a C++ destructor, and the process aborts with "terminate called
without an active exception" (SIGABRT). 03_ddp.py's DataParallel keeps the handles to prevent
it. Every backward here launches all-reduces from both places DataParallel launches them:
gradient hooks (the body's buckets) and the end-of-backward callback (the bucket of `late`,
whose gradient comes from a no_sync() pass): the callback's launches are the ones that showed
the abort (tests/test_ddp.py has the counts).
NaiveDataParallel is not run here: it all-reduces after backward, from the caller's own thread
state, so its collectives copy no Python object and it keeps no handles (30 naive-only jobs,
run as the test runs these: 0 aborted).

Each job forks its two ranks from this interpreter, which imported torch once: a rank costs a
fraction of a second instead of seconds of imports. The ranks get torchrun's environment and
finalise their own interpreter as usual (sys.exit). Nothing runs torch before the fork.
"""

import importlib
import os
import socket
import sys
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

ddp = importlib.import_module("03_ddp")
SWITCH_S = float(os.environ.get("SWITCH_S", 0.5))  # the amplifier: see rank_main
ALIVE = []


class LateLayer(nn.Module):
    """A small MLP, and `late`: registered first, so its buckets are the last, and used only in
    no_sync() passes. In a synchronised pass its hooks do not fire, so its buckets start from
    the end-of-backward callback with the gradient no_sync() left, after the body's buckets
    started from hooks."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(8, 1)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, late: bool = False):
        return self.body(x) + (self.late(x) if late else 0)  # (B, 1)


def rank_main(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    # subtle: the amplifier. A gloo thread left holding a backward's last collective waits for
    # the GIL, and a waiting thread only forces a switch after the switch interval. At 5 ms it
    # gets the GIL while this script still runs (harmless); at 0.5 s its turn comes during the
    # interpreter's finalisation (0.3 to 1 s with torch loaded), where the thread is ended: the
    # abort. Jobs aborted on HEAD before the fix (2 cores, other work running), out of 30: at
    # 0.3 / 0.6 / 1.0 / 2.0 s: 7 / 7 / 8 / 0 (at 2 s the exit is over first); without it:
    # 0 of 60, 0 of 24 and 1 of 12 (run as separate interpreters).
    sys.setswitchinterval(SWITCH_S)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = ddp.DataParallel(LateLayer(), bucket_mb=1e-7)  # a bucket per parameter
        for _ in range(3):  # later backward passes release the earlier passes' handles
            with model.no_sync():
                model(torch.randn(4, 8), late=True).sum().backward()
            model(torch.randn(4, 8)).sum().backward()
        # Alive until the interpreter exits, as a model built at a script's top level is (and as
        # the old wrappers were, kept by their own hooks): then nothing frees the handles before
        # the exit. A model freed when this function returns hid a wrapper that dropped them.
        ALIVE.append(model)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job() -> list[int]:
    """Fork the two ranks of one job; return their process ids."""
    port, pids = free_port(), []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # the rank: run, then exit through the interpreter's normal finalisation
            try:
                rank_main(rank, port)
            except BaseException:
                traceback.print_exc()
                sys.exit(1)
            sys.exit(0)
        pids.append(pid)
    return pids


def exit_codes(pids) -> list[int]:
    """Wait for the ranks; negative: the signal that ended one (-6: SIGABRT)."""
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def main(jobs: int, in_flight: int = 2) -> int:
    """Run the jobs, in_flight at a time (2 jobs on 2 cores: half the wall time of one)."""
    running, failed = [], []
    for j in range(jobs):
        running.append((j, start_job()))
        while len(running) >= in_flight or (running and j == jobs - 1):
            k, pids = running.pop(0)
            if any(codes := exit_codes(pids)):
                failed.append(f"job {k}: exit codes {codes}")
    print(f"{len(failed)} of {jobs} two-rank jobs failed", *failed, sep="\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
