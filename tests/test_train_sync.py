"""train.py at full speed: a plain step (no log line, no evaluation, no checkpoint) makes no
host-device synchronisation from the project's own code, and the next batch is prefetched
without changing which batch a step reads. Also: fp16's skipped steps logged, the timeout.

A sync is a call that makes the CPU wait for the GPU to drain: `.item()`, `.tolist()`,
`.numpy()`, `.cpu()`, `bool()`, `int()`, `float()` or formatting of a tensor. On a CPU none of
them waits for anything, so the test counts the calls themselves: every such Tensor method is
wrapped, and a call counts when the frame that made it is in one of the project's files (the
numbered lessons, train.py, support/), never when torch calls it from inside itself.
"""

import contextlib
import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from support.prefetch import Prefetcher
from tests.distributed import run_ranks
from tests.test_train import BASE, data_dir, metrics  # noqa: F401 (data_dir: the fixture)

train = importlib.import_module("train")
ROOT = Path(__file__).resolve().parents[1]
# Every Tensor method through which Python code reads a tensor's value on the host.
SYNCS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__format__",
    "__repr__",
)
STEPS = 8  # Steps 0 and 7 log a line; 1..6 are plain.
VOTE = 4  # --vote-interval: the preemption vote (one .item()) after steps 3 and 7.


def ours(filename: str) -> bool:
    """A file of the project (not torch's, not a test's)."""
    path = Path(filename).resolve()
    return path.parent in (ROOT, ROOT / "support") and path.suffix == ".py"


@contextlib.contextmanager
def counting_syncs(log: list):
    """Append (method, file:line) to `log` for each call to a SYNCS method made from our files."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def wrap(name, real):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1)
            if ours(caller.f_code.co_filename):
                log.append(f"{name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return real(self, *args, **kwargs)

        return counted

    for name, real in originals.items():
        setattr(torch.Tensor, name, wrap(name, real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)


def syncs_per_step(argv) -> list[list[str]]:
    """train.main(argv) with the syncs counted: the calls made from one train_step's start to
    the next one's (the step, then the loop's logging, evaluation, checkpoint and vote)."""
    log, starts = [], []
    real_step = train.train_step

    def marked(run, step):
        starts.append(len(log))
        return real_step(run, step)

    train.train_step = marked
    try:
        with counting_syncs(log):
            train.main(argv)
    finally:
        train.train_step = real_step
    ends = starts[1:] + [len(log)]
    return [log[a:b] for a, b in zip(starts, ends)]


def check_plain_steps(per_step, world: int, name: str) -> None:
    """Steps 1..6 are plain: no sync, except the vote's one .item() after step 3 when world > 1."""
    assert len(per_step) == STEPS, name
    for step in range(1, STEPS - 1):
        allowed = 1 if world > 1 and (step + 1) % VOTE == 0 else 0
        calls = per_step[step]
        assert len(calls) <= allowed, f"{name}, step {step}: {len(calls)} syncs: {calls}"


def flags(data, out_dir, extra):
    quiet = ["--log-interval", "100", "--max-steps", str(STEPS), "--vote-interval", str(VOTE)]
    return BASE + ["--data-dir", data, "--out-dir", out_dir] + quiet + extra


def test_a_plain_step_makes_no_sync_on_one_process(data_dir, tmp_path):  # noqa: F811
    """4 accumulated microbatches of 2. Before: 06's global_token_count read the token count
    (.item() twice), accumulate_gradients each microbatch's loss (.item() x 4), train_step the
    loss and the gradient norm: 8 syncs a step. A world of one votes without a collective."""
    per_step = syncs_per_step(flags(data_dir, str(tmp_path), ["--micro-batch-size", "2"]))
    check_plain_steps(per_step, 1, "1 process, 4 microbatches")
    assert per_step[0], "step 0 logs a line: it reads the loss (the counting works)"


LAYOUTS = [
    ("dp2", ["--dp", "2", "--micro-batch-size", "2"]),
    ("tp2", ["--tp", "2", "--micro-batch-size", "4"]),
    ("pp2", ["--pp", "2", "--micro-batch-size", "2"]),
]


