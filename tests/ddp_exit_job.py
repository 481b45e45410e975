"""Many short 2-rank jobs of 03_ddp.py's DataParallel (its default hook, 03b's fp16 and
PowerSGD hooks) and 07_zero.py's ZeRO-2 and ZeRO-3, in turn, each rank ending the way a torchrun
script does: destroy the process group, then let the interpreter exit. Used by tests/test_ddp.py
and tests/ddp_exit_count.py.

    python tests/ddp_exit_job.py JOBS [KINDS]   -> exit 0 if every rank of every job exited with 0
        KINDS: default "DP,ZeRO-2,DP,ZeRO-3", in turn; also fp16 and powersgd (DataParallel
        with 03b_compression.py's hooks)
    BACKEND=nccl: the ranks on cuda:0 and cuda:1 (default gloo, on the CPU)
    KEEP=0: the control, support/ddp/gloo_exit.py keeping no waited handle (the workaround off)

What it catches: a collective launched inside backward whose last reference a gloo worker thread
drops while Python is finalising. That thread must take the GIL to free the Python object the
collective copied from backward's thread-local state (gloo's AsyncWork keeps a
ThreadLocalState); a finalising interpreter ends the thread instead, in the middle of a C++
destructor, and the process aborts with "terminate called without an active exception"
(SIGABRT). All measured on torch 2.13.0 (CI's pin since the first commit): without a workaround
about 6% of jobs under load (issue 30), and 1 of 15 ZeRO-2 exits in a CI run (commit 898a44c).
So 03 and 07 launch every collective through support/ddp/gloo_exit.py, which on gloo keeps each
waited handle a while and drops what is left at exit from the main thread. Issue 39 counted 0
of 100 jobs with the workaround removed, too few to clear it (tests/ddp_exit_count.py has the
counts); this job is the check that no rank aborts.
Every backward here launches collectives from both places the wrappers launch them: gradient
hooks (the blocks' and the head's buckets or flats) and the end-of-backward callback (the
bucket, or the root unit's flat, holding `late`, whose gradient comes from a no_sync() pass).
NaiveDataParallel is not run here: it all-reduces after backward, from the caller's own thread
state, so its collectives copy no Python object.

Each job forks its two ranks from this interpreter, which imported torch once: a rank costs a
fraction of a second instead of seconds of imports. The ranks get torchrun's environment and
finalise their own interpreter as usual (sys.exit). Before the fork the parent only builds a
throwaway optimizer: torch.optim's first use imports torch._dynamo, ~3 s in every rank otherwise.
"""

import importlib
import os
import socket
import sys
import traceback
from datetime import timedelta

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # repo root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.optim import SGD  # noqa: E402

SGD(
    [torch.zeros(1, requires_grad=True)]
)  # imports torch._dynamo here, once (see above)

ddp = importlib.import_module("03_ddp")
compression = importlib.import_module("03b_compression")
zero_lib = importlib.import_module("07_zero")
SWITCH_S = float(os.environ.get("SWITCH_S", 0.5))  # the amplifier: see rank_main
BACKEND = os.environ.get("BACKEND", "gloo")
if os.environ.get("KEEP", "1") == "0":  # the control: the workaround off
    from support.ddp import gloo_exit  # noqa: E402

    gloo_exit._keep = lambda work: None


class LateLayer(nn.Module):
    """Two blocks (ZeRO's units: 07's zero_units finds transformer.h), a head, and `late`:
    registered first, so its buckets are the last and it sits in the root unit's flat, and used
    only in no_sync() passes. In a synchronised pass its hooks do not fire, so that bucket (that
    flat) is reduced from the end-of-backward callback with the gradient no_sync() left, after
    the others started from hooks."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(8, 1)
        blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)
        )
        self.transformer = nn.ModuleDict({"h": blocks})
        self.head = nn.Linear(8, 1)

    def forward(self, x, late: bool = False):
        for block in self.transformer.h:
            x = block(x)  # (B, 8)
        return self.head(x) + (self.late(x) if late else 0)  # (B, 1)


def rank_main(rank: int, port: int, kind: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # subtle: the amplifier. A gloo thread left holding a backward's last collective waits for
    # the GIL, and a waiting thread only forces a switch after the switch interval. At 5 ms it
    # gets the GIL while this script still runs (harmless); at 0.5 s its turn comes during the
    # interpreter's finalisation (0.3 to 1 s with torch loaded), where the thread is ended: the
    # abort. Jobs aborted on torch 2.13.0 without a workaround (2 cores, other work
    # running), out of 30: at 0.3 / 0.6 / 1.0 / 2.0 s: 7 / 7 / 8 / 0 (at 2 s the exit is
    # over first); without it: 0 of 60, 0 of 24 and 1 of 12 (run as separate interpreters).
    sys.setswitchinterval(SWITCH_S)
    device = torch.device("cpu")
    if BACKEND == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        module = LateLayer().to(device)
        if kind in ("DP", "fp16", "powersgd"):
            hook = None  # the default: all-reduce the mean
            if kind == "fp16":
                hook = compression.HalfPrecision(torch.half)
            elif kind == "powersgd":  # one exact pass, then sketched ones
                hook = compression.PowerSGD(module.parameters(), rank=1, warmup_steps=1)
            model = ddp.DataParallel(module, bucket_mb=1e-7, comm_hook=hook)  # a bucket each
            opt = None
        else:
            stage = int(kind[-1])
            model, opt = zero_lib.zero_data_parallel(
                module, stage, module.parameters(), SGD, lr=0.1
            )
        for _ in range(3):  # later passes (steps) release the earlier ones' handles
            with model.no_sync():
                model(torch.randn(4, 8, device=device), late=True).sum().backward()
            model(torch.randn(4, 8, device=device)).sum().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
        # The wrapper is dropped when this function returns, as 03's and 07's demos drop
        # each wrapper they build, with its last backward's handles.
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(kind: str) -> list[int]:
    """Fork the two ranks of one job; return their process ids."""
    port, pids = free_port(), []
    for rank in range(2):
        pid = os.fork()
        if (
            pid == 0
        ):  # the rank: run, then exit through the interpreter's normal finalisation
            try:
                rank_main(rank, port, kind)
            except BaseException:
                traceback.print_exc()
                sys.exit(1)
            sys.exit(0)
        pids.append(pid)
    return pids


def exit_codes(pids) -> list[int]:
    """Wait for the ranks; negative: the signal that ended one (-6: SIGABRT)."""
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def main(jobs: int, kinds: list[str], in_flight: int = 2) -> int:
    """Run the jobs, kinds in turn, in_flight at a time (2 jobs on 2 cores: half the wall time)."""
    running, failed, runs = [], {kind: [] for kind in kinds}, dict.fromkeys(kinds, 0)
    for j in range(jobs):
        kind = kinds[j % len(kinds)]
        runs[kind] += 1
        running.append((j, kind, start_job(kind)))
        while len(running) >= in_flight or (running and j == jobs - 1):
            k, job_kind, pids = running.pop(0)
            if any(codes := exit_codes(pids)):
                failed[job_kind].append(f"job {k} ({job_kind}): exit codes {codes}")
    counts = ", ".join(f"{kind} {len(failed[kind])} of {runs[kind]}" for kind in runs)
    lines = [line for kind in runs for line in failed[kind]]
    n_failed = len(lines)
    print(
        f"{n_failed} of {jobs} two-rank jobs failed ({counts})",
        *lines,
        sep="\n",
        flush=True,
    )
    return 1 if n_failed else 0


if __name__ == "__main__":
    KINDS = (sys.argv[2] if len(sys.argv) > 2 else "DP,ZeRO-2,DP,ZeRO-3").split(",")
    sys.exit(main(int(sys.argv[1]), KINDS))