def _two_ranks(rank, world, data, tmp):
    out = []
    for name, extra in LAYOUTS:
        out.append(syncs_per_step(flags(data, f"{tmp}/{name}", extra)))
        dist.barrier()
    return out


def test_a_plain_step_makes_no_sync_at_dp2_tp2_pp2(data_dir, tmp_path):  # noqa: F811
    """The same at dp 2, tp 2 and pp 2, on every rank. Before, the preemption vote (an
    all-reduce and .item()) ran after every step; now once every --vote-interval steps."""
    results = run_ranks(_two_ranks, 2, data_dir, str(tmp_path), timeout=300)
    for rank, per_layout in enumerate(results):
        for (name, _), per_step in zip(LAYOUTS, per_layout):
            check_plain_steps(per_step, 2, f"{name}, rank {rank}")
            if rank == 0:
                assert any(per_step[STEPS - 1]), f"{name}: the last step logs (reads the loss)"


# ---------------------------------------------------------------------------------------------
# The next batch, prefetched
# ---------------------------------------------------------------------------------------------
def test_the_prefetched_batch_is_the_one_read_on_demand_across_a_resume(data_dir):  # noqa: F811
    """support/prefetch reads step s+1's batch on a thread while step s computes. A step's
    batch must stay the loader's pure function of (seed, step, dp rank): over 6 steps of an
    epoch boundary (9 steps an epoch here, at 4 of 8 rows and dp rank 1 of 2), and after a
    "resume" (a new Prefetcher started at step 12, as train() is after a checkpoint), every
    batch equals DataLoader.get_batch's, read afresh. Catches a prefetcher one step ahead or
    behind (it hands out step s+1's batch), or one that keeps the batch a resume should skip."""
    loader = train.data_lib.DataLoader(data_dir, "train", 4, 32, seed=3, dp_rank=1, dp_size=2)
    fresh = train.data_lib.DataLoader(data_dir, "train", 4, 32, seed=3, dp_rank=1, dp_size=2)
    steps = loader.steps_per_epoch
    for start, count in ((steps - 3, 6), (steps + 3, 3)):
        batches = Prefetcher(loader, "cpu")
        for step in range(start, start + count):
            x, y = batches.get_batch(step)
            want_x, want_y = fresh.get_batch(step)
            assert torch.equal(x, want_x) and torch.equal(y, want_y), f"step {step}"
        assert list(batches.ahead) == [start + count], "the next step's batch is on its way"
        assert batches.position(start) == fresh.position(start)
        batches.close()


# ---------------------------------------------------------------------------------------------
# A skipped fp16 step is recorded; the process group's timeout is a flag
# ---------------------------------------------------------------------------------------------
def test_a_step_the_fp16_scaler_skips_is_logged_as_skipped(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """The loss scale starts at 2^120, so every fp16 gradient overflows: the scaler skips and
    halves the scale each step (2^116 after 4 steps: still far too large). With a log line only
    every 100 steps, steps 1 and 2 are logged anyway, each with "skipped": true (and a gradient
    norm that is not finite). Before, metrics.jsonl had no such field, and a
    skipped step between two log lines left no trace."""
    make_scaler = train.mp_lib.make_scaler
    monkeypatch.setattr(train.mp_lib, "make_scaler",
                        lambda dtype: make_scaler(dtype, init_scale=2.0**120))  # fmt: skip
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--dtype", "fp16",
                   "--log-interval", "100", "--micro-batch-size", "4"]  # fmt: skip
    train.main(argv)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["skipped"] is True for r in rows), rows
    assert not any(math.isfinite(r["grad_norm"]) for r in rows), "the gradients overflowed"


def test_timeout_minutes_reaches_the_process_group(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """--timeout-minutes 0.5 gives init_distributed 30 s (it was a fixed 5 minutes: rank 0 can
    write a checkpoint's metadata alone behind a barrier for longer, on slow storage)."""
    seen = []
    real = train.distributed.init_distributed

    def spy(timeout_s=300.0):
        seen.append(timeout_s)
        return real(timeout_s)

    monkeypatch.setattr(train.distributed, "init_distributed", spy)
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--max-steps", "1"]
    train.main(argv + ["--timeout-minutes", "0.5"])
    assert seen == [30.0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
